"""`replicator train CONFIG`: configs validate, and each shipped config trains (short runs)."""

import json
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


def test_bad_config_exits_2_with_the_message(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nmae: x\n")
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(path)], capture_output=True, text=True
    )
    assert run.returncode == 2 and "unknown key 'nmae'" in run.stderr
