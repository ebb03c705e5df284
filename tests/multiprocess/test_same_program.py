"""The same step program on every process (`rp.fit`'s check before its first step), on 2 real
processes through `replicator launch`: equal programs train; a process 1 that builds another
step is refused before step 1 on both, naming the processes and the first differing line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import replicator as rp
from replicator._src.distributed import programs

HERE = Path(__file__).resolve().parent
LAUNCH = [sys.executable, "-m", "replicator.launch", "-n", "2", "--devices-per-process", "2"]


@pytest.mark.slow  # 7 s: two processes start, train twice, then refuse a run
def test_a_process_that_builds_another_step_is_refused_before_step_1(tmp_path):
    worker = [sys.executable, str(HERE / "worker_same_program.py"), str(tmp_path)]
    run = subprocess.run([*LAUNCH, "--", *worker], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DIFFERENT_STEP": "1"})  # fmt: skip
    said = run.stdout + run.stderr
    assert run.returncode != 0, said[-3000:]
    # the same program on both processes: equal fingerprints, trained and checkpointed
    assert "[0] process 0: same trained to step 2" in run.stdout, said[-3000:]
    assert "[1] process 1: same trained to step 2" in run.stdout, said[-3000:]
    assert sorted(os.listdir(tmp_path / "same")) == ["1", "2"]  # the lock removed at the end
    # process 1's loss x 2 on a mesh of each process's devices: each trains its own program
    assert "[1] process 1: alone trained to step 2" in run.stdout, said[-3000:]
    # and on the mesh of both processes: refused before step 1, no checkpoint
    assert "different trained" not in run.stdout
    assert sorted(os.listdir(tmp_path / "different")) == []
    errors = [line for line in said.splitlines() if "ProgramsDifferError: rp.fit:" in line]
    assert errors, said[-3000:]
    for error in errors:  # the same message on the processes that said it
        message = error.split("ProgramsDifferError: ", 1)[1]
        assert message == errors[0].split("ProgramsDifferError: ", 1)[1]
        assert "the 2 processes lowered different step programs" in message
        assert "refused before the first step" in message
        assert "; process 1: " in message and "Fingerprints: process 0: " in message
        # the loss's factor, 1 on process 0 and 2 on process 1: a constant of the program
        assert re.search(
            r"The first difference between processes 0 and 1 is line \d+ of the lowered step: "
            r"process 0 has `%\w+ = stablehlo.constant dense<1.000000e\+00> : tensor<f32>`, "
            r"process 1 has `%\w+ = stablehlo.constant dense<2.000000e\+00> : tensor<f32>`\.",
            message,
        ), message


def test_one_process_compares_nothing():
    def lowered():
        raise AssertionError("a lone process lowered its step to compare it")

    mesh = rp.Replicator().mesh
    programs.check_same_program(lowered, mesh=mesh, api="rp.fit")  # zero cost: nothing lowered
