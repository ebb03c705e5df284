"""Runs that heal themselves: ``replicator launch --max-restarts`` and ``--min-processes``, and
no worker outliving its launcher.

The jobs are tests/faults/worker_heal.py (an MLP with Adam under ZeRO-1, checkpointed every 5
steps), with faults injected at the start of given steps. A healed run must end with the
parameters of a run without faults: bitwise on the same processes, to 1e-5 after a resize (the
same global batch, accumulated in more micro-batches).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker_heal.py"
FAULT_WORKER = HERE.parent / "multiprocess" / "worker_fault.py"
LAUNCH = [sys.executable, "-m", "replicator.launch"]


def heal(directory: Path, n: int, steps: int, faults=(), *, extra=(), pace=0.0, timeout=300):
    """Runs the job on ``n`` processes x 2 devices with ``faults``; (code, output)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "faults.json").write_text(json.dumps(list(faults)))
    cmd = [*LAUNCH, "-n", str(n), "--devices-per-process", "2", "--restart-backoff", "0.2"]
    cmd += [*extra, "--", sys.executable, str(WORKER), str(directory), str(steps), str(pace)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return run.returncode, run.stdout + run.stderr


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    """The job's parameters after 20 steps on 2 processes without a fault: what every healed
    run of the module must end with (bitwise on 2 processes, to 1e-5 after a resize)."""
    directory = tmp_path_factory.mktemp("plain")
    code, out = heal(directory, 2, 20)
    assert code == 0, out[-3000:]
    return params(directory)


def params(directory: Path) -> dict:
    with np.load(directory / "params.npz") as f:
        return {k: f[k] for k in f.files}


def events(directory: Path) -> list[dict]:
    lines = (directory / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def last_lines(out: str) -> str:
    return "\n".join(line for line in out.splitlines() if line.startswith("replicator launch"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by its new parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "pipe"])
def test_no_worker_outlives_a_launcher_killed_by_sigkill(tmp_path, pdeathsig):
    env = dict(os.environ)
    if not pdeathsig:  # the fallback alone: initialize's watch of the launcher's pipe
        env["_REPLICATOR_NO_PDEATHSIG"] = "1"
    cmd = [*LAUNCH, "-n", "2", "--devices-per-process", "1", "--"]
    cmd += [sys.executable, str(FAULT_WORKER), "idle", "0", str(tmp_path)]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in files):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        pids = [int(f.read_text()) for f in files]
        assert all(_alive(p) for p in pids)
        launcher.kill()  # SIGKILL: the launcher can do nothing about it
        killed = time.monotonic()
        launcher.wait()
        while any(_alive(p) for p in pids) and time.monotonic() - killed < 10:
            time.sleep(0.02)
        after = time.monotonic() - killed
        survivors = [p for p in pids if _alive(p)]
    finally:
        for p in [int(f.read_text()) for f in files if f.exists()]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert not survivors, f"workers {survivors} outlived their launcher by 10 s"
    print(f"the last worker ended {after:.3f} s after the launcher")
    assert after < 2, f"the last worker ended {after:.2f} s after the launcher"


@pytest.mark.slow
def test_two_kills_are_healed_by_restarts_bitwise(tmp_path, plain):
    faults = [{"step": 7, "rank": 1, "how": "kill"}, {"step": 15, "rank": 0, "how": "kill"}]
    code, out = heal(tmp_path / "healed", 2, 20, faults, extra=["--max-restarts", "3"])
    log = last_lines(out)
    assert code == 0, out[-3000:]
    assert "rank 1 was killed by SIGKILL at step 7" in log and "Restart 1 of 3" in log, log
    assert "rank 0 was killed by SIGKILL at step 15" in log and "Restart 2 of 3" in log, log
    assert "resuming from the checkpoint of step 5" in log, log
    assert "resuming from the checkpoint of step 10" in log, log
    starts = [e["step"] for e in events(tmp_path / "healed") if e["kind"] == "first_step"]
    assert starts == [1, 1, 6, 6, 11, 11], starts
    healed = params(tmp_path / "healed")
    for k in plain:
        np.testing.assert_array_equal(healed[k], plain[k], err_msg=k)


@pytest.mark.slow
@pytest.mark.skipif(
    "REPLICATOR_FAULT_SEED" not in os.environ,
    reason="explores: REPLICATOR_FAULT_SEED=N python -m pytest tests/faults/test_restarts.py; "
    "CI heals the two kills above",
)
def test_random_kills_of_random_ranks_are_healed_bitwise(tmp_path, plain):
    """The fault-injection harness: 3 SIGKILLs of random ranks at distinct random steps of one
    run, seeded by ``REPLICATOR_FAULT_SEED`` (run with seeds of your choice to explore)."""
    rng = random.Random(int(os.environ["REPLICATOR_FAULT_SEED"]))
    faults = [
        {"step": s, "rank": rng.randrange(2), "how": "kill"} for s in rng.sample(range(3, 20), 3)
    ]
    code, out = heal(tmp_path / "healed", 2, 20, faults, extra=["--max-restarts", "3"])
    assert code == 0, out[-3000:]
    assert last_lines(out).count("Restart ") == 3, last_lines(out)
    healed = params(tmp_path / "healed")
    for k in plain:
        np.testing.assert_array_equal(healed[k], plain[k], err_msg=k)


@pytest.mark.slow
def test_a_failure_at_the_same_step_is_restarted_once_then_ends_the_job(tmp_path):
    faults = [{"step": 9, "rank": 1, "how": "raise", "always": True}]
    code, out = heal(tmp_path, 2, 20, faults, extra=["--max-restarts", "3"])
    log = last_lines(out)
    assert code == 1, out[-3000:]
    assert "RuntimeError: rank 1 fails on purpose at step 9" in out
    assert log.count("rank 1 exited with 1 at step 9") == 2, log
    assert "Restart 1 of 3" in log and "Restart 2 of 3" not in log, log
    assert "Rank 1 failed twice at step 9" in log.splitlines()[-1], log


@pytest.mark.slow
def test_restarts_that_run_out_end_the_job_with_the_last_failure(tmp_path):
    faults = [{"step": s, "rank": 1, "how": "exit3"} for s in (3, 8)]
    code, out = heal(tmp_path, 2, 20, faults, extra=["--max-restarts", "1"])
    log = last_lines(out)
    assert code == 3, out[-3000:]
    assert "rank 1 exited with 3 at step 8" in log.splitlines()[-1], log
    assert "No restart left (--max-restarts 1)" in log, log


@pytest.mark.slow
def test_a_host_lost_for_good_shrinks_the_job_and_keeps_its_global_batch(tmp_path, plain):
    """4 processes, one lost for good at step 8: the job goes on with 2 from the checkpoint of
    step 5 and ends with the parameters of the job without a fault (the same global batch in
    twice the micro-batches), to 1e-5."""
    faults = [{"step": 8, "rank": 3, "how": "kill", "lose": True}]
    extra = ["--max-restarts", "2", "--min-processes", "2", "--join-timeout", "60"]
    code, out = heal(tmp_path / "shrunk", 4, 20, faults, extra=extra)
    log = last_lines(out)
    assert code == 0, out[-3000:]
    assert "rank 3 was killed by SIGKILL at step 8" in log, log
    assert "process slot(s) [3] did not come up" in log and "going on with 2" in log, log
    runs = [(e["step"], e["n"]) for e in events(tmp_path / "shrunk") if e["kind"] == "first_step"]
    assert runs == [(1, 4)] * 4 + [(6, 2)] * 2, runs
    shrunk = params(tmp_path / "shrunk")
    for k in plain:
        np.testing.assert_allclose(shrunk[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_a_lost_host_that_comes_back_grows_the_job_at_a_checkpoint(tmp_path):
    code, out = heal(tmp_path / "plain", 2, 60)  # without a fault, at full speed: the same result
    assert code == 0, out[-3000:]
    faults = [{"step": 4, "rank": 1, "how": "kill", "lose": True}]
    extra = ["--max-restarts", "2", "--min-processes", "1", "--rejoin-interval", "1"]
    directory = tmp_path / "grown"
    directory.mkdir()
    (directory / "faults.json").write_text(json.dumps(faults))
    cmd = [*LAUNCH, "-n", "2", "--devices-per-process", "2", "--restart-backoff", "0.2", *extra]
    cmd += ["--", sys.executable, str(WORKER), str(directory), "60", "0.1"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and launcher.poll() is None:
            path = directory / "events.jsonl"
            shrunk = path.exists() and any(e.get("n") == 1 for e in events(directory))
            if shrunk:
                (directory / "lost1").unlink()  # the host is back
                break
            time.sleep(0.1)
        out, _ = launcher.communicate(timeout=200)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    log = last_lines(out)
    assert launcher.returncode == 0, out[-3000:]
    assert "going on with 1" in log and "process slot(s) [1] are back" in log, log
    runs = [(e["step"], e["n"]) for e in events(directory) if e["kind"] == "first_step"]
    assert runs[:3] == [(1, 2), (1, 2), (1, 1)] and runs[-2:][0][1] == 2, runs
    plain, grown = params(tmp_path / "plain"), params(directory)
    for k in plain:
        np.testing.assert_allclose(grown[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_sigterm_while_waiting_to_restart_stops_the_launcher(tmp_path):
    cmd = [*LAUNCH, "-n", "2", "--devices-per-process", "1", "--max-restarts", "3"]
    cmd += ["--restart-backoff", "60", "--"]
    cmd += [sys.executable, str(FAULT_WORKER), "exit3", "1", str(tmp_path)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if "Restart 1 of 3 in 60 s" in line:
                break
        asked = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        out = launcher.communicate(timeout=30)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, "".join(lines) + out
    assert "got SIGTERM while waiting to restart; stopped." in out
    assert time.monotonic() - asked < 5


@pytest.mark.parametrize(
    "options, message",
    [
        (["--max-restarts", "-1"], "--max-restarts must be an int >= 0; got -1"),
        (["--min-processes", "3"], "--min-processes 3 is more than -n 2; give at most 2"),
        (["--min-processes", "1"], "--min-processes 1 resizes the job on a restart, and "),
        (["--max-restarts", "1", "--join-timeout", "0"], "--join-timeout must be a number of"),
        (["--restart-backoff", "-1"], "--restart-backoff must be a number of seconds >= 0"),
    ],
)
def test_restart_options_are_checked_before_anything_starts(options, message, capsys):
    from replicator.cli import main

    assert main(["launch", "-n", "2", *options, "--", sys.executable, "-c", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err
