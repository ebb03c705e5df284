"""Checkpoint faults on two processes (2 x 2 emulated CPU devices, `replicator launch`): a broken
step moved aside by process 0 alone while both restore the step before; checkpoints none of
which is readable moved aside once when the run starts over; a non-finite output or state that
only one process sees stops both, at the same step, with the same message, before anything
non-finite is saved."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LAUNCH = [sys.executable, "-m", "replicator.launch", "-n", "2", "--devices-per-process", "2"]
SCENARIOS = ["move_aside", "start_over", "nonfinite_output", "nonfinite_state"]


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """``seen[scenario]``: what each of the two processes wrote, in process order."""
    out = tmp_path_factory.mktemp("ckpt_faults")
    worker = [sys.executable, str(HERE / "worker_ckpt_faults.py"), str(out), *SCENARIOS]
    run = subprocess.run([*LAUNCH, "--", *worker], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return {
        name: [json.loads((out / f"{name}.{rank}.json").read_text()) for rank in (0, 1)]
        for name in SCENARIOS
    }


@pytest.mark.slow
def test_a_broken_step_is_moved_aside_once_and_both_processes_restore_the_one_before(seen):
    first, second = seen["move_aside"]
    for result in (first, second):
        assert "error" not in result, result
        assert result["restored"] == 2 and result["w"] == 2.0 and result["steps"] == [1, 2]
        assert result["steps_after"] == [1, 2, 3]  # saved again, by both
    aside = [n for n in first["listing"] if n.startswith("3.broken-")]
    assert first["listing"] == second["listing"] == ["1", "2", *aside] and len(aside) == 1
    for result in (first, second):  # each process names the directory process 0 renamed
        moved = [
            w.split("moved it aside to ")[1] for w in result["warnings"] if "moved it aside to" in w
        ]
        assert len(moved) == 1 and moved[0].startswith(f"{result['directory']}/{aside[0]} ("), moved


@pytest.mark.slow
def test_start_over_if_unreadable_moves_every_step_aside_once_on_two_processes(seen):
    first, second = seen["start_over"]
    for result in (first, second):
        assert "error" not in result, result
        assert result["resumed_from"] is None and result["step"] == 8
        assert result["saved"] == [4, 8] and result["saved_finite"]
    listing = first["listing"]
    assert listing == second["listing"]
    assert [n.split(".")[0] for n in listing if ".broken-" in n] == ["4", "8"], listing
    for result in (first, second):  # each process names the directories process 0 renamed
        moved = [
            w.split("moved it aside to ")[1].split()[0]
            for w in result["warnings"]
            if "moved it aside to" in w
        ]
        assert moved == [f"{result['directory']}/{n}" for n in listing if ".broken-" in n][::-1], (
            moved
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "what"),
    [
        ("nonfinite_output", "the training output 'probe' is nan on process 1 at step 3."),
        ("nonfinite_state", "state leaf ['w'] is not finite (nan or inf) on process 1 at step 4."),
    ],
)
def test_a_non_finite_value_on_one_process_stops_both_at_the_same_step(seen, scenario, what):
    first, second = seen[scenario]
    assert first.get("error") == second.get("error") == "NonFiniteError", (first, second)
    assert first["message"] == second["message"], (first, second)
    assert first["message"].startswith(f"rp.fit: {what} Stopped before saving"), first
    assert "(newest: step 2)" in first["message"]
    for result in (first, second):
        assert result["saved"] == [2] and result["saved_finite"]  # nothing non-finite saved
