"""A process that trains until told to fail: for the launcher's fault tests and benchmark.

``python worker_fault.py MODE RANK DIR``: every process trains a tiny all-reduce step forever,
reporting progress with ``rp.distributed.heartbeat()``; after 5 steps, process RANK fails as MODE
says, right after writing the time of failure (``time.time()``) to ``DIR/failed_at``:

- ``raise``: raises RuntimeError; ``exit3``: ``sys.exit(3)``; ``raise_exit3``:
  ``raise SystemExit(3)``; ``kill``: SIGKILLs itself;
- ``stuck``: sleeps for an hour while its peers wait for it in the next all-reduce;
- ``stuck_in_step``: the same, after its heartbeat of step 5 (as its peers);
- ``idle``: every process writes ``DIR/rank<r>.pid`` and sleeps, without failing.
"""

import os
import signal
import sys
import time

import replicator as rp

info = rp.distributed.initialize()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

mode, failing, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
me = info.process_index


def mark(name: str, text: str) -> None:
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


if mode == "idle":
    mark(f"rank{me}.pid", str(os.getpid()))
    time.sleep(3600)

repl = rp.Replicator()
state = repl.replicate(jnp.zeros(()))
step = lambda s, x: (s + rp.all_reduce(jnp.sum(x), "mean"), {"s": s})
x = np.ones((repl.num_replicas, 4), np.float32)
for i in range(1_000_000):
    if i == 5:
        mark(f"rank{me}.pid", str(os.getpid()))
    if i == 5 and me == failing:
        mark("failed_at", repr(time.time()))
        if mode == "raise":
            raise RuntimeError(f"rank {me} fails on purpose")
        if mode == "exit3":
            sys.exit(3)
        if mode == "raise_exit3":
            raise SystemExit(3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stuck":  # e.g. in its input pipeline, before it starts step 5
            time.sleep(3600)
    rp.distributed.heartbeat()  # at the start of each step, as rp.fit does
    if i == 5 and me == failing and mode == "stuck_in_step":  # e.g. in a host callback
        mark("failed_at", repr(time.time()))
        time.sleep(3600)
    state, outputs = repl.run(step, state, x)
    float(rp.local_row(outputs)["s"])  # wait for the step: the peers meet in every all-reduce
