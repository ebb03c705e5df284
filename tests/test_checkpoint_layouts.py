"""Checkpoints move between layouts: the packed stages of ``pipeline.sequential`` under ZeRO
saved at one data size restore at another, and a state saved without ZeRO restores into ZeRO-1
and ZeRO-3. Restored values equal the saved ones (logically), and three more steps equal an
uninterrupted run on the new layout. Through ``rp.fit`` as a user resumes a run."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle import rel_err

import replicator as rp
from replicator import pipeline
from replicator._src.core import logical
from replicator._src.core.sharded_params import values

BATCH = 8
SAVED_STEPS, MORE = 2, 3


def lin(p, x):  # [b, 8] -> [b, 16]
    return jnp.tanh(x @ p["w"] + p["b"])


def head(p, x):  # [b, 16] -> [b, 4]
    return x @ p["w"]


def squared(_, out, y):
    return jnp.mean((out - y) ** 2)


def stage_params():
    r = np.random.default_rng(0)
    w0 = r.normal(size=(8, 16)).astype(np.float32) / 3
    return [{"w": w0, "b": r.normal(size=16).astype(np.float32)},
            {"w": r.normal(size=(16, 4)).astype(np.float32) / 4}]  # fmt: skip


SEQUENTIAL = pipeline.sequential([lin, head], stage_params())


def input_fn(ctx):
    for i in range(100):
        r = np.random.default_rng(100 + i)
        yield {"x": r.normal(size=(BATCH, 8)).astype(np.float32),
               "y": r.normal(size=(BATCH, 4)).astype(np.float32)}  # fmt: skip


def sequential_job(data: int, zero_stage: int):
    """``(repl, step_fn, init)``: the two packed stages on ``{"data": data, "stage": 2}``."""
    repl = rp.Replicator(mesh_shape={"data": data, "stage": 2}, devices=jax.devices()[: 2 * data])
    opt = repl.wrap_optimizer(optax.sgd(0.05, momentum=0.9), zero_stage=zero_stage)
    f = pipeline.value_and_grad(SEQUENTIAL, squared, num_microbatches=2)

    def step_fn(state, batch):
        params = rp.gather_params(state["params"])  # ZeRO-3: the stages' whole rows
        loss, (g, _, _) = f(params, batch["x"], batch["y"])
        updates, o = opt.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": o}, {"loss": rp.all_reduce(loss, "mean")}

    def init():
        packed = SEQUENTIAL.pack(jax.tree.map(jnp.asarray, stage_params()))
        packed = repl.place(packed, pipeline.stage_spec())
        if zero_stage == 3:  # each stage's leaves stored split over the replicas
            packed = opt.shard_params(packed)
        return {"params": packed, "opt": opt.init(packed)}

    return repl, step_fn, init


def fit(job, steps, directory=None, state=None):
    repl, step_fn, init = job
    saving = None if directory is None else rp.training.CheckpointOptions(directory, every=100)
    state = init() if state is None else jax.tree.map(jnp.copy, state)  # fit donates it
    return rp.fit(repl, step_fn, state, input_fn, steps=steps, checkpointing=saving,
                  logging=rp.training.LoggingOptions(progress=False))  # fmt: skip


def logical_values(state):
    """The state as a checkpoint holds it (the same arrays on every layout), on the host."""
    return jax.tree.map(np.asarray, logical.saved(values(state)))


def moved(saved_job, new_job, tmp_path):
    """Saves ``SAVED_STEPS`` steps of one job, resumes them on another for ``MORE`` steps:
    restored equals saved exactly; the resumed run equals the new layout's own run."""
    directory = os.fspath(tmp_path / "run")
    saved = fit(saved_job, SAVED_STEPS, directory).state
    like = new_job[2]()
    restored, record = rp.Checkpoints(directory).restore(like)
    assert record["step"] == SAVED_STEPS
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        assert (a.shape, a.sharding) == (b.shape, b.sharding)
    got, want = jax.tree.leaves(logical_values(restored)), jax.tree.leaves(logical_values(saved))
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))  # any ZeRO stage
    resumed = fit(new_job, SAVED_STEPS + MORE, directory, state=like)
    assert resumed.step == SAVED_STEPS + MORE
    alone = fit(new_job, SAVED_STEPS + MORE, state=like).state
    assert rel_err(logical_values(resumed.state), logical_values(alone)) <= 1e-6
    assert rel_err(jax.tree.leaves(logical_values(alone)), want) > 1e-3  # it trained on


