"""The optimizer: section of run configs: optimizers, schedules, weight decay that stays exact
under ZeRO, and the learning rate in the metrics."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import warnings

import jax
import numpy as np
import optax
import pytest
from oracle import rel_err

from replicator.cli import config as config_lib
from replicator.cli import jobs, optimizers
from replicator.cli.optimizers import OptimizerConfig
from replicator.models import gpt

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_section_its_shorthand_and_overrides_onto_either(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "optimizer: {name: adamw, schedule: cosine, warmup_steps: 5}\nlearning_rate: 1e-3\n"
    )
    c = config_lib.load(path)
    assert c.optimizer == OptimizerConfig(name="adamw", schedule="cosine", warmup_steps=5)
    assert c.learning_rate == 0.001  # 1e-3 in YAML, a string to YAML 1.1, is a float
    c = config_lib.load(ROOT / "configs/lm_pipeline.yaml")  # optimizer: adam
    assert c.optimizer == OptimizerConfig(name="adam")
    c = config_lib.load(
        ROOT / "configs/lm_pipeline.yaml", ["optimizer.name=lion", "learning_rate=1e-4"]
    )
    assert c.optimizer.name == "lion" and c.learning_rate == 1e-4
    with pytest.raises(ValueError, match=r"optimizer='adamx' is not an optimizer; use one of"):
        config_lib.load(ROOT / "configs/lm_dp.yaml", ["optimizer=adamx"])
    with pytest.raises(ValueError, match=r"optimizer.weight_decay is for 'adamw' and 'lion'"):
        config_lib.load(ROOT / "configs/lm_dp.yaml", ["optimizer.weight_decay=0.1"])
    with pytest.raises(ValueError, match=r"optimizer.schedule='cos' is not a schedule"):
        config_lib.load(ROOT / "configs/lm_dp.yaml", ["optimizer.schedule=cos"])
    with pytest.raises(ValueError, match=r"momentum is for optimizer.name='sgd'"):
        config_lib.load(ROOT / "configs/lm_dp.yaml", ["optimizer.momentum=0.9"])


def test_schedules_are_optax_schedules_with_warmup():
    cos = optimizers.schedule_fn(OptimizerConfig(schedule="cosine", warmup_steps=10), 1.0, 110)
    want = optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, 110, 0.0)
    assert [float(cos(s)) for s in (0, 5, 10, 60, 110)] == [
        float(want(s)) for s in (0, 5, 10, 60, 110)
    ]
    lin = optimizers.schedule_fn(
        OptimizerConfig(schedule="linear", warmup_steps=4, end_factor=0.5), 2.0, 14
    )
    assert np.allclose([float(lin(s)) for s in (0, 2, 4, 9, 14)], [0.0, 1.0, 2.0, 1.5, 1.0])
    const = optimizers.schedule_fn(OptimizerConfig(), 0.3, 100)
    assert float(const(0)) == float(const(99)) == pytest.approx(0.3)


def test_weight_decay_skips_biases_and_norms_by_their_keys():
    config = gpt.GPTConfig(vocab_size=16, seq_len=4, d_model=8, num_heads=2, num_layers=2)
    mask = optimizers.decay_mask(gpt.init(config, jax.random.key(0)))
    assert mask["blocks"]["attn"] == {
        "out": True,
        "out_bias": False,
        "qkv": True,
        "qkv_bias": False,
    }
    assert mask["blocks"]["ln1"] == {"bias": False, "scale": False}
    assert mask["head"] == {"norm": {"bias": False, "scale": False}, "w": True}
    assert mask["embed"] == {"positions": True, "tokens": True}
    assert optimizers.decay_mask({"layers": {"w": 1, "b": 2}}) == {
        "layers": {"w": True, "b": False}
    }


def losses(zero_stage, *overrides):
    c = config_lib.load(
        ROOT / "configs/mlp_zero.yaml",
        [f"zero_stage={zero_stage}", "accumulate_steps=1", "steps=5", "learning_rate=0.1",
         "optimizer.name=adamw", "optimizer.schedule=cosine", "optimizer.warmup_steps=2",
         *overrides],
    )  # fmt: skip
    repl, step_fn, state, input_fn, _ = jobs.build(c)
    batches = iter(input_fn(repl.input_context()))
    out = []
    for _ in range(5):
        state, metrics = repl.run(step_fn, state, next(batches))
        out.append(float(np.asarray(metrics["loss"]).ravel()[0]))
    return np.array(out), float(np.asarray(metrics["learning_rate"]).ravel()[0])


def test_adamw_with_decay_mask_and_schedule_is_exact_under_every_zero_stage():
    want, rate = losses(0, "optimizer.weight_decay=1.0")
    assert rate == pytest.approx(float(optax.warmup_cosine_decay_schedule(0, 0.1, 2, 5)(4)))
    for zero_stage in (1, 2, 3):
        got, _ = losses(zero_stage, "optimizer.weight_decay=1.0")
        assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-5, (zero_stage, got, want)
    undecayed, _ = losses(0, "optimizer.weight_decay=0.0")
    assert np.max(np.abs(undecayed - want) / np.abs(want)) > 1e-3  # the decay is in the numbers


def test_the_learning_rate_is_logged_with_the_metrics(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(ROOT / "configs/lm_dp.yaml"),
         f"out_dir={tmp_path}", "steps=6", "log_every=2", "plot=false", "model.layers=1",
         "model.d_model=16", "optimizer.name=adamw", "optimizer.schedule=cosine",
         "optimizer.warmup_steps=4", "learning_rate=1e-3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "lm_dp/metrics.jsonl").read_text().splitlines()]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 4, 6, 0.0)
    # the rate of the step that ran last before each log: steps 1, 3, 5 use schedule(1), (3), (5)
    assert [r["learning_rate"] for r in rows] == pytest.approx(
        [float(schedule(s)) for s in (1, 3, 5)]
    )


@pytest.mark.parametrize(
    "zero_stage, overrides",
    [
        (3, ("optimizer.name=lion", "learning_rate=0.001")),
        (2, ("optimizer.name=sgd", "optimizer.momentum=0.9", "learning_rate=0.001")),
        (2, ("optimizer.name=adafactor", "learning_rate=0.01")),  # exact: gathered, with a warning
    ],
)
def test_every_optimizer_is_exact_under_zero(zero_stage, overrides):
    want, _ = losses(0, *overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got, _ = losses(zero_stage, *overrides)
    assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-5, (got, want)


def ema_run(zero_stage):
    c = config_lib.load(
        ROOT / "configs/mlp_zero.yaml",
        [f"zero_stage={zero_stage}", "accumulate_steps=1", "steps=3", "learning_rate=0.1",
         "optimizer.name=sgd", "optimizer.ema_decay=0.5"],
    )  # fmt: skip
    repl, step_fn, state, input_fn, _ = jobs.build(c)
    batches = iter(input_fn(repl.input_context()))
    history = [jax.tree.map(np.asarray, state["job"]["params"])]
    for _ in range(3):
        state, _ = repl.run(step_fn, state, next(batches))
        history.append(jax.tree.map(np.asarray, state["job"]["params"]))
    return jax.tree.map(np.asarray, state["ema"]), history


def test_the_ema_of_the_parameters_is_kept_in_the_state_and_exact_under_zero():
    ema, history = ema_run(0)
    want = history[0]
    for params in history[1:]:  # ema = d * ema + (1 - d) * params, after each update
        want = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, want, params)
    for got, w in zip(jax.tree.leaves(ema), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-6)
    ema1, _ = ema_run(1)
    assert rel_err(ema1, ema) <= 1e-5  # ZeRO-1: the same average, from sliced updates
    with pytest.raises(ValueError, match=r"ema_decay must be in \[0, 1\); got 1.5"):
        OptimizerConfig(ema_decay=1.5)


def test_decay_steps_sets_the_schedules_length_apart_from_the_runs():
    c = OptimizerConfig(schedule="cosine", warmup_steps=2, decay_steps=50)
    assert float(optimizers.schedule_fn(c, 1.0, 10)(30)) == pytest.approx(
        float(optax.warmup_cosine_decay_schedule(0.0, 1.0, 2, 50, 0.0)(30))
    )
    with pytest.raises(ValueError, match=r"decay_steps must be an int >= 1; got 0"):
        OptimizerConfig(decay_steps=0)
