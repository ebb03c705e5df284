"""rp.distributed in this process: initialize's checks, and the launcher's bookkeeping."""

import io
import sys

import jax
import pytest

import replicator as rp


def test_initialize_after_jax_started_says_what_to_move(monkeypatch):
    jax.devices()  # the backend is up in this process
    info = rp.distributed.initialize()  # alone, nothing to set: a no-op
    assert (info.process_index, info.process_count, info.source) == (0, 1, "single")
    monkeypatch.setenv("REPLICATOR_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("REPLICATOR_NUM_PROCESSES", "2")
    monkeypatch.setenv("REPLICATOR_PROCESS_ID", "0")
    with pytest.raises(
        RuntimeError, match=r"already initialised.*Call rp.distributed.initialize\(\) at the top"
    ):
        rp.distributed.initialize()


def run_launch(code: str, n: int = 2):
    out = io.StringIO()
    rc = rp.distributed.launch([sys.executable, "-c", code], num_processes=n, grace=2, out=out)
    return rc, out.getvalue()


def test_launch_prefixes_ranks_and_passes_exit_codes():
    rc, out = run_launch("import os; print('hello from', os.environ['REPLICATOR_PROCESS_ID'])")
    assert rc == 0
    assert "[0] hello from 0" in out and "[1] hello from 1" in out
    code = "import os, sys, time; r = os.environ['REPLICATOR_PROCESS_ID']; r == '1' and sys.exit(3); time.sleep(60)"
    rc, out = run_launch(code)
    assert rc == 3 and "rank 1 exited with 3; stopped the other 1 process(es)" in out


def test_launch_checks_its_arguments():
    with pytest.raises(ValueError, match=r"-n must be an int >= 1"):
        rp.distributed.launch(["true"], num_processes=0)
    with pytest.raises(ValueError, match=r"give the command to run after --"):
        rp.distributed.launch([], num_processes=1)


def test_heartbeat_is_a_no_op_alone_and_writes_the_launchers_file(tmp_path, monkeypatch):
    import struct
    import time

    from replicator._src import distributed

    monkeypatch.setattr(distributed, "_beat", [])
    monkeypatch.delenv("REPLICATOR_HEARTBEAT_FILE", raising=False)
    rp.distributed.heartbeat()  # no launcher: nothing to write, nothing raised
    assert distributed._beat == [None]
    path = tmp_path / "rank0.beat"
    path.write_bytes(struct.pack("<ddq", 0.0, 0.0, 0))
    monkeypatch.setattr(distributed, "_beat", [])
    monkeypatch.setattr(distributed, "_beats", [0])
    monkeypatch.setenv("REPLICATOR_HEARTBEAT_FILE", str(path))
    before = time.monotonic()
    rp.distributed.heartbeat()
    rp.distributed.heartbeat()
    t, exiting, count = distributed.read_beat(str(path))
    assert before <= t <= time.monotonic() and not exiting and count == 2


def test_the_coordinator_binds_to_loopback_only_for_a_loopback_address():
    from replicator._src.distributed import _is_loopback

    assert (
        _is_loopback("127.0.0.1:1234") and _is_loopback("localhost:1") and _is_loopback("[::1]:5")
    )
    assert not _is_loopback("10.0.0.1:1234") and not _is_loopback("myhost:1234")


def test_replicator_launch_takes_the_launchers_options(capsys):
    from replicator.cli import main

    assert main(["launch", "--watchdog", "0", "-n", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "replicator launch: --watchdog must be a number of seconds > 0 (or left out for no "
        "watchdog); got 0.0.\n"
    )
    assert main(["launch", "--watchdog", "5", "-n", "2", "--", sys.executable, "-c", "1"]) == 0


def test_the_first_failure_is_named_even_when_a_peer_is_seen_to_end_first(tmp_path):
    """Rank 1 is SIGKILLed; rank 0's all-reduce then fails, and the launcher happens to see rank
    0 end first: rank 1 is still the one named. An own failure comes before either."""
    import queue
    import struct

    from replicator._src import distributed, launcher

    files = [str(tmp_path / f"rank{r}.beat") for r in range(3)]
    marks = [(10.0, distributed.FAILED_IN_RUNTIME), (0.0, distributed.RUNNING), (0.0, 0.0)]
    for path, (t, how) in zip(files, marks):
        with open(path, "wb") as f:
            f.write(struct.pack("<ddq", t, how, 3))
    exits = queue.Queue()
    exits.put((1, -9, 10.2))  # seen after rank 0's exit, though it failed first
    got = launcher._first_failure({0: (1, 10.1)}, {1, 2}, exits, files)
    assert got == (1, -9)
    with open(files[2], "wb") as f:
        f.write(struct.pack("<ddq", 10.3, distributed.FAILED, 3))  # rank 2: sys.exit(3)
    exits.put((1, -9, 10.2))
    exits.put((2, 3, 10.4))
    assert launcher._first_failure({0: (1, 10.1)}, {1, 2}, exits, files) == (2, 3)
    assert distributed._runtime_error(ValueError("UNKNOWN: Gloo all-reduce failed: reset"))
    assert not distributed._runtime_error(ValueError("bad batch"))
