"""Dropless experts over an ``expert`` axis in rounds of bounded receive buffers: the loss, the
gradients of every parameter and of the input on ``{data: 2, expert: 4}`` and ``{data: 2,
expert: 2, model: 2}`` against one device with the full batch, on random routing (which
overflows round 0) and on routing where every token picks the same expert (every row of every
device for one device: the most overflow rounds there can be)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from oracle import rel_err

import replicator as rp
from replicator import moe
from replicator._src.sharded import exchange

TOL = 1e-5
B, S, D, F, E = 8, 16, 32, 32, 8  # 8 groups of 16 tokens: 1 group a device on 8 devices


def params_for(gated, one_expert):
    params = moe.init(jax.random.key(0), d_model=D, hidden=F, num_experts=E, gated=gated,
                      bias=not gated)  # fmt: skip
    params = {k: 5 * v if k != "router" else v for k, v in params.items()}  # far from linear
    if not gated:
        keys = jax.random.split(jax.random.key(2), 2)
        params["up_bias"] = 0.1 * jax.random.normal(keys[0], (E, F))
        params["down_bias"] = 0.1 * jax.random.normal(keys[1], (E, D))
    router = 0.5 * jax.random.normal(jax.random.key(1), (D, E))
    if one_expert:  # feature 0 (10 on every token) votes for expert 0, then 1, by a wide margin
        router = router.at[0, 0].set(4.0).at[0, 1].set(2.0)
    return {**params, "router": router}


def data(one_expert):
    rng = np.random.default_rng(0)
    x, t = (rng.normal(size=(B, S, D)).astype(np.float32) for _ in range(2))
    if one_expert:
        x[..., 0] = 10.0
    return x, t


def loss_fn(params, x, t, routing, activation):
    y, stats = moe.apply(params, x, routing=routing, activation=activation)
    return jnp.mean((x + y - t) ** 2) + 0.01 * jnp.mean(stats.aux_loss)


def specs(params, model):
    hidden = "model" if model else None
    by_hidden = {"up": P("expert", None, hidden), "gate": P("expert", None, hidden),
                 "up_bias": P("expert", hidden), "down": P("expert", hidden, None)}  # fmt: skip
    return {k: by_hidden.get(k, spec) for k, spec in moe.partition_specs(
        gated="gate" in params, bias="up_bias" in params).items()}  # fmt: skip


def on_mesh(mesh_shape, params, x, t, routing, activation):
    """The loss and the gradients (parameters: their mean over replicas, as logical arrays;
    input: each replica's, stacked) of one step on ``mesh_shape``."""
    n = math.prod(mesh_shape.values())
    repl = rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])

    def step(params, x, t):
        grad = jax.value_and_grad(loss_fn, argnums=(0, 1))
        loss, (g, gx) = grad(params, x, t, routing, activation)
        return rp.all_reduce(g, "mean"), {"loss": rp.all_reduce(loss, "mean"), "gx": gx}

    placed = repl.place(params, specs(params, "model" in mesh_shape))
    g, out = repl.run(step, placed, x, t)
    if "model" in mesh_shape:
        assert placed["up"].sharding.spec == P("expert", None, "model")
    replicas = mesh_shape["data"]
    gx = np.asarray(out["gx"]).reshape(B, S, D) / replicas  # each replica's mean: 1 / replicas
    return float(np.asarray(out["loss"])[0]), jax.tree.map(np.asarray, g), gx


@pytest.mark.parametrize(
    "mesh_shape, top_k, one_expert",
    [
        ({"data": 2, "expert": 4}, 2, False),
        ({"data": 2, "expert": 4}, 1, True),  # every token to expert 0
        ({"data": 2, "expert": 2, "model": 2}, 2, False),
        ({"data": 2, "expert": 2, "model": 2}, 2, True),  # every token to experts 0 and 1
    ],
)
def test_rounds_are_one_device(mesh_shape, top_k, one_expert):
    gated = "model" in mesh_shape  # Mixtral's experts there; biased GELU ones on the other
    routing = moe.Routing(num_experts=E, top_k=top_k, capacity_factor=None, receive_factor=1.0)
    activation = jax.nn.silu if gated else jax.nn.gelu
    params, (x, t) = params_for(gated, one_expert), data(one_expert)
    loss, (g, gx) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)), static_argnums=(3, 4))(
        params, x, t, routing, activation
    )
    got_loss, got_g, got_gx = on_mesh(mesh_shape, params, x, t, routing, activation)
    assert abs(got_loss - float(loss)) <= TOL * abs(float(loss))
    assert rel_err(got_g, g) <= TOL, jax.tree.map(lambda a, b: rel_err(a, b), got_g, dict(g))
    assert rel_err(got_gx, gx) <= TOL, rel_err(got_gx, gx)
    assert min(float(np.abs(v).max()) for v in jax.tree.leaves(g)) > 0  # every leaf has a grad


def overflow_rounds(params, x, routing, n):
    """The overflow rounds the step ran (the longest stream's), on ``n`` devices of expert."""
    from replicator._src.sharded import routing as routing_lib

    choices, _ = routing_lib.route(params["router"], jnp.asarray(x), routing)
    per_device = np.asarray(choices.expert).reshape(n * 2, -1)  # 2 replicas, n devices each
    counts = np.stack([np.bincount(e, minlength=E) for e in per_device])  # [2n, E]
    rows = per_device.shape[1]
    b, b2 = exchange.buffers(rows, n, routing.receive_factor)
    streams = counts.reshape(2, n, n, E // n).sum(axis=(1, 3))  # [replica, receiver]
    return int(np.max(-(-np.maximum(streams - b, 0) // b2)))


def test_random_and_one_expert_routing_overflow_round_0():
    """The routing of the test above overflows round 0 (one round of ``R / 32`` rows or more),
    and all-to-one routing sends one device every row: ``(N R - B) / B2`` rounds."""
    routing = moe.Routing(num_experts=E, top_k=2, capacity_factor=None, receive_factor=1.0)
    random = overflow_rounds(params_for(False, False), data(False)[0], routing, 4)
    assert random >= 1
    one = overflow_rounds(params_for(False, True), data(True)[0], routing, 4)
    rows = B // 8 * S * 2
    assert one == (4 * rows - rows) // 8  # B = R = 32, B2 = 8 rows: 12 rounds


def test_buffers():
    assert exchange.buffers(65536, 4, 1.05) == (68816, 2048)  # multiples of 8 rows
    assert exchange.buffers(32, 4, 1.0) == (32, 8)
    assert exchange.buffers(100, 2, 2.0) == (200, 0)  # round 0 holds every stream: no overflow
    assert exchange.buffers(100, 2, 3.0) == (200, 0)
    with pytest.raises(ValueError, match=r"receive_factor must be a number >= 1 .* got 0.5"):
        moe.Routing(num_experts=4, capacity_factor=None, receive_factor=0.5)
