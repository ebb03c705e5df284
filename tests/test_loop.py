"""rp.fit: exact resume after SIGKILL, checkpoint and clean exit on SIGTERM, metrics that go on."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import replicator as rp

WORKER = [sys.executable, str(Path(__file__).parent / "workers" / "fit_run.py")]


def start(tmp, name, delay):
    return subprocess.Popen(
        [*WORKER, str(tmp / "ckpt"), str(tmp / "metrics.jsonl"), str(tmp / name), str(delay)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_checkpoint(tmp, step, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not (tmp / "ckpt" / str(step)).is_dir():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


def test_a_killed_run_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    straight.mkdir()
    run = start(straight, "out.npz", 0.0)
    assert run.wait(timeout=300) == 0, run.stdout.read()

    proc = start(tmp_path, "out.npz", 0.15)
    wait_for_checkpoint(tmp_path, 10, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed_lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    again = start(tmp_path, "out.npz", 0.0)
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output
    resumed_from = int(output.split("resumed_from=")[1].split()[0])
    assert resumed_from >= 10 and "done step=20" in output

    got = np.load(tmp_path / "out.npz")
    want = np.load(straight / "out.npz")
    for key in want.files:  # the same program on the same data: bitwise equal
        np.testing.assert_array_equal(got[key], want[key])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resumed = [r["step"] for r in lines[len(killed_lines) :]]
    assert resumed == list(range(resumed_from + 1, 21))  # the metrics go on from the right step
    by_step = {r["step"]: r["loss"] for r in json.loads("[" + ",".join(
        (straight / "metrics.jsonl").read_text().splitlines()) + "]")}  # fmt: skip
    assert all(r["loss"] == by_step[r["step"]] for r in lines[len(killed_lines) :])


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    proc = start(tmp_path, "out.npz", 0.15)
    wait_for_checkpoint(tmp_path, 5, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "stopped by SIGTERM" in output and "preempted=True" in output
    step = int(output.split("done step=")[1].split()[0])
    assert 5 <= step < 20
    assert rp.Checkpoints(tmp_path / "ckpt").latest_step() == step


def test_fit_checks_its_arguments():
    repl = rp.Replicator()
    with pytest.raises(ValueError, match=r"steps must be an int >= 1"):
        rp.fit(repl, lambda s, b: (s, {}), {}, lambda ctx: [], steps=0)
    with pytest.raises(ValueError, match=r"checkpoint_every must be an int >= 1 or None"):
        rp.fit(repl, lambda s, b: (s, {}), {}, lambda ctx: [], steps=1, checkpoint_every=0)
