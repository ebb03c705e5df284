"""``replicator explain CONFIG --resume RUN_DIR --target T``: a run checked before a pod is booked.

The run's checkpoint is read from its metadata only (`rp.training.check_restore`): these tests
write one from the state ``configs/llama_tiny.yaml`` builds (zeros: only shapes and dtypes are
read) and check it against that config and against Llama 3 8B at full size on v5p-64.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

import replicator as rp
from replicator import cli
from replicator.cli import config as config_lib
from replicator.cli import jobs

ROOT = pathlib.Path(__file__).resolve().parents[1]
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='needs pip install "replicator[tpu]"'
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory of llama_tiny (ZeRO-3 over data 4 x model 2) at step 2, as
    ``replicator train`` lays it out (``out_dir/name/checkpoints``)."""
    cfg = config_lib.load(ROOT / "configs/llama_tiny.yaml")
    _, _, state, _ = jobs.abstract_job(cfg, devices=jax.devices()[:8])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), state)
    run = tmp_path_factory.mktemp("out") / "llama_tiny"
    ckpt = rp.Checkpoints(run / "checkpoints")
    ckpt.save(2, zeros, data_position=2)
    ckpt.close()
    return run


def _listing(path: pathlib.Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in path.rglob("*")}


def test_check_restore_reads_metadata_only_and_names_the_leaf_that_differs(run_dir):
    directory = run_dir / "checkpoints"
    before = _listing(run_dir)
    cfg = config_lib.load(ROOT / "configs/llama_tiny.yaml", ["mesh.data=1", "zero_stage=1"])
    _, _, state, _ = jobs.abstract_job(cfg, devices=jax.devices()[:2])  # another mesh and stage
    found = rp.training.check_restore(directory, state)
    assert (found.step, found.record["data_position"]) == (2, 2)
    assert found.leaves == len(jax.tree.leaves(state)) and found.restore_bytes > 0
    wider = config_lib.load(ROOT / "configs/llama_tiny.yaml", ["model.d_model=128"])
    _, _, other, _ = jobs.abstract_job(wider, devices=jax.devices()[:8])
    with pytest.raises(rp.training.StateMismatchError, match=r"has shape \(4, 64, 32\), but"):
        rp.training.check_restore(directory, other)
    with pytest.raises(FileNotFoundError, match="no step 3 \\(it has \\[2\\]\\)"):
        rp.training.check_restore(directory, state, step=3)
    assert _listing(run_dir) == before


@needs_libtpu
@pytest.mark.slow  # the step compiles for v5p-16 (about 10 s)
def test_cli_resume_accepts_a_matching_run_and_reports_both_peaks(run_dir, tmp_path, capsys):
    before = _listing(run_dir)
    out = tmp_path / "report.json"
    code = cli.main(
        ["explain", f"{ROOT}/configs/llama_tiny.yaml", "--target", "v5p-16", "--quick",
         "--resume", str(run_dir), "--json", str(out)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "resume: checkpoint step 2 of " in captured.out
    assert "(39 arrays, data position 2) restores onto this layout: restore peak " in captured.out
    resume = json.loads(out.read_text())["resume"]
    assert resume["step"] == 2 and resume["record"]["data_position"] == 2
    assert 0 < resume["restore_peak_bytes"] < resume["step_peak_bytes"]
    assert _listing(run_dir) == before


@needs_libtpu
def test_cli_resume_refuses_another_model_size_in_one_line_before_compiling(run_dir, capsys):
    """Llama 3 8B at full size on v5p-64 against a run of llama_tiny: its state is built from
    shapes, the metadata compared; nothing compiles (seconds, not the step's minutes)."""
    before = _listing(run_dir)
    code = cli.main(
        ["explain", f"{ROOT}/configs/llama3_8b.yaml", "--target", "v5p-64", "--resume",
         str(run_dir)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--resume {run_dir}: checkpoint step 2 holds another state than llama3_8b " in err
    assert "builds on v5p-64: leaf ['job']" in err and "(saved (" in err
    assert "nothing was read" in err and "Explain the config with the model and optimizer" in err
    assert _listing(run_dir) == before


@needs_libtpu
def test_cli_resume_refuses_a_restore_over_the_hbm_naming_the_fix(run_dir, capsys, monkeypatch):
    """A restore that holds more per device than the chip's HBM (here the HBM made 64 KiB:
    llama_tiny's state is 320 KiB a chip on v5p-16 under ZeRO-3, 1.2 MiB under ZeRO-1)."""
    real = rp.planner.hardware_profile

    def small(target):
        import dataclasses

        return dataclasses.replace(real(target), memory_bytes=64 * 1024)

    monkeypatch.setattr(rp.planner, "hardware_profile", small)
    for stage, fix in ((1, "zero_stage=3"), (3, "a model axis")):
        code = cli.main(
            ["explain", f"{ROOT}/configs/llama_tiny.yaml", f"zero_stage={stage}", "--target",
             "v5p-16", "--resume", str(run_dir)]
        )  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "restoring checkpoint step 2 onto llama_tiny's layout on v5p-16 holds " in err
        assert "over the chip's 64.00 KiB HBM; nothing was read. Shard the state more: " in err
        assert fix in err


def test_cli_resume_without_a_target_is_refused(run_dir, capsys):
    code = cli.main(["explain", f"{ROOT}/configs/llama_tiny.yaml", "--resume", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "--resume checks a run against a --target's step" in err
