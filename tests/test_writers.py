"""rp.fit(logging=rp.training.LoggingOptions(writers=[...])): your own metric writer,
TensorBoard, and Weights & Biases offline."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_loop import read_tensorboard_scalars

import replicator as rp
from replicator import cli
from replicator.cli import config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def linear_step(state, batch):
    def loss_fn(w):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - 0.1 * rp.all_reduce(grad, "mean")}, {
        "loss": rp.all_reduce(loss, "mean")
    }


def input_fn(ctx):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    return rp.Batches({"x": x, "y": y}, global_batch_size=8, ctx=ctx, seed=0)


def fit(steps=4, *, checkpoint_dir=None, eval_fn=None, **logging):
    """`rp.fit` of the linear step, checkpoints every 2 steps in ``checkpoint_dir`` (None:
    none), ``eval_fn`` every 2 steps, a log every step (``logging``: other `LoggingOptions`)."""
    repl = rp.Replicator()
    state = repl.replicate({"w": np.zeros((3, 1), np.float32)})
    logging = rp.training.LoggingOptions(**{"every": 1, "progress": False, **logging})
    return rp.fit(
        repl, linear_step, state, input_fn, steps=steps, logging=logging,
        checkpointing=checkpoint_dir and rp.training.CheckpointOptions(checkpoint_dir, every=2),
        evaluation=eval_fn and rp.training.EvalOptions(eval_fn, every=2),
    )  # fmt: skip


class ListWriter:
    """A writer of one's own: keeps the records."""

    def __init__(self):
        self.records, self.closed = [], 0

    def write(self, step, metrics):
        self.records.append({"step": step, **metrics})

    def close(self):
        self.closed += 1


def test_your_own_writer_gets_exactly_the_logged_records_and_is_closed(tmp_path):
    writer = ListWriter()
    assert isinstance(writer, rp.training.MetricWriter)
    result = fit(
        4,
        writers=[writer],
        metrics_path=tmp_path / "metrics.jsonl",
        eval_fn=lambda state: {"w0": state["w"][0, 0]},
    )
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert writer.records == result.history == lines
    assert [r["step"] for r in writer.records] == [1, 2, 2, 3, 4, 4]
    assert "eval_w0" in writer.records[2] and "steps_per_s" in writer.records[0]
    assert writer.closed == 1


def test_writers_are_closed_when_fit_fails_refuses_or_has_nothing_to_do(tmp_path):
    def boom(state):
        raise RuntimeError("eval failed")

    writer = ListWriter()
    with pytest.raises(RuntimeError, match="eval failed"):
        fit(4, writers=[writer], eval_fn=boom)
    assert [r["step"] for r in writer.records] == [1, 2] and writer.closed == 1

    writer = ListWriter()
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        fit(0, writers=[writer])
    assert writer.closed == 1

    fit(2, checkpoint_dir=tmp_path / "ckpt")
    writer = ListWriter()
    assert fit(2, checkpoint_dir=tmp_path / "ckpt", writers=[writer]).step == 2  # complete
    assert writer.records == [] and writer.closed == 1


def test_fit_refuses_writers_that_are_not_a_list_of_writers():
    with pytest.raises(
        TypeError, match=r"rp.training.LoggingOptions: writers must be a list .* got a ListWriter"
    ):
        fit(1, writers=ListWriter())
    with pytest.raises(
        TypeError,
        match=r"rp.training.LoggingOptions: writers\[1\] \(a str\) has no write\(step, metrics\) "
        r"method; give objects with write\(step, metrics\) and close\(\) \(rp.training.MetricWriter\)",
    ):
        fit(1, writers=[ListWriter(), "tb"])

    class NoClose:
        def write(self, step, metrics):
            pass

    with pytest.raises(TypeError, match=r"writers\[0\] \(a NoClose\) has no close\(\) method"):
        fit(1, writers=[NoClose()])


def test_tensorboard_writer_leaves_event_files(tmp_path):
    pytest.importorskip("tensorboardX")
    result = fit(3, writers=[rp.training.TensorBoardWriter(tmp_path / "tb")])
    scalars = read_tensorboard_scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["loss"]], [r["loss"] for r in result.history])


def test_without_tensorboardx_a_tensorboard_writer_warns_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX fails
    with pytest.warns(UserWarning, match=r'tensorboardX is not installed.*"replicator\[tens'):
        writer = rp.training.TensorBoardWriter(tmp_path / "tb")
    with pytest.warns(UserWarning, match=r"rp.fit: tensorboard_dir is set but tensorboardX"):
        result = fit(2, writers=[writer], tensorboard_dir=tmp_path / "tb2")
    assert result.step == 2
    assert not (tmp_path / "tb").exists() and not (tmp_path / "tb2").exists()


# Weights & Biases, offline: nothing leaves this machine.


