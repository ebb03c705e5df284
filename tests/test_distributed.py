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
