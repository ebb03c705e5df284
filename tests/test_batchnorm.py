"""Cross-replica BatchNorm: statistics over the global batch, equal to one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracle import rel_err

import replicator as rp
from replicator.models import CNN

STEPS = 3


def image_batches(n=STEPS, batch=32, seed=0):
    rng = np.random.default_rng(seed)
    # A per-channel offset and scale make the batch statistics far from 0 and 1.
    return [
        {
            "x": (3.0 + 2.0 * rng.normal(size=(batch, 8, 8, 2))).astype(np.float32),
            "y": rng.integers(0, 10, size=(batch,)).astype(np.int32),
        }
        for _ in range(n)
    ]


def cnn_parts(tx):
    model = CNN(in_channels=2, num_classes=10, width=8, rngs=nnx.Rngs(0))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    state = {"params": params, "stats": stats, "opt": tx.init(params)}

    def step(state, batch):
        def loss_fn(params, stats):
            m = nnx.merge(graphdef, params, stats, copy=True)
            logits = m(batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, nnx.state(m, nnx.BatchStat)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["stats"]
        )
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "stats": stats, "opt": opt}
        return new, {"loss": rp.all_reduce(loss, "mean")}

    return state, step


@pytest.mark.parametrize("lowering", ["shard_map", "pmap"])
def test_nnx_cross_replica_batchnorm_equals_full_batch(lowering):
    data = image_batches()
    state, step = cnn_parts(optax.sgd(0.1))
    step = jax.jit(step)
    for batch in data:
        state, _ = step(state, batch)
    expected = state

    repl = rp.Replicator(lowering=lowering)
    state, step = cnn_parts(repl.wrap_optimizer(optax.sgd(0.1)))
    state = repl.replicate(state)
    for batch in data:
        state, _ = repl.run(step, state, batch)
    assert rel_err(state["stats"], expected["stats"]) <= 1e-5
    assert rel_err(state["params"], expected["params"]) <= 1e-5
    mean = state["stats"]["bn1"]["mean"][...]
    assert float(jnp.max(jnp.abs(mean))) > 0.1  # the running statistics really moved


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(6, use_bias=False)(x)  # a bias before BatchNorm has no gradient
        x = nn.BatchNorm(use_running_average=False, axis_name=rp.replica_axis_name())(x)
        return nn.Dense(1)(jax.nn.relu(x))


def test_linen_batchnorm_with_replica_axis_name():
    rng = np.random.default_rng(1)
    x = (1.0 + rng.normal(size=(32, 4))).astype(np.float32)
    net = LinenNet()
    variables = net.init(jax.random.key(0), x)

    def step(variables, x):
        def loss_fn(params):
            y, updates = net.apply({**variables, "params": params}, x, mutable=["batch_stats"])
            return jnp.mean((y - 1.0) ** 2), updates["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        grads = rp.all_reduce(grads, "mean")
        params = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads)
        return {"params": params, "batch_stats": stats}, {"loss": rp.all_reduce(loss, "mean")}

    expected, _ = jax.jit(step)(variables, x)
    repl = rp.Replicator()
    got, out = repl.run(step, repl.replicate(variables), x)
    assert rel_err(got, expected) <= 1e-5
    np.testing.assert_allclose(out["loss"], np.full(8, out["loss"][0]))
