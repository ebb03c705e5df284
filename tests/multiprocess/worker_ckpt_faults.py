"""One process of the multi-process checkpoint-fault tests: run by
tests/multiprocess/test_checkpoint_multiprocess.py through `replicator launch -n 2`. Runs each
scenario named on the command line in its own directory under DIR, and writes what this process
saw to ``DIR/<scenario>.<rank>.json``: the error it raised (type, message), the warnings, the
steps on disk, and the scenario's own values.

python worker_ckpt_faults.py DIR SCENARIO ...
"""

import json
import os
import sys
import warnings
from pathlib import Path

import replicator as rp

info = rp.distributed.initialize()  # first: before anything touches the devices

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

out_dir = Path(sys.argv[1])
me = info.process_index
STEPS = 8


def barrier(name):
    multihost_utils.sync_global_devices(name)


def corrupt(step_dir):
    """Truncates every array file of a step (both processes' shards): process 0, then a barrier."""
    if me == 0:
        for path in sorted(Path(step_dir, "state").rglob("*")):
            if path.is_file() and "metadata" not in path.name.lower():
                path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])
    barrier(f"corrupted {step_dir}")


def input_fn_with_flag(flag_step):
    """Global batches of 8 examples (x, flag); at step ``flag_step`` (1-based), process 1's
    examples are flagged: only its replicas see the flag."""

    def input_fn(ctx: rp.InputContext):
        per = ctx.per_pipeline_batch_size(8)
        for step in range(1, STEPS + 1):
            x = np.full((per, 2), 0.1 * step, np.float32)
            flagged = step == flag_step and ctx.input_pipeline_id == 1
            yield {"x": x, "flag": np.full((per,), float(flagged), np.float32)}

    return input_fn


def fit(repl, step_fn, directory, input_fn, *, log_every, checkpoint_every=2, start_over=False):
    state = repl.replicate({"w": np.ones((2,), np.float32)})
    return rp.fit(
        repl, step_fn, state, input_fn, steps=STEPS,
        checkpointing=rp.training.CheckpointOptions(
            directory, every=checkpoint_every, start_over_if_unreadable=start_over
        ),
        logging=rp.training.LoggingOptions(every=log_every, progress=False),
    )  # fmt: skip


def nonfinite_output(directory):
    """A per-replica output ('probe', not reduced) that is nan on process 1's replicas only."""

    def step_fn(state, batch):
        probe = jnp.where(jnp.any(batch["flag"] > 0), jnp.nan, 0.0)
        loss = rp.all_reduce(jnp.mean(batch["x"] ** 2), "mean")
        return {"w": state["w"] - 0.1 * loss}, {"loss": loss, "probe": probe}

    fit(rp.Replicator(), step_fn, directory, input_fn_with_flag(3), log_every=1)


def nonfinite_state(directory):
    """A replicated leaf that becomes nan on process 1's replicas only (replicas left to drift:
    check_replicas=False), with finite outputs: found by the state check before checkpoint 4."""

    def step_fn(state, batch):
        bad = jnp.where(jnp.any(batch["flag"] > 0), jnp.nan, 1.0)
        return {"w": state["w"] * bad}, {"loss": rp.all_reduce(jnp.mean(batch["x"]), "mean")}

    repl = rp.Replicator(check_replicas=False)
    fit(repl, step_fn, directory, input_fn_with_flag(3), log_every=100)


def move_aside(directory):
    """Steps 1-3 saved, step 3 corrupted: both processes restore step 2, process 0 moves 3."""
    repl = rp.Replicator()
    ckpt = rp.Checkpoints(directory, keep=5)

    def state(v):
        return repl.replicate({"w": np.full((4, 2), float(v), np.float32)})

    for step in (1, 2, 3):
        ckpt.save(step, state(step))
    barrier("saved 1-3")
    corrupt(Path(directory, "3"))
    restored, record = ckpt.restore(state(0))
    steps = ckpt.steps()
    barrier("restored")
    listing = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    ckpt.save(3, restored)  # the step number is free again
    value = float(np.asarray(restored["w"].addressable_shards[0].data).ravel()[0])
    result = {"restored": record["step"], "w": value, "steps": steps, "listing": listing}
    result["steps_after"] = ckpt.steps()
    ckpt.close()
    return result


def start_over(directory):
    """Every checkpoint corrupted: start_over_if_unreadable=True moves them aside (process
    0) and trains from step 0 on both processes."""

    def step_fn(state, batch):
        loss = rp.all_reduce(jnp.mean(batch["x"] ** 2), "mean")
        return {"w": state["w"] - 0.1 * loss}, {"loss": loss}

    repl = rp.Replicator()
    fit(repl, step_fn, directory, input_fn_with_flag(0), log_every=100, checkpoint_every=4)
    barrier("first run")
    for step in (4, 8):
        corrupt(Path(directory, str(step)))
    again = fit(repl, step_fn, directory, input_fn_with_flag(0), log_every=100,
                checkpoint_every=4, start_over=True)  # fmt: skip
    barrier("second run")
    listing = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    return {"resumed_from": again.resumed_from, "step": again.step, "listing": listing}


SCENARIOS = {
    "nonfinite_output": nonfinite_output,
    "nonfinite_state": nonfinite_state,
    "move_aside": move_aside,
    "start_over": start_over,
}

for name in sys.argv[2:]:
    directory = str(out_dir / name)
    result = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = SCENARIOS[name](directory) or {}
        except Exception as e:  # the expected errors; the test checks which
            result = {"error": type(e).__name__, "message": str(e)}
    result["directory"] = directory
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if os.path.isdir(directory):
        result["saved"] = rp.Checkpoints(directory).steps()
        if result["saved"]:  # the newest checkpoint, restored as saved: is it finite?
            shape = (4, 2) if name == "move_aside" else (2,)
            like = rp.Replicator().replicate({"w": np.zeros(shape, np.float32)})
            restored, _ = rp.Checkpoints(directory).restore(like, step=result["saved"][-1])
            w = np.asarray(restored["w"].addressable_shards[0].data)
            result["saved_finite"] = bool(np.isfinite(w).all())
    (out_dir / f"{name}.{me}.json").write_text(json.dumps(result))
    barrier(f"done {name}")
