"""Faults of the CLI, the configs and the run directory: each bad input is one line on stderr
with exit code 2 that names the key, and a second run into a run directory is refused at once,
while a killed run's stale lock does not block the resume."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import replicator as rp
from replicator import cli
from replicator._src.training import rundir
from replicator.cli import config
from replicator.cli.jobs import building

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
WORKER = [sys.executable, str(ROOT / "tests" / "workers" / "fit_run.py")]


def train(capsys, tmp_path, cfg, *overrides):
    """``replicator train`` in this process: (exit code, stderr)."""
    code = cli.main(["train", str(cfg), f"out_dir={tmp_path}", "plot=false", *overrides])
    return code, capsys.readouterr().err


def assert_user_error(code, err, *words):
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.startswith("replicator train: "), err
    for word in words:
        assert word in err, (word, err)


# Each: config, overrides, words the one-line message must hold (the key, what is valid).
ONE_LINE = {
    "negative learning rate": ("mlp_zero", ["learning_rate=-1"], ["learning_rate", "> 0", "-1"]),
    "zero learning rate": ("mlp_zero", ["learning_rate=0"], ["learning_rate", "> 0"]),
    "nan learning rate": ("mlp_zero", ["learning_rate=.nan"], ["learning_rate", "finite"]),
    "inf learning rate": ("mlp_zero", ["learning_rate=.inf"], ["learning_rate", "finite"]),
    "text learning rate": ("mlp_zero", ["learning_rate=fast"], ["learning_rate", "'fast'"]),
    "negative cpu_devices": ("mlp_zero", ["cpu_devices=-1"], ["cpu_devices", ">= 0"]),
    "unknown schedule": (
        "lm_pipeline",
        ["pipeline.schedule=zigzag"],
        ["pipeline.schedule", "'zigzag'", "'gpipe'", "'circular'", "'1f1b'"],
    ),
    "zero steps": ("mlp_zero", ["steps=0"], ["steps", ">= 1"]),
    "zero global_batch": ("mlp_zero", ["global_batch=0"], ["global_batch", ">= 1"]),
    "zero checkpoint_every": ("mlp_zero", ["checkpoint_every=0"], ["checkpoint_every", ">= 1"]),
    "negative log_every": ("mlp_zero", ["log_every=-5"], ["log_every", ">= 1"]),
    "zero microbatches": ("lm_pipeline", ["pipeline.microbatches=0"], ["microbatches", ">= 1"]),
    "zero repeats": ("lm_pipeline", ["pipeline.repeats=0"], ["repeats", ">= 1"]),
    "zero layers": ("mlp_zero", ["model.layers=0"], ["model.layers", ">= 1"]),
    "negative d_model": ("mlp_zero", ["model.d_model=-8"], ["model.d_model", ">= 1"]),
    "heads not dividing d_model": ("lm_dp", ["model.heads=5"], ["model.heads", "d_model"]),
    "unknown model kind": ("mlp_zero", ["model.kind=rnn"], ["model.kind", "'gpt'"]),
    "unknown optimizer": ("mlp_zero", ["optimizer=adamx"], ["optimizer", "'adamw'"]),
    "zero_stage 5": ("mlp_zero", ["zero_stage=5"], ["zero_stage", "0, 1, 2 or 3"]),
    "zero accumulate_steps": ("mlp_zero", ["accumulate_steps=0"], ["accumulate_steps", ">= 1"]),
    "negative clip": ("mlp_zero", ["clip_global_norm=-1"], ["clip_global_norm", "> 0"]),
    "zero mesh axis": ("mlp_zero", ["mesh.data=0"], ["mesh", "data"]),
    "mesh axis not a number": ("mlp_zero", ["mesh.data=all"], ["mesh", "'all'"]),
    "empty name": ("mlp_zero", ["name="], ["name"]),
    "name with a slash": ("mlp_zero", ["name=a/../b"], ["name", "'a/../b'"]),
    "unknown key": ("mlp_zero", ["stepz=3"], ["'stepz'", "'steps'"]),
    "wrong type": ("mlp_zero", ["steps=many"], ["steps", "'many'"]),
    "section as a scalar": ("mlp_zero", ["model=3"], ["model", "section"]),
    "override without =": ("mlp_zero", ["steps"], ["'steps'", "key=value"]),
    "scatter_grads without a pipeline": (
        "lm_dp",
        ["zero_stage=3", "pipeline.scatter_grads=step"],
        [
            "pipeline.scatter_grads='step'",
            "no pipeline",
            "mesh.stage=K",
            "scatter_grads=microbatch",
        ],
    ),
}


@pytest.mark.parametrize("case", list(ONE_LINE))
def test_bad_config_values_are_one_line_and_exit_2(case, capsys, tmp_path):
    name, overrides, words = ONE_LINE[case]
    code, err = train(capsys, tmp_path, CONFIGS / f"{name}.yaml", *overrides)
    assert_user_error(code, err, *words)
    assert err.count("\n") == 1, err  # one line
    assert not (tmp_path / name).exists()  # refused before anything was written


@pytest.mark.parametrize(
    "text, words",
    [
        ("- steps: 3\n", ["top level must be a mapping"]),
        ("steps: [1, 2\n", ["is not YAML", "line"]),
        ("\x00\x01binary", ["is not YAML"]),
    ],
    ids=["a list", "broken YAML", "binary"],
)
def test_bad_config_files_are_one_line(text, words, capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, err = train(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), *words)
    assert err.count("\n") == 1, err


# A key given twice in one mapping: plain YAML would keep the second without a word.
DUPLICATES = {
    "top-level key": ("name: x\nsteps: 5\nsteps: 7\n", "key steps", "lines 2 and 3"),
    "two sections": (
        "name: x\nmodel:\n  kind: mlp\nsteps: 2\nmodel:\n  d_model: 8\n",
        "key model",
        "lines 2 and 5",
    ),
    "key in a section": (
        "name: x\nmodel:\n  kind: mlp\n  d_model: 8\n  layers: 2\n  d_model: 16\n",
        "key model.d_model",
        "lines 4 and 6",
    ),
}


@pytest.mark.parametrize("case", list(DUPLICATES))
def test_a_key_given_twice_in_a_config_file_is_refused(case, capsys, tmp_path):
    text, key, lines = DUPLICATES[case]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, err = train(capsys, tmp_path, path)
    assert_user_error(code, err, str(path), f"{key} appears twice", lines, "Keep one")
    assert err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_a_key_given_twice_in_an_override_is_refused(capsys, tmp_path):
    code, err = train(capsys, tmp_path, CONFIGS / "mlp_zero.yaml", "mesh={data: 2, data: 4}")
    assert_user_error(code, err, "mesh={data: 2, data: 4}", "key data appears twice")
    assert err.count("\n") == 1, err


def test_keys_merged_from_an_anchor_may_still_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nmodel:\n  <<: {kind: mlp, d_model: 8, layers: 2}\n  layers: 3\n")
    cfg = config.load(path)
    assert (cfg.model.kind, cfg.model.d_model, cfg.model.layers) == ("mlp", 8, 3)


def test_missing_config_file(capsys, tmp_path):
    code, err = train(capsys, tmp_path, tmp_path / "nope.yaml")
    assert_user_error(code, err, "nope.yaml", "no config file")
    assert err.count("\n") == 1, err


# Refused by the library after the config loaded, before the first step.
LIBRARY = {
    "mesh bigger than the devices": ("mlp_zero", ["mesh.data=16"], ["16"]),
    "mesh that does not fill the devices": ("mlp_zero", ["mesh.data=3"], ["3"]),
    "unknown mesh axis": ("mlp_zero", ["mesh={foo: 8}"], ["foo"]),
    "global_batch not divisible": ("mlp_zero", ["global_batch=30"], ["30"]),
    "microbatches that do not divide": ("lm_pipeline", ["pipeline.microbatches=3"], ["3"]),
    "stage axis without pipeline": ("lm_pipeline", ["pipeline=null"], ["pipeline"]),
    "cnn with zero_stage 3": ("cnn_bn", ["zero_stage=3"], ["zero_stage"]),
}


@pytest.mark.parametrize("case", list(LIBRARY))
def test_library_refusals_before_the_first_step_are_messages(case, capsys, tmp_path):
    name, overrides, words = LIBRARY[case]
    code, err = train(capsys, tmp_path, CONFIGS / f"{name}.yaml", "steps=2", *overrides)
    assert_user_error(code, err, *words)


def test_learning_rate_in_e_notation_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-3\n")
    assert config.load(path, ["clip_global_norm=2e-1"]).optimizer.learning_rate == 1e-3
    assert config.load(path, ["clip_global_norm=2e-1"]).clip_global_norm == 0.2
    assert config.load(path, ["learning_rate=5E-4"]).optimizer.learning_rate == 5e-4


def test_configs_built_in_python_are_checked_too():
    with pytest.raises(ValueError, match=r"^config: learning_rate must be a finite number"):
        config.from_dict(config.TrainConfig, {"learning_rate": float("nan")})
    with pytest.raises(ValueError, match=r"OptimizerConfig: learning_rate must be a finite number"):
        config.OptimizerConfig(learning_rate=float("nan"))
    with pytest.raises(ValueError, match=r"PipelineConfig: schedule='zigzag' is not a schedule"):
        config.PipelineConfig(schedule="zigzag")
    with pytest.raises(ValueError, match=r"TrainConfig: cpu_devices must be an int >= 0"):
        config.TrainConfig(cpu_devices=-1)


def test_a_changed_state_on_resume_is_a_message(capsys, tmp_path):
    cfg = CONFIGS / "mlp_zero.yaml"
    args = ("steps=2", "checkpoint_every=2", "log_every=1", "model.layers=2", "model.d_model=32")
    assert train(capsys, tmp_path, cfg, *args)[0] == 0
    code, err = train(capsys, tmp_path, cfg, *args[:-1], "model.d_model=16")
    assert_user_error(code, err, "checkpoint step 2", "holds another state", "name=mlp_zero-2")


def test_a_failure_during_training_keeps_its_traceback(capsys, tmp_path, monkeypatch):
    build = building.build

    def failing_build(cfg):
        repl, step_fn, state, input_fn, tokens = build(cfg)

        def broken_input(ctx):
            for i, batch in enumerate(input_fn(ctx)):
                if i == 2:
                    raise ValueError("the disk went away")  # after two steps
                yield batch

        return repl, step_fn, state, broken_input, tokens

    monkeypatch.setattr(building, "build", failing_build)  # where `run` looks it up
    with pytest.raises(ValueError, match="the disk went away"):
        cli.main(["train", str(CONFIGS / "mlp_zero.yaml"), f"out_dir={tmp_path}", "steps=5",
                  "model.layers=2", "plot=false"])  # fmt: skip


def test_a_locked_run_directory_is_a_message(capsys, tmp_path):
    out = tmp_path / "mlp_zero"
    with rundir.RunLock(rundir.lock_paths(out / "checkpoints", None)):
        code, err = train(capsys, tmp_path, CONFIGS / "mlp_zero.yaml", "steps=2")
    assert_user_error(code, err, str(out / "checkpoints"), f"PID {os.getpid()}", "another run")
    assert err.count("\n") == 1, err
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_cli_user_errors_in_a_subprocess_have_no_traceback(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nlearning_rate: -1\n")
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(path), f"out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("replicator train: ")
    assert "learning_rate" in run.stderr


def _fit(ckpt_dir, metrics_path, job=None):
    from oracle import OPTIMIZERS, batches, mlp_state, mlp_step

    if job is None:
        repl = rp.Replicator()
        job = repl, repl.replicate(mlp_state(repl.wrap_optimizer(OPTIMIZERS["adam"]())))
    repl, state = job
    return rp.fit(
        repl, mlp_step, state, lambda ctx: iter(batches(20)), steps=20,
        checkpointing=rp.training.CheckpointOptions(ckpt_dir, every=5),
        logging=rp.training.LoggingOptions(metrics_path=metrics_path, progress=False),
    )  # fmt: skip


@pytest.mark.slow
def test_a_second_run_into_a_directory_is_refused_and_a_killed_run_does_not_block(tmp_path):
    from oracle import OPTIMIZERS, mlp_state

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    repl = rp.Replicator()
    job = repl, repl.replicate(mlp_state(repl.wrap_optimizer(OPTIMIZERS["adam"]())))
    first = subprocess.Popen(
        [*WORKER, str(ckpt), str(metrics), str(tmp_path / "out.npz"), "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "5").is_dir():
            assert first.poll() is None, first.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        lines = len(metrics.read_text().splitlines())
        t0 = time.monotonic()
        with pytest.raises(rundir.RunDirLockedError, match=f"PID {first.pid} on host") as info:
            _fit(ckpt, metrics, job)
        assert time.monotonic() - t0 < 5  # at once
        assert str(ckpt) in str(info.value) and "another directory" in str(info.value)
        assert info.value.owner["pid"] == first.pid
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    assert (
        len(metrics.read_text().splitlines()) >= lines
    )  # the refused run wrote nothing of its own
    owner = json.loads((ckpt / rundir.LOCK_NAME).read_text())
    assert owner["pid"] == first.pid  # the stale lock file is still there, naming the dead run
    result = _fit(ckpt, metrics)  # ... and does not block the resume
    assert result.resumed_from is not None and result.resumed_from >= 5 and result.step == 20
    # the lock is released when fit ends, also when it raises
    with rundir.RunLock(rundir.lock_paths(ckpt, metrics)):
        pass
    with pytest.raises(ValueError, match="steps must be an int"):
        rp.fit(rp.Replicator(), lambda s, b: (s, None), {}, lambda ctx: iter([]), steps=0,
               checkpointing=rp.training.CheckpointOptions(ckpt))  # fmt: skip
    with rundir.RunLock(rundir.lock_paths(ckpt, None)):
        pass
    np.testing.assert_equal(jax.process_index(), 0)
