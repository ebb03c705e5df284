"""`model.kind: "module:function"`: your own job trained by `replicator train`."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

JOB = textwrap.dedent(
    """
    import jax.numpy as jnp, numpy as np
    import replicator as rp

    def build(config, repl, tx):
        opt = repl.wrap_optimizer(tx)
        params = repl.replicate({"w": np.zeros((4, 1), np.float32)})
        loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

        def step_fn(state, batch):
            p, o, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
            return {"params": p, "opt": o}, metrics

        rng = np.random.default_rng(0)
        x = rng.normal(size=(256, 4)).astype(np.float32)
        y = x @ np.array([[1.0], [2.0], [-1.0], [0.5]], np.float32)
        input_fn = lambda ctx: rp.Batches({"x": x, "y": y}, config.global_batch, ctx=ctx)
        return step_fn, {"params": params, "opt": opt.init(params)}, input_fn, None
    """
)


def train(cwd, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(ROOT / "configs/lm_dp.yaml"),
         f"out_dir={cwd}", "plot=false", *overrides],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip


@pytest.mark.slow  # 4.4 s
def test_a_function_named_by_model_kind_is_the_job(tmp_path):
    (tmp_path / "linear.py").write_text(JOB)
    run = train(
        tmp_path, "model.kind=linear:build", "steps=10", "log_every=10", "learning_rate=0.1"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "lm_dp/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 10]
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], rows
    missing = train(tmp_path, "model.kind=nowhere:build")
    assert missing.returncode == 2
    assert "model.kind='nowhere:build': cannot import nowhere" in missing.stderr
    nofn = train(tmp_path, "model.kind=linear:make")
    assert nofn.returncode == 2 and "linear has no function make" in nofn.stderr
