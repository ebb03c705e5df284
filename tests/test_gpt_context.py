"""The long-context GPT: its sequence split over `context` (ring attention in the zigzag or the
contiguous layout, or all-to-all over heads), with `model`, `stage` (GPipe, 1F1B) and ZeRO-3,
trains three SGD steps as one device with the full batch; `gpt.apply` gives one device's logits
in the natural order; a ring under 1F1B is refused."""

import dataclasses
import functools
import math

import jax
import numpy as np
import optax
import pytest
from oracle import rel_err

import replicator as rp
from replicator import attention, pipeline
from replicator.models import gpt

TOL = 1e-5
CONFIG = gpt.GPTConfig(vocab_size=64, seq_len=32, d_model=32, num_heads=4, num_layers=2)
GLOBAL_BATCH = 8
ATTENTION = {  # how the sequence is laid out and attended over
    "ring": dict(attention="ring"),  # zigzag, the default
    "ring-contiguous": dict(attention="ring", zigzag=False),
    "all_to_all": dict(attention="all_to_all"),
}


def make_repl(mesh_shape):
    n = math.prod(mesh_shape.values())
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


def config_for(name, num_layers=2):
    return dataclasses.replace(CONFIG, num_layers=num_layers, **ATTENTION[name])


def batches(n=3, seed=7):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(0, CONFIG.vocab_size, size=(GLOBAL_BATCH, CONFIG.seq_len + 1))
        t = t.astype(np.int32)
        out.append({"tokens": t[:, :-1], "targets": t[:, 1:]})
    return out


def loss_fn(config):
    return lambda params, batch: gpt.loss(params, batch["tokens"], batch["targets"], config=config)


@functools.cache
def oracle(num_layers):
    """Three SGD steps on one device with the full batch: parameters and losses. Without a
    `context` axis the GPT attends in natural order with plain attention, whatever its
    ``attention`` and ``zigzag`` say, so one oracle serves them all."""
    config = dataclasses.replace(CONFIG, num_layers=num_layers)
    params, tx = gpt.init(config, jax.random.key(0)), optax.sgd(0.1)

    @jax.jit
    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(loss_fn(config))(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    opt, losses = tx.init(params), []
    for batch in batches():
        params, opt, loss = step(params, opt, batch)
        losses.append(float(loss))
    return params, np.array(losses)


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


def unshard(tree):
    is_sharded = lambda x: isinstance(x, rp.ShardedParam)
    return jax.tree.map(lambda p: np.asarray(p.value), tree, is_leaf=is_sharded)


def train(repl, config, zero_stage=0):
    """Three steps of ``wrap_optimizer(sgd).step`` on `gpt.place`'s layout (ZeRO-3: stored
    with ``shard_params``, the blocks' layer axis kept whole): the trained parameters (host
    arrays), the losses, the state."""
    tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=zero_stage)
    traces = []

    def step(state, batch):
        traces.append(1)
        params, opt, metrics = tx.step(loss_fn(config), state["params"], state["opt"], batch)
        return {"params": params, "opt": opt}, {"loss": metrics["loss"]}

    placed = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
    if zero_stage == 3:
        placed = tx.shard_params(placed, stacked=gpt.zero_stacked(config))
    state, losses = {"params": placed, "opt": tx.init(placed)}, []
    for batch in batches():
        state, out = repl.run(step, state, batch)
        losses.append(float(np.asarray(out["loss"])[0]))
    assert len(traces) == 1
    got = unshard(state["params"]) if zero_stage == 3 else jax.tree.map(np.asarray, state["params"])
    return got, np.array(losses), state


def check_against_oracle(got, losses, num_layers):
    want, want_losses = oracle(num_layers)
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert rel_err(losses, want_losses) <= TOL, (losses, want_losses)
    initial = gpt.init(dataclasses.replace(CONFIG, num_layers=num_layers), jax.random.key(0))
    assert rel_err(got, initial) > 1e-3  # training moved them


slow = pytest.mark.slow
CM = {"data": 2, "context": 2, "model": 2}
C4 = {"data": 2, "context": 4}


