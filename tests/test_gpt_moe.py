"""The mixture-of-experts GPT: every ``moe_every``-th block's MLP a mixture of 4 experts, the
experts split over `expert` (and with ZeRO-3 over `data` too) on {"data": 2, "expert": 4};
three SGD steps equal one device with the full batch, the same tokens dropped; no pipeline."""

import dataclasses
import functools
import math

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from oracle import rel_err

import replicator as rp
from replicator.models import gpt

TOL = 1e-5
MESH = {"data": 2, "expert": 4}
CONFIG = gpt.GPTConfig(
    vocab_size=64, seq_len=16, d_model=32, num_heads=4, num_layers=2, num_experts=4
)
GLOBAL_BATCH = 8  # 4 sequences per replica: one routing group per device of `expert`


def make_repl(mesh_shape):
    n = math.prod(mesh_shape.values())
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


def config_for(moe_every, top_k, capacity_factor):
    return dataclasses.replace(
        CONFIG, moe_every=moe_every, top_k=top_k, capacity_factor=capacity_factor
    )


def params0(config):
    """`gpt.init`'s parameters with wider routers (std 0.5 rather than 0.02): their choices are
    then far from ties, so that summing in another order cannot flip one (as in test_moe)."""
    params = gpt.init(config, jax.random.key(0))
    router = params["blocks"]["moe"]["moe"]["router"]
    params["blocks"]["moe"]["moe"]["router"] = 25 * router
    return params


def batches(n=3, seed=7):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(0, CONFIG.vocab_size, size=(GLOBAL_BATCH, CONFIG.seq_len + 1))
        t = t.astype(np.int32)
        out.append({"tokens": t[:, :-1], "targets": t[:, 1:]})
    return out


def loss_fn(config):
    def loss(params, batch):
        return gpt.loss_and_stats(params, batch["tokens"], batch["targets"], config=config)

    return loss


@functools.cache
def oracle(config):
    """Three SGD steps on one device with the full batch: parameters, losses, and each step's
    MoE statistics (``dropped`` and ``routed`` summed over the batch)."""
    params, tx = params0(config), optax.sgd(0.1)

    @jax.jit
    def step(params, opt, batch):
        (loss, stats), g = jax.value_and_grad(loss_fn(config), has_aux=True)(params, batch)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss, stats

    opt, losses, stats = tx.init(params), [], []
    for batch in batches():
        params, opt, loss, st = step(params, opt, batch)
        losses.append(float(loss))
        stats.append(jax.tree.map(np.asarray, st))
    return params, np.array(losses), stats


def train(repl, config, zero_stage=0):
    """The same three steps on ``repl``, each replica's ``step_fn`` its own batch: the trained
    parameters (host arrays), the losses, each step's statistics summed over the replicas, and
    the stored parameters."""
    tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=zero_stage)

    def step(state, batch):
        grad = jax.value_and_grad(loss_fn(config), has_aux=True)
        (loss, stats), g = grad(state["params"], batch)
        updates, opt = tx.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        counts = {k: rp.all_reduce(stats[k], "sum") for k in ("dropped", "routed")}
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean"), **counts}

    placed = gpt.place(repl, params0(config), config=config)
    if zero_stage == 3:
        placed = tx.shard_params(placed, stacked=gpt.zero_stacked(config))
    state, losses, stats = {"params": placed, "opt": tx.init(placed)}, [], []
    for batch in batches():
        state, out = repl.run(step, state, batch)
        losses.append(float(np.asarray(out["loss"])[0]))
        stats.append({k: np.asarray(out[k])[0] for k in ("dropped", "routed")})
    is_sharded = lambda x: isinstance(x, rp.ShardedParam)
    host = jax.tree.map(lambda p: np.asarray(getattr(p, "value", p)), state["params"],
                        is_leaf=is_sharded)  # fmt: skip
    return host, np.array(losses), stats, state["params"]


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


