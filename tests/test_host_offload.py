"""Parameters and optimizer state kept in host memory between steps (`rp.to_host`, MaxText's
``parameter_memory_host_offload`` and ``optimizer_memory_host_offload``): each step brings a
layer's parameters to the device where it uses them, updates on the device and puts the new
state back in host memory. The numbers are one device's."""

import functools
import json
import pathlib

import jax
import numpy as np
import optax
import pytest
from oracle import rel_err
from test_llama import CONFIG, batches, host, loss_fn, make_repl, one_device

import replicator as rp
from replicator._src.core import placement
from replicator.cli import config, jobs
from replicator.models import gpt

TOL = 1e-5
ADAM = functools.partial(optax.adam, 3e-3, eps=1e-3)  # a moment-normalised step: eps keeps a
# near-zero gradient from amplifying one device's summation order (1.5e-4 at eps=1e-8)


@functools.cache
def oracle():
    """Three Adam steps on one device with the full batch: the parameters and the losses."""
    return one_device(ADAM())


def train(repl, config, *, zero_stage, offload, accumulate_steps=1):
    """Three Adam steps of ``wrap_optimizer(...).step``, with ``offload`` (a subset of
    ``{"params", "opt"}``) kept in host memory: the parameters, the losses and the state."""
    tx = repl.wrap_optimizer(ADAM(), zero_stage=zero_stage, accumulate_steps=accumulate_steps)

    def step(state, batch):
        loss = functools.partial(loss_fn, config=config)
        params, opt, metrics = tx.step(loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt}, {"loss": metrics["loss"]}

    placed = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
    if zero_stage == 3:
        placed = tx.shard_params(placed, stacked=gpt.zero_stacked(config))
    state = {"params": placed, "opt": tx.init(placed)}
    state = {k: rp.to_host(v) if k in offload else v for k, v in state.items()}
    losses = []
    for batch in batches():
        state, out = repl.run(step, state, batch)
        losses.append(float(np.asarray(out["loss"])[0]))
    return host(state["params"]), np.array(losses), state


def kinds(tree):
    return {placement.in_host_memory(x) for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize(
    "mesh, zero_stage, offload, accumulate",
    [
        ({"data": 4}, 3, ("params", "opt"), 2),  # ZeRO-3 accumulates its slices
        pytest.param({"data": 2, "model": 2}, 1, ("opt",), 2, marks=pytest.mark.slow),
        pytest.param({"data": 2, "model": 2}, 0, ("params", "opt"), 1, marks=pytest.mark.slow),
    ],
    ids=["zero3-both-accumulated", "fsdp-tp-zero1-state-accumulated", "tp-both"],
)
def test_what_is_kept_on_the_host_trains_as_one_device(mesh, zero_stage, offload, accumulate):
    """Three Adam steps with the parameters and/or the optimizer state in host memory equal
    three on one device with the whole batch, 1e-5; what was on the host stays there."""
    got, losses, state = train(
        make_repl(mesh), CONFIG, zero_stage=zero_stage, offload=offload,
        accumulate_steps=accumulate,
    )  # fmt: skip
    want, want_losses = oracle()
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert rel_err(losses, want_losses) <= TOL, (losses, want_losses)
    assert rel_err(got, gpt.init(CONFIG, jax.random.key(0))) > 1e-3  # training moved them
    for key in ("params", "opt"):
        assert kinds(state[key]) == {key in offload}, key


@pytest.mark.slow
def test_in_the_tpu_program_the_state_is_in_host_memory_and_out_of_the_peak():
    """On a TPU target (XLA:CPU's memory statistics do not tell host from device), ZeRO-3's
    parameters and Adam's state kept in host memory: the program keeps them in host memory and
    out of its device arguments, the device's peak falls, and each step moves at least the
    state and the parameters over the host link. The peak falls by less than the state (here
    3.2 of its 14.6 MB): the update brings the state to the device (BENCHMARKS.md,
    "Parameters and optimizer state in host memory")."""
    pytest.importorskip("libtpu")
    import jax.numpy as jnp

    from replicator.models import llama

    config = llama.config(vocab_size=256, d_model=256, num_layers=8, num_heads=4,
                          num_kv_heads=2, d_ff=512, seq_len=256, dtype=jnp.bfloat16)  # fmt: skip
    repl = rp.Replicator(mesh_shape={"data": 4}, devices=rp.tpu_devices("v5p-8"))
    tx = repl.wrap_optimizer(ADAM(), zero_stage=3)

    def step(state, batch):
        loss = functools.partial(loss_fn, config=config)
        params, opt, metrics = tx.step(loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt}, {"loss": metrics["loss"]}

    def init(offload):
        placed = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
        placed = tx.shard_params(placed, stacked=gpt.zero_stacked(config))
        state = {"params": placed, "opt": tx.init(placed)}
        return rp.to_host(state) if offload else state

    tokens = jax.ShapeDtypeStruct((16, 256), jnp.int32)
    batch = {"tokens": tokens, "targets": tokens}
    reports = {}
    for offload in (False, True):
        state = repl.abstract(functools.partial(init, offload))
        reports[offload] = repl.explain(step, state, batch)
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    n = sum(x.size for x in jax.tree.leaves(shapes))
    state_bytes = 3 * 4 * n / 4  # fp32 parameters and Adam's two moments, a quarter a chip
    on, off = reports[True], reports[False]
    assert off.memory.host == 0 and on.memory.host >= state_bytes, (on.memory, state_bytes)
    assert off.memory.arguments - on.memory.arguments >= state_bytes, (off.memory, on.memory)
    assert on.memory.peak < off.memory.peak, (off.memory, on.memory)
    assert on.host_bytes >= 2 * state_bytes and off.host_bytes == 0


def test_an_unplaced_tree_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"rp.to_host: the leaf at \['w'\] has no NamedSharding"):
        rp.to_host({"w": np.ones(3)})


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _losses(tmp_path, name, *overrides):
    cfg = config.load(ROOT / "configs" / f"{name}.yaml", [
        f"out_dir={tmp_path}", "plot=false", "log_every=1", "checkpoint_every=2", *overrides,
    ])  # fmt: skip
    jobs.run(cfg)
    rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in rows]


@pytest.mark.slow
def test_the_cli_keeps_both_on_the_host_and_resumes_the_same(tmp_path):
    """``offload_params`` and ``offload_optimizer``: ``replicator train`` of the shipped
    mixture of experts (its own step: experts over data x expert x model, ZeRO-1) gives the
    losses of the run without them, bit for bit, also when stopped at step 2 and resumed from
    its checkpoint."""
    kept = ("offload_params=true", "offload_optimizer=true", "model.layers=2")
    name = "mixtral_tiny"
    want = _losses(tmp_path / "device", name, "steps=4", "model.layers=2")
    _losses(tmp_path / "host", name, "steps=2", *kept)
    got = _losses(tmp_path / "host", name, "steps=4", *kept)
    assert len(want) == 4 and got == want, (got, want)


def test_the_cli_refuses_offload_with_a_pipeline_naming_the_key():
    with pytest.raises(ValueError, match=r"offload_params=true is for model.kind='gpt' without "
                                         r"a pipeline; with a pipeline \(mesh.stage\)"):  # fmt: skip
        config.load(ROOT / "configs" / "lm_pipeline.yaml", ["offload_params=true"])