@pytest.mark.parametrize(
    "mesh_shape, name",
    [
        (CM, "ring"),  # zigzag, with the heads split over `model`
        (CM, "ring-contiguous"),
        (CM, "all_to_all"),
        (C4, "ring"),  # (all-to-all over 4 devices: tests/test_attention.py's)
    ],
    ids=lambda v: "x".join(map(str, v.values())) if isinstance(v, dict) else v,
)
@pytest.mark.slow  # 5-11 s each; the fast lane runs `gpt.apply` on a context mesh below
def test_context_parallel_gpt_trains_as_one_device(mesh_shape, name):
    """Each device holds 1/C of every sequence (and with `model`, 1/T of the heads and MLP
    units); three SGD steps equal one device."""
    repl = make_repl(mesh_shape)
    config = config_for(name)
    got, losses, state = train(repl, config)
    check_against_oracle(got, losses, config.num_layers)
    t, d = mesh_shape.get("model", 1), config.d_model
    assert shard_shapes(state["params"]["blocks"]["attn"]["qkv"]) == {(2, d, 3 * d // t)}


@pytest.mark.slow
def test_zero3_with_context_trains_as_one_device():
    """{"data": 2, "context": 4}, ZeRO-3: every parameter stored split over the 2 replicas
    (the blocks' layer axis whole), gathered layer by layer inside the scan, while the
    activations are split over `context`; three steps equal one device."""
    repl = make_repl({"data": 2, "context": 4})
    config = config_for("ring")
    got, losses, state = train(repl, config, zero_stage=3)
    check_against_oracle(got, losses, config.num_layers)
    d = config.d_model
    qkv = state["params"]["blocks"]["attn"]["qkv"].value
    assert shard_shapes(qkv) == {(2, d // 2, 3 * d)}  # layers whole, rows over data
    assert shard_shapes(state["params"]["embed"]["tokens"].value) == {(32, d)}


# -- pipelines ---------------------------------------------------------------------------------


def train_pipeline(repl, config, schedule):
    """Three steps of `gpt.pipeline_value_and_grad` on `gpt.place_pipeline`'s layout."""
    grad_fn = gpt.pipeline_value_and_grad(config, num_microbatches=2, schedule=schedule)
    tx = repl.wrap_optimizer(optax.sgd(0.1))

    def step(state, batch):
        loss, grads = grad_fn(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    params = gpt.init(config, jax.random.key(0))
    k = repl.mesh.shape["stage"]
    placed = gpt.place_pipeline(repl, params, num_stages=k, config=config)
    state, losses = {"params": placed, "opt": tx.init(placed)}, []
    for batch in batches():
        state, out = repl.run(step, state, batch)
        losses.append(float(np.asarray(out["loss"])[0]))
    params = state["params"]
    got = {
        "embed": params["embed"],
        "blocks": pipeline.unstack_stages(params["stages"]),
        "head": params["head"],
    }
    return jax.tree.map(np.asarray, got), np.array(losses)


@pytest.mark.parametrize(
    "mesh_shape, name, schedule",
    [
        ({"data": 2, "stage": 2, "context": 2}, "ring", pipeline.GPipe()),
        ({"data": 2, "stage": 2, "context": 2}, "all_to_all", pipeline.OneFOneB()),
        ({"data": 1, "stage": 2, "context": 2, "model": 2}, "ring", pipeline.GPipe()),
    ],
    ids=["gpipe-ring", "1f1b-all_to_all", "gpipe-ring-model"],
)
@pytest.mark.slow
def test_pipelined_context_parallel_gpt_trains_as_one_device(mesh_shape, name, schedule):
    """DP x PP x CP (x TP): two stages of two blocks, each block's sequence split over
    `context`; the zigzag layout is laid out once, before the first stage. Three steps equal
    one device."""
    config = config_for(name, num_layers=4)
    got, losses = train_pipeline(make_repl(mesh_shape), config, schedule)
    check_against_oracle(got, losses, config.num_layers)


def test_ring_under_1f1b_is_refused_with_the_fix():
    repl = make_repl({"data": 2, "stage": 2, "context": 2})
    config = config_for("ring")
    grad_fn = gpt.pipeline_value_and_grad(config, num_microbatches=2, schedule="1f1b")
    placed = gpt.place_pipeline(repl, gpt.init(config, jax.random.key(0)), num_stages=2)
    with pytest.raises(
        ValueError,
        match=r"^replicator: a ring over 'context' .* cannot run inside the '1f1b' pipeline "
        r"schedule.* Use attention impl='all_to_all' \(GPTConfig\(attention='all_to_all'\)",
    ):
        repl.run(lambda p, b: (p, {"loss": grad_fn(p, b)[0]}), placed, batches(1)[0])


# -- the model's outputs ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ring", pytest.param("all_to_all", marks=slow)])
def test_apply_gives_one_devices_logits_in_natural_order(name):
    """On {"data": 2, "context": 4} the zigzag ring lays the sequence out in zigzag order
    inside the model; `gpt.apply` puts the logits back, and they equal one device's."""
    config = config_for(name)
    repl = make_repl({"data": 2, "context": 4})
    params = gpt.init(config, jax.random.key(0))
    tokens = batches(1)[0]["tokens"]
    orders = []

    def step(params, tokens):
        orders.append(gpt.sequence_order(config, tokens.shape[-1]))
        return params, {"logits": gpt.apply(params, tokens, config=config)}

    _, out = repl.run(step, gpt.place(repl, params, config=config), tokens)
    got = np.asarray(out["logits"]).reshape(GLOBAL_BATCH, config.seq_len, config.vocab_size)
    want = gpt.apply(params, tokens, config=config)
    assert rel_err(got, want) <= TOL
    if name == "ring":
        np.testing.assert_array_equal(orders[0], attention.zigzag_order(config.seq_len, 4))
    else:
        assert orders == [None]
    assert gpt.sequence_order(config, config.seq_len) is None  # outside a step: natural order
