"""`replicator train` on a job that `replicator launch --min-processes` shrank, and under the
launcher at all: the config as fewer processes run it, data that do not depend on the process
count, and one process writing the run's files."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import replicator as rp
from replicator.cli import jobs
from replicator.cli.config import TrainConfig, from_dict
from replicator.cli.jobs import building

ROOT = Path(__file__).resolve().parents[1]


def test_a_shrunk_job_keeps_its_global_batch_in_more_micro_batches():
    c = jobs.elastic(TrainConfig(mesh={"data": 8}, accumulate_steps=2), 2, 4)
    assert (c.mesh, c.accumulate_steps, c.global_batch) == ({"data": 4}, 4, 32)
    c = jobs.elastic(TrainConfig(mesh={"dcn_data": 2, "data": 4}), 4, 8)
    assert (c.mesh, c.accumulate_steps) == ({"dcn_data": 2, "data": 1}, 4)
    c = jobs.elastic(TrainConfig(mesh={"data": -1}, elastic_batch="shrink"), 2, 2)
    assert (c.mesh, c.accumulate_steps, c.global_batch) == ({"data": -1}, 1, 16)
    with pytest.raises(jobs.SetupError, match=r"no data axis that shrinks by 3; use mesh.data: -1"):
        jobs.elastic(TrainConfig(mesh={"data": 4}), 3, 3)
    with pytest.raises(ValueError, match=r"elastic_batch must be 'keep'"):
        TrainConfig(elastic_batch="grow")


@pytest.mark.parametrize("kind", ["mlp", "gpt", "cnn"])
def test_the_built_in_data_are_the_same_global_batches_on_any_number_of_processes(kind):
    model = {"kind": kind, **({"seq_len": 16} if kind == "gpt" else {})}
    config = from_dict(TrainConfig, {"model": model})
    job = building.builtin_job(config)(config, rp.Replicator(), building._tx_maker(config))

    def first(n):  # the first global batch, as n processes read it
        parts = []
        for i in range(n):
            ctx = rp.InputContext(
                num_input_pipelines=n, input_pipeline_id=i, num_replicas_in_sync=8
            )
            parts.append(next(iter(job.input_fn(ctx))))
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    one, four = first(1), first(4)
    assert one.keys() == four.keys() and one
    for k in one:
        assert len(one[k]) == config.global_batch
        np.testing.assert_array_equal(one[k], four[k], err_msg=k)


@pytest.mark.slow
def test_replicator_train_under_the_launcher_joins_one_job_equal_to_one_process(tmp_path):
    args = ["configs/mlp_zero.yaml", "steps=3", "log_every=1", "plot=false"]
    one = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", *args, f"out_dir={tmp_path / 'one'}"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stdout + one.stderr
    launch = [sys.executable, "-m", "replicator.launch", "-n", "2", "--devices-per-process", "4"]
    cmd = [*launch, "--", sys.executable, "-m", "replicator.cli", "train", *args]
    two = subprocess.run(
        [*cmd, f"out_dir={tmp_path / 'two'}"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert two.returncode == 0, two.stdout[-3000:]
    assert "num_replicas=8" in two.stdout
    rows = {}
    for name in ("one", "two"):
        lines = (tmp_path / name / "mlp_zero" / "metrics.jsonl").read_text().splitlines()
        rows[name] = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows["two"]] == [1, 2, 3]  # each step once: process 0 writes
    assert [r["step"] for r in rows["one"]] == [1, 2, 3]
    for a, b in zip(rows["one"], rows["two"]):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