@pytest.mark.parametrize(
    "moe_every, top_k, capacity_factor, zero_stage",
    [  # (top-1 dropless without ZeRO: the others' paths; tests/test_moe.py's layer oracles)
        (1, 2, 0.5, 0),
        (2, 2, None, 0),
        (1, 2, None, 3),
        (2, 1, 0.5, 3),  # ZeRO-3 with the blocks stacked twice
    ],
)
@pytest.mark.slow  # 10-12 s each; the fast lane has tests/test_moe.py's layer oracles
def test_expert_parallel_gpt_trains_as_one_device(moe_every, top_k, capacity_factor, zero_stage):
    """{"data": 2, "expert": 4}: each device holds 1 of the 4 experts of every MoE block and
    routes 1 of its replica's 4 sequences (the rest of the block runs on its sequence too);
    three SGD steps give one device's losses and parameters, and the same number of dropped
    token-choices, step by step (none without a capacity factor)."""
    config = config_for(moe_every, top_k, capacity_factor)
    got, losses, stats, stored = train(make_repl(MESH), config, zero_stage)
    want, want_losses, want_stats = oracle(config)
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert rel_err(losses, want_losses) <= TOL, (losses, want_losses)
    assert rel_err(got, params0(config)) > 1e-3  # training moved them
    routed = GLOBAL_BATCH * config.seq_len * top_k * config.num_moe_layers
    for got_s, want_s in zip(stats, want_stats, strict=True):
        assert got_s["dropped"] == want_s["dropped"]  # exactly: the same choices dropped
        assert got_s["routed"] == want_s["routed"] == routed
    dropped = [int(s["dropped"]) for s in want_stats]
    if capacity_factor is None:
        assert dropped == [0, 0, 0]
    else:
        assert min(dropped) > 0, dropped
    # The experts of each MoE block: [groups, E, ...], E / 4 per device (over data too, ZeRO-3).
    groups, e, d, f = config.num_moe_layers, config.num_experts, config.d_model, config.hidden
    experts = stored["blocks"]["moe"]["moe"]
    if zero_stage == 3:
        assert shard_shapes(experts["up"].value) == {(groups, e // 4, d // 2, f)}
        assert shard_shapes(experts["down"].value) == {(groups, e // 4, f // 2, d)}
    else:
        assert shard_shapes(experts["up"]) == {(groups, e // 4, d, f)}
        assert shard_shapes(experts["down"]) == {(groups, e // 4, f, d)}
        assert experts["up"].sharding.spec == P(None, "expert")


@pytest.mark.slow
def test_expert_and_model_axes_together_train_as_one_device():
    """{"data": 2, "expert": 2, "model": 2}: each device holds 2 of the 4 experts, each with
    half its hidden units (the experts' "mlp" role over `model`, as the dense MLP's); three SGD
    steps with drops equal one device, the dropped counts exactly."""
    config = config_for(1, 2, 0.5)
    got, losses, stats, stored = train(make_repl({"data": 2, "expert": 2, "model": 2}), config)
    want, want_losses, want_stats = oracle(config)
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert rel_err(losses, want_losses) <= TOL, (losses, want_losses)
    assert [s["dropped"] for s in stats] == [s["dropped"] for s in want_stats]
    up = stored["blocks"]["moe"]["moe"]["up"]
    assert up.sharding.spec == P(None, "expert", None, "model")
    groups, e, d, f = config.num_moe_layers, config.num_experts, config.d_model, config.hidden
    assert shard_shapes(up) == {(groups, e // 2, d, f // 2)}


def test_dense_blocks_between_moe_blocks_are_zero3_stacked_twice():
    """With ``moe_every=2`` the dense blocks of each group are stacked again, ``[groups,
    moe_every - 1, ...]``: `gpt.zero_stacked` keeps both layer axes whole, so the layer scans
    slice them before gathering."""
    config = config_for(2, 1, None)
    assert gpt.zero_stacked(config) == {"blocks": 2}
    assert gpt.zero_stacked(config_for(1, 1, None)) == {"blocks": 1}
    assert gpt.zero_stacked(dataclasses.replace(CONFIG, num_experts=0)) == {"blocks": 1}
    repl = make_repl(MESH)
    tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=3)
    placed = gpt.place(repl, params0(config), config=config)
    stored = tx.shard_params(placed, stacked=gpt.zero_stacked(config))
    up = stored["blocks"]["dense"]["mlp"]["up"]  # [1 group, 1 dense block, d, 4 d]
    assert up.shape == (1, 1, config.d_model, config.hidden)
    assert shard_shapes(up.value) == {(1, 1, config.d_model // 2, config.hidden)}


@pytest.mark.parametrize(
    "attention, zigzag",
    [
        pytest.param("all_to_all", True, marks=pytest.mark.slow),
        pytest.param("ring", False, marks=pytest.mark.slow),
        # zigzag=True: an MoE model keeps the natural order (`gpt.sequence_order`), since its
        # routing gives priority by position and a reordered sequence would drop other tokens.
        pytest.param("ring", True, marks=pytest.mark.slow),
    ],
    ids=["all_to_all", "ring-contiguous", "ring-zigzag"],
)
def test_moe_with_a_context_axis_routes_as_one_device(attention, zigzag):
    """{"data": 2, "expert": 2, "context": 2}: the sequences split over `context` in
    attention; each MoE block routes whole sequences. With a capacity that drops, the loss and
    the dropped count of one forward pass equal one device's."""
    config = dataclasses.replace(config_for(1, 2, 0.5), attention=attention, zigzag=zigzag)
    params, batch = params0(config), batches(1)[0]
    repl = make_repl({"data": 2, "expert": 2, "context": 2})

    def step(params, batch):
        loss, stats = loss_fn(config)(params, batch)
        dropped = rp.all_reduce(stats["dropped"], "sum")
        return params, {"loss": rp.all_reduce(loss, "mean"), "dropped": dropped}

    _, out = repl.run(step, gpt.place(repl, params, config=config), batch)
    want, want_stats = jax.jit(loss_fn(config))(params, batch)
    assert int(want_stats["dropped"]) > 0
    assert int(np.asarray(out["dropped"])[0]) == int(want_stats["dropped"])
    assert rel_err(float(np.asarray(out["loss"])[0]), float(want)) <= TOL


def test_moe_gpt_has_no_pipeline_layout():
    with pytest.raises(
        ValueError,
        match=r"^gpt\.pipeline_value_and_grad: the mixture-of-experts GPT \(num_experts=4\) has "
        r"no pipeline layout: .* Train it without a 'stage' axis \(e\.g\. mesh \{data: 2, "
        r"expert: 4\}\), or set num_experts=0\.$",
    ):
        gpt.pipeline_value_and_grad(CONFIG, num_microbatches=2)
