"""`replicator plan CONFIG --devices N --memory M --hardware H`: the ranked table, the written
config that `replicator train` runs, and the refusals."""

import json
import pathlib
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=32", "model.layers=2", "model.seq_len=16", "global_batch=16"]


def replicator(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "replicator.cli", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow
def test_plan_writes_the_best_layout_as_a_config_that_trains(tmp_path):
    """A small GPT on 8 devices, ZeRO-1 layouts with 1F1B or none, model and stage axes up to
    2: the table ranks the layouts that fit 4 MiB, the written config holds the best layout
    and `replicator train` runs it."""
    out, report = tmp_path / "best.yaml", tmp_path / "plan.json"
    run = replicator(
        "plan", "configs/lm_dp.yaml", *SMALL, "--devices", 8, "--memory", "4MiB",
        "--hardware", "tpu-v5e", "--schedules", "1f1b", "--max-model", 2, "--max-stage", 2,
        "--zero-stages", 1, "--out", out, "--json", report,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "layouts that fit, fastest first" in run.stdout and f"wrote {out}" in run.stdout
    plan = json.loads(report.read_text())
    best = plan["best"]
    assert plan["ranked"][0]["layout"] == best and best["zero_stage"] == 1
    assert all(c["compiled"]["memory"]["peak"] <= 4 * 2**20 for c in plan["ranked"])
    written = yaml.safe_load(out.read_text())
    assert written["zero_stage"] == 1 and written["model"]["d_model"] == 32
    mesh = {"data": best["data"]}
    mesh.update({k: best[k] for k in ("stage", "model") if best[k] > 1})
    assert written["mesh"] == mesh
    assert (written["pipeline"] is None) == (best["stage"] == 1)
    train = replicator(
        "train", out, "steps=2", "log_every=1", "checkpoint_every=2", f"out_dir={tmp_path}"
    )
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = (tmp_path / "lm_dp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]


def test_plan_refusals_exit_2_with_the_message():
    run = replicator("plan", "configs/lm_dp.yaml", "--devices", 8, "--hardware", "tpu-v9")
    assert run.returncode == 2
    assert "replicator plan: hardware='tpu-v9' is neither a known profile" in run.stderr
    run = replicator("plan", "configs/lm_dp.yaml", "--devices", 0)
    assert run.returncode == 2 and "--devices must be 1 or more; got 0" in run.stderr
    run = replicator("plan", "configs/lm_dp.yaml", "--devices", 8, "--memory", "lots")
    assert run.returncode == 2 and "memory='lots' is not a size" in run.stderr
