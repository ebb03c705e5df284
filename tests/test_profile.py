"""rp.training.LoggingOptions(profile=...) and the `profile:` config key: a jax.profiler trace of
steady steps."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def traces(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("plugins/profile/*/*.xplane.pb"))


def test_fit_traces_the_steps_it_is_asked_for(tmp_path):
    repl = rp.Replicator()
    step = lambda s, x: (s + rp.all_reduce(jnp.sum(x), "mean"), {"s": s})
    x = np.ones((repl.num_replicas * 2, 3), np.float32)
    profile = rp.training.Profile(str(tmp_path), start_step=3, num_steps=2)
    result = rp.fit(
        repl, step, repl.replicate(jnp.zeros(())), lambda ctx: (x for _ in range(100)),
        steps=6, logging=rp.training.LoggingOptions(progress=False, profile=profile),
    )  # fmt: skip
    assert result.step == 6
    (trace,) = traces(tmp_path)
    assert trace.stat().st_size > 0


def test_a_run_that_ends_inside_the_traced_steps_still_writes_the_trace(tmp_path):
    repl = rp.Replicator()
    step = lambda s, x: (s + 1, {"s": s})
    profile = rp.training.Profile(tmp_path, start_step=2, num_steps=5)
    rp.fit(repl, step, repl.replicate(jnp.zeros(())), lambda ctx: iter([np.ones(8)] * 3),
           steps=10, logging=rp.training.LoggingOptions(progress=False, profile=profile))  # fmt: skip
    assert traces(tmp_path) and traces(tmp_path)[0].stat().st_size > 0


def test_bad_profiles_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"rp.training.Profile: start_step must be"):
        rp.training.Profile("/tmp/x", start_step=0)
    with pytest.raises(ValueError, match=r"profile has unknown keys \['steps'\]"):
        rp.training.Profile.of({"dir": "/tmp/x", "steps": 3})
    with pytest.raises(TypeError, match=r"profile must be an rp.training.Profile or a dict"):
        rp.training.Profile.of(3)


@pytest.mark.slow
def test_a_config_with_profile_leaves_a_trace_in_the_run_directory(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(ROOT / "configs/lm_dp.yaml"),
         f"out_dir={tmp_path}", "steps=5", "log_every=5", "plot=false", "model.layers=1",
         "model.d_model=16", "profile.start_step=3", "profile.num_steps=2", "tensorboard=true"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (trace,) = traces(tmp_path / "lm_dp" / "profile")
    assert trace.stat().st_size > 0
    assert list((tmp_path / "lm_dp" / "tensorboard").glob("events.out.tfevents.*"))
    rows = (tmp_path / "lm_dp" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == 5
