"""How ``replicator train`` ends, told by its exit code (``replicator train --help``): trained
to steps (0), nothing to do (4), stopped by SIGINT or SIGTERM at a step boundary with its
checkpoint saved (130, 143); `replicator launch` takes the last three as clean stops of a
worker, not failures. A run that ends removes its lock files; a killed run's stale ones block
nothing."""

import io
import json
import os
import pathlib
import signal
import sys

import pytest

import replicator as rp
from replicator import cli
from replicator.cli.jobs import building

ROOT = pathlib.Path(__file__).resolve().parents[1]
MLP = ["train", str(ROOT / "configs" / "mlp_zero.yaml"), "plot=false", "model.layers=2"]


def snapshot(root: pathlib.Path) -> dict:
    """Every file under ``root``: its bytes and modification time (and every directory)."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def test_a_finished_run_run_again_exits_4_and_changes_nothing(capsys, tmp_path):
    run = tmp_path / "mlp_zero"
    stale = {"pid": 2**22 + 1, "host": "gone", "started": "2026-01-01T00:00:00+00:00"}
    (run / "checkpoints").mkdir(parents=True)  # a killed run's lock files: they block nothing
    for lock in (run / "metrics.jsonl.lock", run / "checkpoints" / ".replicator.lock"):
        lock.write_text(json.dumps(stale) + "\n")
    argv = [*MLP, f"out_dir={tmp_path}", "steps=2", "checkpoint_every=2"]
    assert cli.main(argv) == cli.EXIT_TRAINED == 0
    assert not list(run.rglob("*.lock")), sorted(run.rglob("*"))  # removed at the end
    before = snapshot(run)
    capsys.readouterr()
    assert cli.main(argv) == cli.EXIT_NOTHING_TO_DO == 4
    out = capsys.readouterr().out
    assert "no step to run, the run is at step 2 of 2" in out, out
    assert snapshot(run) == before


def _signalled_after(sig: int, batches: int, monkeypatch) -> None:
    """The next run's input sends this process ``sig`` as it yields batch ``batches``."""
    build = building.build

    def signalling_build(cfg):
        repl, step_fn, state, input_fn, tokens = build(cfg)

        def input_with_a_signal(ctx):
            for i, batch in enumerate(input_fn(ctx)):
                if i == batches:
                    os.kill(os.getpid(), sig)
                yield batch

        return repl, step_fn, state, input_with_a_signal, tokens

    monkeypatch.setattr(building, "build", signalling_build)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_by_a_signal_exits_128_plus_it_and_resumes(sig, code, capsys, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    argv = [*MLP, f"out_dir={tmp_path}", "steps=6", "checkpoint_every=100"]
    with monkeypatch.context() as patch:
        _signalled_after(sig, 2, patch)
        assert cli.main(argv) == code
    err = capsys.readouterr().err
    stopped = rp.Checkpoints(tmp_path / "mlp_zero" / "checkpoints").latest_step()
    assert 1 <= stopped < 6, err
    assert f"stopped by {signal.Signals(sig).name} at step {stopped}; checkpoint saved" in err
    assert not list((tmp_path / "mlp_zero").rglob("*.lock"))
    if sig == signal.SIGTERM:  # the same command resumes, and ends at steps
        assert cli.main(argv) == 0
        assert f"resumed from the checkpoint of step {stopped}" in capsys.readouterr().err


def test_the_exit_codes_are_in_train_help(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for line in ("0    trained to steps", "4    nothing to do", "130  stopped by SIGINT",
                 "143  stopped by SIGTERM"):  # fmt: skip
        assert line in out, out
    guide = (ROOT / "docs" / "guides" / "training_and_cli.md").read_text()
    assert "| 143 |" in guide and "| 4 |" in guide


WORKER = """
import os, sys, time
here = sys.argv[1]
rank = os.environ["REPLICATOR_PROCESS_ID"]
open(os.path.join(here, "starts"), "a").write(rank + "\\n")
time.sleep(0.5 if rank == "0" else 0.0)  # rank 1 first: rank 0 is not stopped for it
open(os.path.join(here, "ended" + rank), "w").write("")
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("code", [4, 143])
def test_launch_takes_a_clean_stop_of_a_worker_as_no_failure(code, tmp_path):
    out = io.StringIO()
    got = rp.distributed.launch(
        [sys.executable, "-c", WORKER, str(tmp_path), str(code)],
        num_processes=2,
        restarts=rp.distributed.Restarts(max_restarts=2, backoff=0.1),
        out=out,
    )
    assert got == code, out.getvalue()
    assert sorted((tmp_path / "starts").read_text().split()) == ["0", "1"]  # not restarted
    assert (tmp_path / "ended0").exists()  # rank 0 was not stopped when rank 1 ended
    assert "exited with" not in out.getvalue() and "stopped cleanly" in out.getvalue()
