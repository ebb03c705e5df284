"""One process of a job that heals itself: run through ``replicator launch --max-restarts`` by
tests/faults/test_restarts.py and benchmarks/faults.py.

``python worker_heal.py DIR STEPS [PACE]``: trains the oracle MLP with Adam under ZeRO-1 (its state split
over the replicas) with `rp.fit` for STEPS steps on a global batch of 64, checkpointing every 5
steps into ``DIR/ckpt``. On fewer processes than the launcher was asked for, it accumulates
``info.elastic_factor`` micro-batches per step, so that the global batch stays 64. Process 0
writes the final parameters to ``DIR/params.npz``. PACE: seconds to sleep in each step (0).

Faults come from ``DIR/faults.json``, a list of ``{"step": S, "rank": R, "how": H}``: at the start
of step S, rank R fails as H says (``kill``: SIGKILL; ``raise``: RuntimeError; ``exit3``:
``sys.exit(3)``), once (the first process to fire a fault claims it with an ``O_EXCL`` file),
or at every pass with ``"always": true``. ``"lose": true`` also takes its host away for good:
the slot's process then exits before it joins, until ``DIR/lost<slot>`` is removed. Each fault
appends ``time.time()`` and its step to ``DIR/events.jsonl``; each process appends the times at
which its first step after a start begins and ends to the same file.
"""

import json
import os
import signal
import sys
import time

out_dir, steps = sys.argv[1], int(sys.argv[2])
pace = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0  # seconds of sleep per step
slot = os.environ.get("REPLICATOR_SLOT", "0")


def event(**record) -> None:
    with open(os.path.join(out_dir, "events.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.time(), "slot": int(slot), **record}) + "\n")


if os.path.exists(os.path.join(out_dir, f"lost{slot}")):
    sys.exit(1)  # this host is down: the process ends before it joins the job

import replicator as rp  # noqa: E402

info = rp.distributed.initialize()  # first: before anything touches the devices

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from replicator._src.distributed import initialize as distributed  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "multiprocess"))
from worker_preempt_data import global_batch  # noqa: E402

faults_path = os.path.join(out_dir, "faults.json")
faults = json.load(open(faults_path)) if os.path.exists(faults_path) else []
report = distributed.heartbeat
first = [True, True]


def claim(i: int) -> bool:
    try:
        os.close(os.open(os.path.join(out_dir, f"fired{i}"), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def heartbeat(step=None):  # rp.fit's report at the start of each step: the faults' trigger
    report(step)
    if pace:
        time.sleep(pace)
    if first[0]:
        first[0] = False
        event(kind="first_step", step=step, rank=info.process_index, n=info.process_count)
    elif first[1]:  # the first step is done (compiled and run): the second one starts
        first[1] = False
        event(kind="first_step_done", step=step, rank=info.process_index)
    for i, fault in enumerate(faults):
        if step != fault["step"] or info.process_index != fault["rank"]:
            continue
        if not fault.get("always") and not claim(i):
            continue
        event(kind="fault", step=step, rank=info.process_index, how=fault["how"])
        if fault.get("lose"):
            open(os.path.join(out_dir, f"lost{slot}"), "w").close()
        if fault["how"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault["how"] == "raise":
            raise RuntimeError(f"rank {info.process_index} fails on purpose at step {step}")
        if fault["how"] == "exit3":
            sys.exit(3)


distributed.heartbeat = heartbeat

repl = rp.Replicator()
opt = repl.wrap_optimizer(optax.adam(1e-2), zero_stage=1, accumulate_steps=info.elastic_factor)
rng = np.random.default_rng(1)
params = {
    "w1": (rng.normal(size=(16, 32)) / 4).astype(np.float32),
    "b1": np.zeros(32, np.float32),
    "w2": (rng.normal(size=(32, 4)) / 6).astype(np.float32),
}
params = repl.replicate(params)
state = {"params": params, "opt": opt.init(params)}


def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def step_fn(state, batch):
    p, o, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
    return {"params": p, "opt": o}, {"loss": metrics["loss"]}


def input_fn(ctx: rp.InputContext):
    per = ctx.per_pipeline_batch_size(64)
    lo = ctx.input_pipeline_id * per
    for step in range(steps):
        yield {k: v[lo : lo + per] for k, v in global_batch(step).items()}


result = rp.fit(
    repl,
    step_fn,
    state,
    input_fn,
    steps=steps,
    checkpointing=rp.training.CheckpointOptions(os.path.join(out_dir, "ckpt"), every=5),
    logging=rp.training.LoggingOptions(every=1000, progress=False),
)
if info.process_index == 0 and result.step == steps:
    leaves = jax.tree.map(
        lambda a: np.asarray(a.addressable_shards[0].data), result.state["params"]
    )
    np.savez(os.path.join(out_dir, "params.npz"), **leaves)
