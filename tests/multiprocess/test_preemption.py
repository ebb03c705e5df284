"""Preemption agreed across processes: SIGTERM to one process of two stops both after the same
step, with one checkpoint, and the resumed run ends where an uninterrupted one does."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import OPTIMIZERS, mlp_state, mlp_step, rel_err

import replicator as rp

HERE = Path(__file__).resolve().parent
LAUNCH = [sys.executable, "-m", "replicator.launch", "-n", "2", "--devices-per-process", "4"]


def _results(directory: Path) -> list[dict]:
    return [json.loads((directory / f"result{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step_and_resume_is_exact(tmp_path):
    worker = [sys.executable, str(HERE / "worker_preempt.py"), str(tmp_path)]
    proc = subprocess.Popen(
        [*LAUNCH, "--", *worker, "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        pid_file = tmp_path / "rank1.pid"
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)  # process 1 only
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # the launcher ends its workers on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, output[-3000:]
    first = _results(tmp_path)
    stopped = first[0]["step"]
    assert first == [{"step": stopped, "preempted": True, "resumed_from": None}] * 2, first
    assert stopped >= 5  # the input runs ahead of the steps by a few batches
    assert "stopped by SIGTERM in process 1 at step" in output, output[-3000:]
    assert rp.Checkpoints(tmp_path / "ckpt").latest_step() == stopped

    steps = stopped + 3  # resume both processes from the agreed checkpoint and finish
    run = subprocess.run(
        [*LAUNCH, "--", *worker, str(steps)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    second = _results(tmp_path)
    assert second == [{"step": steps, "preempted": False, "resumed_from": stopped}] * 2, second

    sys.path.insert(0, str(HERE))
    from worker_preempt_data import global_batch

    repl = rp.Replicator()  # this process: 8 devices, the same run without interruption
    state = repl.replicate(mlp_state(repl.wrap_optimizer(OPTIMIZERS["adam"]())))
    for step in range(steps):
        state, _ = repl.run(mlp_step, state, global_batch(step))
    got = list(np.load(tmp_path / "params.npz").values())
    assert rel_err(got, jax.tree.leaves(state.params)) <= 1e-5
