"""Cross-replica BatchNorm: statistics over the global batch, equal to one device."""

import contextlib

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

    def loss_of(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return nnx_parts(model, tx, loss_of)


def nnx_parts(model, tx, loss_of):
    """``(state, step_fn)`` training an nnx ``model`` whose BatchNorm statistics are state."""
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    state = {"params": params, "stats": stats, "opt": tx.init(params)}

    def step(state, batch):
        def loss_fn(params, stats):
            m = nnx.merge(graphdef, params, stats, copy=True)
            loss = loss_of(m(batch["x"]), batch)
            return loss, nnx.state(m, nnx.BatchStat)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["stats"]
        )
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "stats": stats, "opt": opt}
        return new, {"loss": rp.all_reduce(loss, "mean")}

    return state, step


@pytest.mark.parametrize("lowering", ["shard_map", "pmap"])
@pytest.mark.slow
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


class AxisNameInInit(nnx.Module):
    """A model that reads the replica axis name when it is built, in ``__init__``."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 6, use_bias=False, rngs=rngs)  # BatchNorm follows: no bias
        self.bn = nnx.BatchNorm(6, axis_name=rp.replica_axis_name(), rngs=rngs)
        self.head = nnx.Linear(6, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.bn(self.dense(x))))


def regression_batches(n=STEPS, batch=32, seed=2):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": (2.0 + 1.5 * rng.normal(size=(batch, 4))).astype(np.float32),
            "y": rng.normal(size=(batch, 1)).astype(np.float32),
        }
        for _ in range(n)
    ]


def mse(pred, batch):
    return jnp.mean((pred - batch["y"]) ** 2)


def train_axis_name_in_init(repl, data, *, in_context):
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    with repl.context() if in_context else contextlib.nullcontext():
        model = AxisNameInInit(nnx.Rngs(0))
        state, step = nnx_parts(model, tx, mse)
        state = repl.replicate(state)
    losses = []
    for batch in data:
        state, out = repl.run(step, state, batch)
        losses.append(np.asarray(out["loss"]))
    return model, state, losses


def one_device(data):
    state, step = nnx_parts(AxisNameInInit(nnx.Rngs(0)), optax.sgd(0.1), mse)
    step = jax.jit(step)
    losses = []
    for batch in data:
        state, out = step(state, batch)
        losses.append(float(out["loss"]))
    return state, losses


def test_nnx_batchnorm_built_outside_any_context_is_refused_at_the_first_step():
    """Read outside the trace and outside ``repl.context()``, the axis name is None: each
    replica would take statistics of its own 4 examples. The default check refuses the step."""
    repl = rp.Replicator(mesh_shape={"data": 8})
    with pytest.raises(rp.ReplicasDivergedError, match=r"state leaf \['stats'\]\['bn'\]\['mean'\]"):
        train_axis_name_in_init(repl, regression_batches(), in_context=False)
    # Unchecked, it trains silently differently from one device:
    expected, expected_losses = one_device(regression_batches())
    repl = rp.Replicator(mesh_shape={"data": 8}, check_replicas=False)
    _, state, losses = train_axis_name_in_init(repl, regression_batches(), in_context=False)
    assert abs(losses[-1][0] - expected_losses[-1]) / expected_losses[-1] > 1e-2
    assert rel_err(state["params"], expected["params"]) > 1e-3


@pytest.mark.parametrize(
    ("mesh_shape", "lowering", "axis_name"),
    [
        ({"data": 8}, "shard_map", "data"),
        ({"data": 8}, "pmap", "data"),
        ({"dcn_data": 2, "data": 4}, "shard_map", ("dcn_data", "data")),
        ({"data": 4, "model": 2}, "shard_map", "data"),
    ],
)
def test_nnx_batchnorm_built_inside_the_context_equals_one_device(mesh_shape, lowering, axis_name):
    data = regression_batches()
    expected, expected_losses = one_device(data)
    repl = rp.Replicator(mesh_shape=mesh_shape, lowering=lowering)
    model, state, losses = train_axis_name_in_init(repl, data, in_context=True)
    assert model.bn.axis_name == axis_name
    for got, want in zip(losses, expected_losses, strict=True):
        np.testing.assert_allclose(got, np.full(repl.num_replicas, want), rtol=1e-5)
    assert rel_err(state["params"], expected["params"]) <= 1e-5
    assert rel_err(state["stats"], expected["stats"]) <= 1e-5
    assert float(jnp.max(jnp.abs(state["stats"]["bn"]["mean"][...]))) > 0.05  # moved from 0


@pytest.mark.parametrize(
    ("mesh_shape", "lowering"),
    [
        ({"data": 8}, "shard_map"),
        ({"data": 8}, "pmap"),
        ({"dcn_data": 2, "data": 4}, "shard_map"),
        ({"data": 2, "stage": 4}, "shard_map"),
        ({"data": 1}, "local"),
    ],
)
def test_replica_axis_name_in_a_context_is_the_value_step_fn_sees(mesh_shape, lowering):
    traced = []

    def step(state, x):
        traced.append(rp.replica_axis_name())
        return state, None

    devices = jax.devices()[: 1 if lowering == "local" else 8]
    repl = rp.Replicator(mesh_shape=mesh_shape, lowering=lowering, devices=devices)
    repl.run(step, repl.replicate(jnp.zeros(())), np.ones(8))
    assert rp.replica_axis_name() is None
    with repl.context():
        assert rp.replica_axis_name() == traced[0]
        local = rp.Replicator(lowering="local")
        local.run(step, local.replicate(jnp.zeros(())), np.ones(8))  # a binding wins
        assert traced[-1] is None
    assert rp.replica_axis_name() is None