@pytest.mark.parametrize(
    "zero_stage",
    [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)],
)
def test_the_split_rows_restore_exactly_at_data_4_and_1(zero_stage, tmp_path):
    """ZeRO's rows of packed stages hold each replica's parts side by side (a layout of the
    data size); the checkpoint holds the logical rows: distinct random values saved at data 2
    restore at data 4 and 1 as the same logical arrays, and save back to the same checkpoint."""
    _, _, init = sequential_job(2, zero_stage)
    state = init()
    opt = state["opt"].inner
    rows = opt.rows
    r = np.random.default_rng(5)
    random = {k: r.normal(size=a.shape).astype(a.dtype) for k, a in rows.saved_like().items()}
    state["opt"] = state["opt"]._replace(inner=opt._replace(rows=rows.restored(random)))
    held = np.asarray(state["opt"].inner.rows.saved()["float32"])  # padding dropped
    assert np.count_nonzero(held == random["float32"]) == np.count_nonzero(held) > held.size / 2
    ckpt = rp.Checkpoints(tmp_path / "a")
    ckpt.save(1, state)
    for data in (4, 1):
        restored, _ = ckpt.restore(sequential_job(data, zero_stage)[2]())
        assert restored["opt"].inner.rows.layout.n == data
        if zero_stage == 3:  # the parameters too are each replica's parts side by side
            assert restored["params"].layout.n == data
    if zero_stage == 1:  # checkpoints of the split rows themselves (before they held the logical)
        inner = state["opt"].inner
        old = {**state, "opt": state["opt"]._replace(inner=inner._replace(rows=dict(inner.rows)))}
        ckpt = rp.Checkpoints(tmp_path / "b")
        ckpt.save(1, old)
        restored, _ = ckpt.restore(
            sequential_job(2, 1)[2]()
        )  # as many replicas: read, made logical
        got = jax.tree.leaves(logical_values(restored))
        assert all(
            np.array_equal(a, b) for a, b in zip(got, jax.tree.leaves(logical_values(state)))
        )
        with pytest.raises(
            rp.StateMismatchError, match=r"parts of 2 replicas.*Restore it once with 2"
        ):
            ckpt.restore(sequential_job(4, 1)[2]())
        got = jax.tree.leaves(logical_values(restored))
        assert all(
            np.array_equal(a, b) for a, b in zip(got, jax.tree.leaves(logical_values(state)))
        )


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage, data", [(1, 4), (1, 1), (2, 4), (2, 1), (3, 4), (3, 1)])
def test_zero_on_sequential_stages_resumes_at_another_data_size_as_it_trains_there(
    zero_stage, data, tmp_path
):
    moved(sequential_job(2, zero_stage), sequential_job(data, zero_stage), tmp_path)


# -- across ZeRO stages: a state saved without ZeRO, restored into ZeRO-1 and ZeRO-3 -----------


def mlp_job(data: int, zero_stage: int):
    """``(repl, step_fn, init)``: a two-layer MLP with Adam, ZeRO-3 gathering its parameters."""
    repl = rp.Replicator(mesh_shape={"data": data}, devices=jax.devices()[:data])
    opt = repl.wrap_optimizer(optax.adam(1e-2), zero_stage=zero_stage)

    def loss_fn(p, batch):
        p = rp.gather_params(p)
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    def step_fn(state, batch):
        loss, g = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, o = opt.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": o}, {"loss": rp.all_reduce(loss, "mean")}

    def init():
        p = stage_params()
        params = repl.replicate({"w1": p[0]["w"], "b1": p[0]["b"], "w2": p[1]["w"]})
        if zero_stage == 3:
            params = opt.shard_params(params)
        return {"params": params, "opt": opt.init(params)}

    return repl, step_fn, init


@pytest.mark.parametrize("zero_stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_a_state_saved_without_zero_resumes_under_zero_as_it_trains_there(zero_stage, tmp_path):
    """The optimizer's own state (ZeRO-0) is ``WrappedState.inner`` under ZeRO: the same
    logical leaves, restored by name, here at data 2 into data 4."""
    moved(mlp_job(2, 0), mlp_job(4, zero_stage), tmp_path)


# -- through the command line ------------------------------------------------------------------

MLP_RUN = ("model.kind=mlp", "model.d_model=16", "model.layers=2", "global_batch=16",
           "log_every=1", "plot=false", "name=m")  # fmt: skip


def cli(out_dir, *overrides, capsys) -> tuple[int, str]:
    from replicator import cli as command_line

    code = command_line.main(["train", CONFIG, f"out_dir={out_dir}", *MLP_RUN, *overrides])
    return code, "".join(capsys.readouterr())


CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "mlp_zero.yaml")


def losses(out_dir) -> dict:
    lines = (out_dir / "m" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def on_disk(directory) -> dict:
    """Every file under ``directory`` (lock files aside) and its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in directory.rglob("*") if p.is_file() and not p.name.endswith(".lock")
    }  # fmt: skip


@pytest.mark.slow
def test_replicator_train_resumes_a_zero_0_run_of_2_devices_on_8_under_zero_1(tmp_path, capsys):
    """Saved by ``cpu_devices=2 zero_stage=0``, resumed here on 8 devices with zero_stage=1:
    the three more steps log the losses of a run trained on 8 devices with ZeRO-1 throughout.
    Then the refusals: another model (one line naming the keys; nothing on disk changes), and
    a mesh that does not fit (cpu_devices=, mesh.data=-1)."""
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", CONFIG, f"out_dir={tmp_path / 'a'}",
         *MLP_RUN, "steps=2", "zero_stage=0", "cpu_devices=2", "checkpoint_every=2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "num_replicas=2" in run.stdout
    code, said = cli(tmp_path / "a", "steps=5", "zero_stage=1", capsys=capsys)
    assert code == 0, said[-3000:]
    assert "resumed from the checkpoint of step 2" in said and "num_replicas=8" in said
    code, said = cli(tmp_path / "b", "steps=5", "zero_stage=1", capsys=capsys)
    assert code == 0, said[-3000:]
    resumed, alone = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):
        assert abs(resumed[step] - alone[step]) <= 1e-6 * abs(alone[step]), (resumed, alone)

    before = on_disk(tmp_path / "a")
    code, said = cli(tmp_path / "a", "steps=8", "model.d_model=32", capsys=capsys)
    refusal = [line for line in said.splitlines() if line.startswith("replicator train:")]
    assert code == 2 and len(refusal) == 1, said
    assert "holds another state" in refusal[0] and "name=m-2" in refusal[0], refusal
    code, said = cli(tmp_path / "a", "steps=8", "mesh.data=4", capsys=capsys)
    assert code == 2 and "use cpu_devices=4 or mesh.data=-1" in said, said
    assert on_disk(tmp_path / "a") == before