def wandb_services():
    """The wandb-core service processes that this process started (``--pid <this pid>``)."""
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"wandb-core") and b"--pid" in args:
            if args[args.index(b"--pid") + 1] == str(os.getpid()).encode():
                found.append(cmdline.parent.name)
    return found


@pytest.fixture
def wandb(tmp_path, monkeypatch):
    """wandb offline and quiet, its files in tmp_path, any server address a closed port; its
    service process is ended after the test, and the test checks that it is gone."""
    wandb = pytest.importorskip("wandb")
    closed_port = "http://127.0.0.1:9"
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_BASE_URL": closed_port,
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "HTTP_PROXY": closed_port,
        "HTTPS_PROXY": closed_port,
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield wandb
    wandb.teardown()
    deadline = time.monotonic() + 30
    while wandb_services():
        assert time.monotonic() < deadline, f"wandb-core still running: {wandb_services()}"
        time.sleep(0.1)
    for log in tmp_path.glob("**/wandb/**/*.log"):  # no attempt to reach a server
        assert "127.0.0.1:9" not in log.read_text(errors="replace"), log


def wandb_records(path):
    """The protobuf records of a ``run-<id>.wandb`` file: W&B's header, then LevelDB-log
    records (7-byte headers: checksum, length, type) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    raw = pathlib.Path(path).read_bytes()
    assert raw[:4] == b":W&B"
    at, pending = 7, b""
    while at + 7 <= len(raw):
        left = 32768 - at % 32768
        _, length, kind = struct.unpack("<IHB", raw[at : at + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at the end of a block
            at += left
            continue
        pending += raw[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def items(update):
    """{key: value} of the items of a history or config record."""
    return {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in update}


def offline_runs(directory, wait: float = 10.0):
    """{run directory: (run record, [history rows])} of the offline runs under ``directory``;
    read again, for up to ``wait`` seconds, while a run's file holds no run record yet (W&B's
    service may still be writing it when a loaded machine returns from ``finish``)."""
    deadline = time.monotonic() + wait
    runs = _offline_runs(directory)
    while any(run is None for run, _ in runs.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        runs = _offline_runs(directory)
    return runs


def _offline_runs(directory):
    runs = {}
    for run_dir in sorted(pathlib.Path(directory).glob("wandb/offline-run-*")):
        (path,) = run_dir.glob("run-*.wandb")
        if path.stat().st_size < 7:  # not written yet
            runs[run_dir.name] = (None, [])
            continue
        run, rows = None, []
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "history":
                rows.append(items(record.history.item))
        runs[run_dir.name] = (run, [{k: v for k, v in r.items() if k[0] != "_"} | {
            "step": r["_step"]} for r in rows])  # fmt: skip
    return runs


def test_wandb_writer_leaves_an_offline_run_with_the_logged_history(tmp_path, wandb):
    writer = rp.training.WandbWriter(project="replicator-tests", name="linear", dir=tmp_path, config={
        "lr": 0.1})  # fmt: skip
    result = fit(4, writers=[writer], eval_fn=lambda s: {"w0": s["w"][0, 0]})
    ((run, rows),) = offline_runs(tmp_path).values()
    assert run.project == "replicator-tests" and run.display_name == "linear"
    assert items(run.config.update)["lr"] == 0.1
    merged = {}  # W&B keeps one row per step: the training and eval records of a step merge
    for record in result.history:
        merged.setdefault(record["step"], {}).update(record)
    assert rows == list(merged.values())  # every value, exactly (JSON floats)
    assert wandb_services()  # the service runs until the process ends, or wandb.teardown()


def test_a_resumed_fit_starts_a_new_offline_run_from_the_checkpoint(tmp_path, wandb):
    ckpt = {"checkpoint_dir": tmp_path / "ckpt"}
    first = fit(4, writers=[rp.training.WandbWriter(project="p", dir=tmp_path)], **ckpt)
    second = fit(6, writers=[rp.training.WandbWriter(project="p", dir=tmp_path)], **ckpt)
    assert second.resumed_from == 4
    runs = sorted(offline_runs(tmp_path).values(), key=lambda run: run[1][0]["step"])
    assert len(runs) == 2 and runs[0][0].run_id != runs[1][0].run_id
    assert [[r["step"] for r in rows] for _, rows in runs] == [[1, 2, 3, 4], [5, 6]]
    assert [r["loss"] for _, rows in runs for r in rows] == [
        r["loss"] for r in first.history + second.history
    ]


def test_wandb_writer_skips_steps_below_the_last_one_with_a_warning(tmp_path, wandb):
    writer = rp.training.WandbWriter(project="p", dir=tmp_path)
    writer.write(5, {"loss": 1.0})
    writer.write(5, {"eval_loss": 2.0})  # the same step: the same row
    with pytest.warns(
        UserWarning, match=r"rp.training.WandbWriter: step 3 is below step 5, .* skipped"
    ):
        writer.write(3, {"loss": 9.0})
    writer.write(4, {"loss": 9.0})  # skipped without another warning
    writer.write(6, {"loss": 0.5})
    writer.close()
    ((_, rows),) = offline_runs(tmp_path).values()
    assert rows == [{"loss": 1.0, "eval_loss": 2.0, "step": 5}, {"loss": 0.5, "step": 6}]


def test_wandb_writer_calls_wandb_init_once_and_continues_a_resumed_run(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    calls = []

    class Run:  # a resumed online run whose last logged step was 6: its next step is 7
        resumed, step = True, 7

        def log(self, metrics, step):
            calls.append(("log", step, metrics))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setattr(wandb, "init", init)
    writer = rp.training.WandbWriter(project="p", name="n", dir=tmp_path, mode="online", config={"a": 1},
                            id="abc", resume="allow")  # fmt: skip
    assert calls == []  # the run starts at the first write (on process 0 only, in rp.fit)
    with pytest.warns(UserWarning, match=r"step 6 is below step 7, the next step of the resumed"):
        writer.write(6, {"loss": 1.0})
    writer.write(7, {"loss": 0.5})
    writer.close()
    writer.close()  # closing twice is harmless
    assert calls == [
        ("init", {"project": "p", "name": "n", "dir": str(tmp_path), "mode": "online",
                  "config": {"a": 1}, "reinit": "create_new", "id": "abc", "resume": "allow"}),
        ("log", 7, {"loss": 0.5}),
        ("finish",),
    ]  # fmt: skip


def test_wandb_writer_refuses_bad_arguments_and_says_how_to_install_wandb(monkeypatch):
    pytest.importorskip("wandb")
    with pytest.raises(
        ValueError, match=r"rp.training.WandbWriter: project must be a non-empty str"
    ):
        rp.training.WandbWriter(project="")
    with pytest.raises(
        ValueError, match=r"rp.training.WandbWriter: mode='onlin' is not one of 'offline', 'online'"
    ):
        rp.training.WandbWriter(project="p", mode="onlin")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails
    with pytest.raises(ImportError, match=r"wandb is not installed; pip install wandb \(or pip"):
        rp.training.WandbWriter(project="p")


# The CLI: `wandb:` in a config, or on the command line.


def test_the_wandb_key_is_a_section_or_true(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: r1\nwandb: true\n")
    assert config.load(path).wandb == config.WandbConfig()
    assert config.load(path, ["wandb.mode=disabled"]).wandb == config.WandbConfig(mode="disabled")
    assert config.load(path, ["wandb=false"]).wandb is None
    path.write_text("name: r1\n")
    assert config.load(path).wandb is None
    got = config.load(path, ["wandb.project=x", "wandb.name=y"]).wandb
    assert got == config.WandbConfig(project="x", name="y", mode="offline")
    for override, words in [
        ("wandb.mode=onlin", r"c.yaml: wandb.mode='onlin' is not a wandb mode; use one of "
                             r"'offline', 'online', 'disabled'. Did you mean 'online'\?"),
        ("wandb.projct=x", r"unknown key 'projct' in WandbConfig. Did you mean 'project'\?"),
        ("wandb=offline", r"c.yaml: wandb: expected a section \(mapping\) or true/false; got 'offline'"),
        ("wandb.project=''", r"c.yaml: wandb.project must be a non-empty name or null; got ''"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            config.load(path, [override])


@pytest.mark.slow
def test_a_cli_run_with_wandb_writes_an_offline_run_in_the_run_directory(tmp_path, wandb):
    code = cli.main(["train", str(ROOT / "configs/lm_dp.yaml"), f"out_dir={tmp_path}",
                     "steps=2", "log_every=1", "checkpoint_every=2", "plot=false",
                     "model.layers=1", "model.d_model=16", "wandb.project=cli-tests"])  # fmt: skip
    assert code == 0
    ((run, rows),) = offline_runs(tmp_path / "lm_dp").values()
    assert run.project == "cli-tests" and run.display_name == "lm_dp"
    lines = [json.loads(x) for x in (tmp_path / "lm_dp/metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in lines]
    logged = items(run.config.update)  # the run's config, as W&B's config
    assert logged["model"]["d_model"] == 16 and logged["steps"] == 2 and logged["wandb"]


def test_a_cli_run_without_wandb_installed_is_refused_before_any_work(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "wandb", None)
    code = cli.main(
        ["train", str(ROOT / "configs/lm_dp.yaml"), f"out_dir={tmp_path}", "wandb=true"]
    )
    assert code == 2
    assert (
        "replicator train: wandb: rp.training.WandbWriter: wandb is not installed"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "lm_dp" / "checkpoints").exists()
