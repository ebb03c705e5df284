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
from replicator.cli import targets as targets_lib

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


NARROW = ["model.layers=2", "model.d_model=256", "model.heads=4", "model.kv_heads=1",
          "model.d_ff=512", "model.vocab=512", "model.seq_len=128"]  # fmt: skip


def run_at_full_size(
    run_dir: pathlib.Path, config: str, target: str, overrides: tuple = ()
) -> pathlib.Path:
    """A run directory whose checkpoint (step 2) says ``config`` at full size in its metadata:
    saved from the config narrowed (`NARROW`, zeros), then each array's shape set to the full
    one (tensorstore's resize, metadata only). A few MB on disk; `check_restore` reads no array,
    so it is the checkpoint of a full-size run to it."""
    import tensorstore as ts

    from replicator._src.core import logical
    from replicator._src.core.sharded_params import values
    from replicator._src.training.zero_stages import orbax_name
    from replicator.cli import targets

    small = config_lib.load(ROOT / f"configs/{config}.yaml", [*NARROW, *overrides, "mesh.data=8"])
    _, _, state, _ = jobs.abstract_job(small, devices=jax.devices()[:8])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), state)
    ckpt = rp.Checkpoints(run_dir / "checkpoints")
    ckpt.save(2, zeros, data_position=2)
    ckpt.close()
    t = rp.targets.tpu_target(target)
    full = config_lib.load(ROOT / f"configs/{config}.yaml", list(overrides))
    full = targets.mesh_on_target(full, t)
    _, _, state, _ = jobs.abstract_job(full, devices=list(targets.devices(t.name, 1)))
    base = f"file://{run_dir}/checkpoints/2/state/"
    for path, leaf in jax.tree_util.tree_flatten_with_path(logical.saved_like(values(state)))[0]:
        store = {"driver": "ocdbt", "base": base, "path": orbax_name(path) + "/"}
        array = ts.open({"driver": "zarr", "kvstore": store}, open=True).result()
        if array.shape != tuple(leaf.shape):
            array.resize(exclusive_max=list(leaf.shape), resize_metadata_only=True).result()
    return run_dir


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


@needs_libtpu
def test_cli_resume_refuses_a_full_size_restore_over_the_hbm(tmp_path, capsys):
    """A run of Llama 3 8B at full size against ZeRO-0 on v5e-64: every chip would hold the
    whole state, parameters and Adam's moments (89.7 GiB) on its 16 GiB: refused from the
    metadata and the shapes, nothing compiled. (On v5p-64 even ZeRO-0's restore fits the 95
    GiB; the full-size step there is `benchmarks/preflight.py`'s.)"""
    run = run_at_full_size(tmp_path / "llama3_8b", "llama3_8b", "v5p-64")
    before = _listing(run)
    code = cli.main(
        ["explain", f"{ROOT}/configs/llama3_8b.yaml", "zero_stage=0", "--target", "v5e-64",
         "--resume", str(run)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "restoring checkpoint step 2 onto llama3_8b's layout on v5e-64 holds " in err
    assert "over the chip's 16.00 GiB HBM" in err and "zero_stage=3" in err
    assert _listing(run) == before


@needs_libtpu
def test_cli_resume_refuses_a_restore_over_the_hbm_on_v5p_64(tmp_path, capsys):
    """A run of Llama 3 8B with an EMA of its parameters, at full size, against ZeRO-0 on
    v5p-64: parameters, Adam's two moments and the EMA, 16 bytes a parameter on every chip
    (119.7 GiB) over its 95 GiB; refused from the metadata and the shapes, nothing compiled.
    Under ZeRO-3 the same run restores (3.7 GiB a chip)."""
    ema = ("optimizer.ema_decay=0.999",)
    run = run_at_full_size(tmp_path / "llama3_8b", "llama3_8b", "v5p-64", ema)
    before = _listing(run)
    code = cli.main(
        ["explain", f"{ROOT}/configs/llama3_8b.yaml", *ema, "zero_stage=0", "--target",
         "v5p-64", "--resume", str(run)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "onto llama3_8b's layout on v5p-64 holds 119." in err
    assert "over the chip's 95.00 GiB HBM; nothing was read" in err and "zero_stage=3" in err
    t = rp.targets.tpu_target("v5p-64")
    cfg = targets_lib.mesh_on_target(config_lib.load(ROOT / "configs/llama3_8b.yaml", list(ema)), t)
    _, _, state, _ = jobs.abstract_job(cfg, devices=list(targets_lib.devices(t.name, 1)))
    found = rp.training.check_restore(run / "checkpoints", state)
    assert found.restore_bytes < 4 * 2**30
    assert _listing(run) == before
