"""rp.fit: exact resume after SIGKILL, checkpoint and clean exit on SIGTERM, metrics that go on."""

import json
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import rel_err

import replicator as rp

WORKER = [sys.executable, str(Path(__file__).parent / "workers" / "fit_run.py")]


def start(tmp, name, delay):
    return subprocess.Popen(
        [*WORKER, str(tmp / "ckpt"), str(tmp / "metrics.jsonl"), str(tmp / name), str(delay)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_checkpoint(tmp, step, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not (tmp / "ckpt" / str(step)).is_dir():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of the worker straight to its last step (20): its directory, with the checkpoints,
    the metrics and the final parameters (``out.npz``)."""
    straight = tmp_path_factory.mktemp("straight")
    run = start(straight, "out.npz", 0.0)
    assert run.wait(timeout=300) == 0, run.stdout.read()
    return straight


@pytest.mark.slow
def test_a_killed_run_resumes_exactly(tmp_path, finished):
    proc = start(tmp_path, "out.npz", 0.15)
    wait_for_checkpoint(tmp_path, 10, proc)
    while '"step": 12' not in (tmp_path / "metrics.jsonl").read_text():  # logged, not saved
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    again = start(tmp_path, "out.npz", 0.0)
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output
    resumed_from = int(output.split("resumed_from=")[1].split()[0])
    assert resumed_from >= 10 and "done step=20" in output

    got = np.load(tmp_path / "out.npz")
    want = np.load(finished / "out.npz")
    for key in want.files:  # the same program on the same data: bitwise equal
        np.testing.assert_array_equal(got[key], want[key])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Each step once: the lines the killed run logged after its last checkpoint are dropped.
    assert [r["step"] for r in lines] == list(range(1, 21))
    by_step = {r["step"]: r["loss"] for r in json.loads("[" + ",".join(
        (finished / "metrics.jsonl").read_text().splitlines()) + "]")}  # fmt: skip
    assert all(r["loss"] == by_step[r["step"]] for r in lines)


@pytest.mark.slow
def test_rerunning_a_finished_run_exits_cleanly_and_says_it_is_complete(tmp_path, finished):
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)  # the run, finished
    again = start(tmp_path, "again.npz", 0.0)
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output
    assert "rp.fit: the run is complete at step 20 (steps=20)" in output
    assert "done step=20 preempted=False resumed_from=20" in output
    got, want = np.load(tmp_path / "again.npz"), np.load(tmp_path / "out.npz")
    for key in want.files:
        np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.slow  # 4.2 s
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    proc = start(tmp_path, "out.npz", 0.15)
    wait_for_checkpoint(tmp_path, 5, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "stopped by SIGTERM" in output and "preempted=True" in output
    step = int(output.split("done step=")[1].split()[0])
    assert 5 <= step < 20
    assert rp.Checkpoints(tmp_path / "ckpt").latest_step() == step


def test_fit_checks_its_arguments():
    repl = rp.Replicator()
    with pytest.raises(ValueError, match=r"steps must be an int >= 1"):
        rp.fit(repl, lambda s, b: (s, {}), {}, lambda ctx: [], steps=0)
    with pytest.raises(ValueError, match=r"CheckpointOptions: every must be an int >= 1 or None"):
        rp.training.CheckpointOptions("/tmp/run", every=0)
    with pytest.raises(TypeError, match=r"rp.fit: logging must be an rp.training.LoggingOptions"):
        rp.fit(repl, lambda s, b: (s, {}), {}, lambda ctx: [], steps=1, logging={"every": 1})
    with pytest.raises(TypeError, match=r"rp.fit: on_step must be a function on_step\(step\)"):
        rp.fit(repl, lambda s, b: (s, {}), {}, lambda ctx: [], steps=1, on_step=3)


def test_the_option_records_check_their_fields():
    with pytest.raises(TypeError, match=r"CheckpointOptions: directory must be a path"):
        rp.training.CheckpointOptions(None)
    with pytest.raises(ValueError, match=r"CheckpointOptions: keep must be an int >= 1; got 0"):
        rp.training.CheckpointOptions("/tmp/run", keep=0)
    with pytest.raises(TypeError, match=r"CheckpointOptions: async_save must be True or False"):
        rp.training.CheckpointOptions("/tmp/run", async_save="yes")
    with pytest.raises(ValueError, match=r"LoggingOptions: every must be an int >= 1 or None"):
        rp.training.LoggingOptions(every=0)
    with pytest.raises(TypeError, match=r"LoggingOptions: profile must be an rp.training.Profile"):
        rp.training.LoggingOptions(profile={"dir": "/tmp/trace"})
    with pytest.raises(TypeError, match=r"LoggingOptions: writers must be a list"):
        rp.training.LoggingOptions(writers="tb")
    with pytest.raises(TypeError, match=r"EvalOptions: fn must be a function"):
        rp.training.EvalOptions(None, every=2)
    with pytest.raises(ValueError, match=r"EvalOptions: every must be an int >= 1; got None"):
        rp.training.EvalOptions(lambda state: {}, every=None)


def linear_step(state, batch):
    def loss_fn(w):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    grad = rp.all_reduce(grad, "mean")
    return {"w": state["w"] - 0.1 * grad}, {"loss": rp.all_reduce(loss, "mean")}


def linear_data(n=40):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.array([[1.0], [-2.0], [0.5]], np.float32)}


def fit_linear(input_fn, steps, directory, **logging):
    repl = rp.Replicator()
    state = repl.replicate({"w": np.zeros((3, 1), np.float32)})
    return rp.fit(
        repl,
        linear_step,
        state,
        input_fn,
        steps=steps,
        checkpointing=rp.training.CheckpointOptions(directory, every=2),
        logging=rp.training.LoggingOptions(every=1, progress=False, **logging),
    )


def test_a_stateful_input_resumes_from_its_saved_position_without_replaying(tmp_path):
    pulled = []

    class Counted(rp.Batches):
        def __next__(self):
            pulled.append(1)
            return super().__next__()

    def input_fn(ctx):  # 5 batches per epoch: the run crosses into a second epoch
        return Counted(linear_data(), global_batch_size=8, ctx=ctx, seed=1)

    straight = fit_linear(input_fn, 7, tmp_path / "straight")
    fit_linear(input_fn, 4, tmp_path / "ckpt")
    _, record = rp.Checkpoints(tmp_path / "ckpt").restore({"w": np.zeros((3, 1), np.float32)})
    assert record["input_state"] == [{"epoch": 0, "batch": 4}]
    del pulled[:]
    resumed = fit_linear(input_fn, 7, tmp_path / "ckpt")
    assert resumed.resumed_from == 4 and resumed.step == 7
    assert len(pulled) < 4 + 3  # set_state, not a replay of the first 4 batches
    np.testing.assert_array_equal(np.asarray(resumed.state["w"]), np.asarray(straight.state["w"]))
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history[4:]]


@pytest.mark.slow  # 3.8 s
def test_a_grain_iterator_is_checkpointed_and_resumed(tmp_path):
    grain = pytest.importorskip("grain")
    data = linear_data()

    def input_fn(ctx):
        per = ctx.per_pipeline_batch_size(8)
        rows = grain.MapDataset.range(40).shuffle(seed=2).repeat()
        batches = rows.map(lambda i: {"x": data["x"][i], "y": data["y"][i]}).batch(per)
        return batches.to_iter_dataset()

    straight = fit_linear(input_fn, 7, tmp_path / "straight")
    fit_linear(input_fn, 4, tmp_path / "ckpt")
    _, record = rp.Checkpoints(tmp_path / "ckpt").restore({"w": np.zeros((3, 1), np.float32)})
    assert record["input_state"] == [{"next_index": 4}]
    resumed = fit_linear(input_fn, 7, tmp_path / "ckpt")
    assert resumed.resumed_from == 4
    np.testing.assert_array_equal(np.asarray(resumed.state["w"]), np.asarray(straight.state["w"]))


def read_tensorboard_scalars(directory):
    """{tag: [(step, value)]} from the TFRecord event files in ``directory``."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        raw = path.read_bytes()
        at = 0
        while at < len(raw):
            (length,) = struct.unpack("<Q", raw[at : at + 8])
            event = event_pb2.Event.FromString(raw[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")

    def input_fn(ctx):
        return rp.Batches(linear_data(), global_batch_size=8, ctx=ctx)

    result = fit_linear(
        input_fn,
        4,
        tmp_path / "ckpt",
        metrics_path=tmp_path / "metrics.jsonl",
        tensorboard_dir=tmp_path / "tb",
        examples_per_step=8,
    )
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert lines[-1]["loss"] < lines[0]["loss"] and lines[0]["examples_per_s"] > 0
    scalars = read_tensorboard_scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in scalars["loss"]], [r["loss"] for r in lines])
    assert result.history == lines


def test_progress_bar_in_a_terminal_and_lines_elsewhere(tmp_path, capsys, monkeypatch):
    def input_fn(ctx):
        return rp.Batches(linear_data(), global_batch_size=8, ctx=ctx)

    repl = rp.Replicator()
    state = repl.replicate({"w": np.zeros((3, 1), np.float32)})
    logging = rp.training.LoggingOptions(every=3)
    state = rp.fit(repl, linear_step, state, input_fn, steps=3, logging=logging).state
    plain = capsys.readouterr().err
    assert "step      3/3  loss" in plain and "rp.fit: 3 steps (to step 3)" in plain
    assert "━" not in plain  # not a terminal: no bar
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")
    rp.fit(repl, linear_step, state, input_fn, steps=3, logging=logging)
    bar = capsys.readouterr().err
    assert "3/3" in bar and "━" in bar and "rp.fit: 3 steps" in bar


def test_a_donated_state_is_a_clear_error_not_a_crash():
    repl = rp.Replicator()
    state = repl.replicate({"w": np.zeros((3, 1), np.float32)})
    batch = {k: v[:8] for k, v in linear_data().items()}
    repl.run(linear_step, state, batch)  # donates state
    with pytest.raises(ValueError, match=r"state leaf \['w'\] was donated to an earlier run"):
        repl.run(linear_step, state, batch)


def linear_eval(state, batch):
    loss = jnp.mean((batch["x"] @ state["w"] - batch["y"]) ** 2)
    return state, {"loss": rp.all_reduce(loss, "mean")}


def test_an_eval_fn_that_runs_the_replicator_leaves_training_exact():
    repl = rp.Replicator()
    assert repl.num_replicas == 8
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=(3, 1)).astype(np.float32)
    held_out = {k: v[:16] for k, v in linear_data(16).items()}

    def input_fn(ctx):
        return rp.Batches(linear_data(), global_batch_size=8, ctx=ctx, seed=4)

    def eval_fn(state):  # uses the replicator: run would donate fit's state
        _, out = repl.run(linear_eval, state, held_out)
        return rp.local_row(out)

    def train(evaluation=None):
        state = repl.replicate({"w": w0})
        logging = rp.training.LoggingOptions(every=1, progress=False)
        return rp.fit(
            repl, linear_step, state, input_fn, steps=6, logging=logging, evaluation=evaluation
        )

    plain = train()
    evaluated = train(rp.training.EvalOptions(eval_fn, every=2))
    assert rel_err(evaluated.state, plain.state) <= 1e-6
    assert rel_err(plain.state, {"w": w0}) > 1e-2  # it trained
    evals = [r for r in evaluated.history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    w = np.asarray(plain.state["w"])  # the last evaluation saw the final parameters
    want = float(np.mean((held_out["x"] @ w - held_out["y"]) ** 2))
    np.testing.assert_allclose(evals[-1]["eval_loss"], want, rtol=1e-5)
    assert [r["loss"] for r in evaluated.history if "loss" in r] == [
        r["loss"] for r in plain.history
    ]
    fresh = repl.replicate({"w": w0})  # after eval_fn, run donates again
    repl.run(linear_step, fresh, {k: v[:8] for k, v in linear_data().items()})
    assert fresh["w"].is_deleted()


def test_an_eval_fn_that_deletes_the_state_is_named():
    repl = rp.Replicator()
    donating = jax.jit(lambda s: jax.tree.map(lambda x: 2 * x, s), donate_argnums=0)

    def input_fn(ctx):
        return rp.Batches(linear_data(), global_batch_size=8, ctx=ctx)

    def eval_fn(state):
        return {"sum": jnp.sum(donating(state)["w"])}  # deletes fit's state

    state = repl.replicate({"w": np.zeros((3, 1), np.float32)})
    with pytest.raises(ValueError, match=r"rp\.fit: the evaluation's fn \(.*eval_fn\) deleted "
                       r"state leaf \['w'\]"):  # fmt: skip
        rp.fit(
            repl,
            linear_step,
            state,
            input_fn,
            steps=4,
            logging=rp.training.LoggingOptions(progress=False),
            evaluation=rp.training.EvalOptions(eval_fn, every=2),
        )


class ListWriter:
    def __init__(self):
        self.records, self.closed = [], 0

    def write(self, step, metrics):
        self.records.append({"step": step, **metrics})

    def close(self):
        self.closed += 1


TIMING = ("steps_per_s", "examples_per_s", "tokens_per_s")  # measured: they differ run to run


def untimed(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_the_old_keywords_warn_and_train_exactly_as_the_records(tmp_path):
    """Each keyword of the previous release still works, with a warning that names its field
    in the records and points at the caller's line, and trains exactly as the records do: the
    same state, history, JSONL lines, writer records, checkpoints and evaluations."""
    pytest.importorskip("tensorboardX")
    repl = rp.Replicator()

    def input_fn(ctx):
        return rp.Batches(linear_data(), global_batch_size=8, ctx=ctx, seed=5)

    def eval_fn(state):
        return {"w0": state["w"][0, 0]}

    def train(**options):
        state = repl.replicate({"w": np.zeros((3, 1), np.float32)})
        return rp.fit(repl, linear_step, state, input_fn, steps=5, **options)

    writers = {"new": ListWriter(), "old": ListWriter()}
    new = train(
        checkpointing=rp.training.CheckpointOptions(
            tmp_path / "new", every=2, keep=2, async_save=False, emergency_after=None,
            start_over_if_unreadable=False,
        ),
        logging=rp.training.LoggingOptions(
            every=2, metrics_path=tmp_path / "new.jsonl", tensorboard_dir=tmp_path / "tb_new",
            writers=[writers["new"]], examples_per_step=8, tokens_per_step=24, progress=False,
            profile=None,
        ),
        evaluation=rp.training.EvalOptions(eval_fn, every=2),
    )  # fmt: skip
    old_keywords = dict(
        checkpoint_dir=tmp_path / "old", checkpoint_every=2, keep=2, async_checkpoints=False,
        emergency_after=None, start_over_if_unreadable=False, log_every=2,
        metrics_path=tmp_path / "old.jsonl", tensorboard_dir=tmp_path / "tb_old",
        writers=[writers["old"]], examples_per_step=8, tokens_per_step=24, progress=False,
        profile=None, eval_fn=eval_fn, eval_every=2,
    )  # fmt: skip
    with pytest.warns(DeprecationWarning) as caught:
        old = train(**old_keywords)
    ours = [w for w in caught if str(w.message).startswith("rp.fit: ")]
    assert len(ours) == len(old_keywords) == 16
    assert {w.filename for w in ours} == {__file__}  # the caller's line, not fit's
    messages = "\n".join(str(w.message) for w in ours)
    for words in (
        "checkpoint_dir= is deprecated and will be removed in the next release; use "
        "checkpointing=rp.training.CheckpointOptions(directory=...)",
        "async_checkpoints= is deprecated and will be removed in the next release; use "
        "checkpointing=rp.training.CheckpointOptions(async_save=...)",
        "log_every= is deprecated and will be removed in the next release; use "
        "logging=rp.training.LoggingOptions(every=...)",
        "eval_fn= is deprecated and will be removed in the next release; use "
        "evaluation=rp.training.EvalOptions(fn=...)",
    ):
        assert words in messages, messages
    np.testing.assert_array_equal(np.asarray(old.state["w"]), np.asarray(new.state["w"]))
    assert untimed(old.history) == untimed(new.history)
    assert [sorted(r) for r in old.history] == [sorted(r) for r in new.history]
    assert [r["step"] for r in new.history] == [2, 2, 4, 4, 5]  # logs and evaluations
    lines = {k: [json.loads(x) for x in (tmp_path / f"{k}.jsonl").read_text().splitlines()]
             for k in ("old", "new")}  # fmt: skip
    assert untimed(lines["old"]) == untimed(lines["new"]) == untimed(new.history)
    assert untimed(writers["old"].records) == untimed(writers["new"].records)
    assert writers["old"].closed == writers["new"].closed == 1
    scalars = [read_tensorboard_scalars(tmp_path / f"tb_{k}")["loss"] for k in ("old", "new")]
    assert scalars[0] == scalars[1]
    assert rp.Checkpoints(tmp_path / "old").steps() == rp.Checkpoints(tmp_path / "new").steps()
    assert rp.Checkpoints(tmp_path / "new").steps() == [4, 5]


def test_an_old_keyword_beside_its_record_or_a_misspelt_one_is_refused(tmp_path):
    repl = rp.Replicator()
    args = (repl, linear_step, {}, lambda ctx: [])
    both = (
        r"rp.fit: checkpoint_every= \(deprecated\) and checkpointing= are both given; give "
        r"checkpoint_every in the record alone: checkpointing=rp.training.CheckpointOptions\("
        r"every=...\)"
    )
    with pytest.raises(ValueError, match=both):
        rp.fit(*args, steps=2, checkpointing=rp.training.CheckpointOptions(tmp_path),
               checkpoint_every=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"profile= \(deprecated\) and logging= are both given"):
        rp.fit(*args, steps=2, logging=rp.training.LoggingOptions(), profile=None)
    with pytest.raises(
        TypeError,
        match=r"rp.fit\(\) got an unexpected keyword argument 'chekpoint_every'; did you mean "
        r"'checkpoint_every'\?",
    ):
        rp.fit(*args, steps=2, chekpoint_every=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'logging_options'"):
        rp.fit(*args, steps=2, logging_options=rp.training.LoggingOptions())
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_the_old_keywords_refuse_as_they_did(tmp_path):
    repl = rp.Replicator()
    args = (repl, linear_step, {}, lambda ctx: [])
    writer = ListWriter()
    with pytest.warns(DeprecationWarning) as caught:
        with pytest.raises(ValueError, match=r"rp.fit: checkpoint_every must be an int >= 1 or N"):
            rp.fit(*args, steps=1, checkpoint_every=0, writers=[writer])
    assert len(caught) == 2 and "checkpoint_every= is deprecated" in str(caught[0].message)
    assert writer.closed == 1  # as fit closed its writers when it refused its arguments
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            ValueError, match=r"rp.fit: checkpoint_every is set but checkpoint_dir is None"
        ),
    ):
        rp.fit(*args, steps=1, checkpoint_every=2)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match=r"rp.fit: profile has unknown keys \['start'\]"),
    ):
        rp.fit(*args, steps=1, profile={"dir": str(tmp_path), "start": 2})


def test_on_step_is_called_after_each_step_with_its_number(tmp_path):
    """``on_step(step)``: after each step, counted over every run of the checkpoint directory;
    not at all for a run that is complete; an error it raises stops the run, as the step's own
    would (the step's checkpoint not saved). ``first_step`` logs step 1 too."""

    def input_fn(ctx):
        return rp.Batches(linear_data(), global_batch_size=8, ctx=ctx, seed=6)

    repl = rp.Replicator()
    seen = []

    def train(steps, on_step=seen.append):
        state = repl.replicate({"w": np.zeros((3, 1), np.float32)})
        return rp.fit(
            repl, linear_step, state, input_fn, steps=steps, on_step=on_step,
            checkpointing=rp.training.CheckpointOptions(tmp_path, every=2),
            logging=rp.training.LoggingOptions(every=4, first_step=True, progress=False),
        )  # fmt: skip

    assert [r["step"] for r in train(5).history] == [1, 4, 5]
    assert seen == [1, 2, 3, 4, 5]
    assert [r["step"] for r in train(7).history] == [7]  # resumed past step 1
    assert seen == [1, 2, 3, 4, 5, 6, 7]
    train(7)  # complete: no step
    assert seen == [1, 2, 3, 4, 5, 6, 7]

    def stop_at_10(step):
        if step == 10:
            raise RuntimeError("stopped from outside")

    with pytest.raises(RuntimeError, match="stopped from outside"):
        train(12, on_step=stop_at_10)
    assert rp.Checkpoints(tmp_path).latest_step() == 8
