"""`replicator train CONFIG`: configs validate, and each shipped config trains (short runs)."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from replicator._src import config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_config_errors_name_the_key_and_list_the_valid_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nstepps: 3\n")
    with pytest.raises(
        ValueError,
        match=r"unknown key 'stepps' in TrainConfig\. Did you mean 'steps'\? Valid keys: name, model",
    ):
        config.load(path)
    path.write_text("name: x\nsteps: many\n")
    with pytest.raises(ValueError, match=r"steps: expected int; got 'many'"):
        config.load(path)
    path.write_text("model: {kind: gpt, layer: 2}\n")
    with pytest.raises(
        ValueError, match=r"unknown key 'layer' in ModelConfig\. Did you mean 'layers'"
    ):
        config.load(path)
    path.write_text("name: x\n")
    assert config.load(
        path, ["model.layers=8", "learning_rate=1", "pipeline.microbatches=8"]
    ) == config.TrainConfig(
        name="x",
        model=config.ModelConfig(layers=8),
        learning_rate=1.0,
        pipeline=config.PipelineConfig(microbatches=8),
    )
    with pytest.raises(ValueError, match=r"write key=value"):
        config.load(path, ["steps"])


@pytest.mark.parametrize("name", ["lm_pipeline", "lm_dp", "mlp_zero"])
def test_shipped_configs_train(name, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(ROOT / "configs" / f"{name}.yaml"),
         "steps=12", "log_every=4", "checkpoint_every=6", f"out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [4, 8, 12]
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert (tmp_path / name / "loss.png").read_bytes()[:4] == b"\x89PNG"
    if name == "lm_pipeline":  # the schedule's picture, as text and as a PNG
        assert "schedule=1f1b K=4" in (tmp_path / name / "schedule.txt").read_text()
        assert (tmp_path / name / "schedule.png").read_bytes()[:4] == b"\x89PNG"


def _train(config_path, out_dir, *overrides):
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(config_path), f"out_dir={out_dir}",
         *overrides],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_cnn_bn_trains_and_resumes_on_the_same_data(tmp_path):
    cfg = ROOT / "configs" / "cnn_bn.yaml"
    args = ("log_every=4", "checkpoint_every=8", "plot=false")
    _train(cfg, tmp_path / "a", "steps=16", *args)
    rows = [json.loads(x) for x in (tmp_path / "a/cnn_bn/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8, 12, 16]
    assert all(math.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in rows), rows
    assert rows[-1]["loss"] < 0.9 * rows[0]["loss"], rows
    # Stopped at step 8 and run again: restored from the checkpoint, the input_fn replays the
    # same batches, so steps 12 and 16 match the uninterrupted run.
    _train(cfg, tmp_path / "b", "steps=8", *args)
    resumed = _train(cfg, tmp_path / "b", "steps=16", *args)
    assert "resumed from the checkpoint of step 8" in resumed.stdout + resumed.stderr
    again = [json.loads(x) for x in (tmp_path / "b/cnn_bn/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [4, 8, 12, 16]
    for r, s in zip(rows, again):
        assert math.isclose(r["loss"], s["loss"], rel_tol=1e-5), (rows, again)
        assert r["accuracy"] == s["accuracy"]


def test_bad_config_exits_2_with_the_message(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nmae: x\n")
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(path)], capture_output=True, text=True
    )
    assert run.returncode == 2 and "unknown key 'nmae'" in run.stderr
