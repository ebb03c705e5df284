"""rp.fit: exact resume after SIGKILL, checkpoint and clean exit on SIGTERM, metrics that go on."""

import json
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


@pytest.mark.slow
def test_a_killed_run_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    straight.mkdir()
    run = start(straight, "out.npz", 0.0)
    assert run.wait(timeout=300) == 0, run.stdout.read()

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
    want = np.load(straight / "out.npz")
    for key in want.files:  # the same program on the same data: bitwise equal
        np.testing.assert_array_equal(got[key], want[key])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Each step once: the lines the killed run logged after its last checkpoint are dropped.
    assert [r["step"] for r in lines] == list(range(1, 21))
    by_step = {r["step"]: r["loss"] for r in json.loads("[" + ",".join(
        (straight / "metrics.jsonl").read_text().splitlines()) + "]")}  # fmt: skip
    assert all(r["loss"] == by_step[r["step"]] for r in lines)


@pytest.mark.slow
def test_rerunning_a_finished_run_exits_cleanly_and_says_it_is_complete(tmp_path):
    run = start(tmp_path, "out.npz", 0.0)
    assert run.wait(timeout=300) == 0, run.stdout.read()
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
    with pytest.raises(ValueError, match=r"checkpoint_every must be an int >= 1 or None"):
        rp.fit(repl, lambda s, b: (s, {}), {}, lambda ctx: [], steps=1, checkpoint_every=0)


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


def fit_linear(input_fn, steps, directory, **kwargs):
    repl = rp.Replicator()
    state = repl.replicate({"w": np.zeros((3, 1), np.float32)})
    return rp.fit(
        repl,
        linear_step,
        state,
        input_fn,
        steps=steps,
        checkpoint_dir=directory,
        checkpoint_every=2,
        log_every=1,
        progress=False,
        **kwargs,
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
    state = rp.fit(repl, linear_step, state, input_fn, steps=3, log_every=3).state
    plain = capsys.readouterr().err
    assert "step      3/3  loss" in plain and "rp.fit: 3 steps (to step 3)" in plain
    assert "━" not in plain  # not a terminal: no bar
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")
    rp.fit(repl, linear_step, state, input_fn, steps=3, log_every=3)
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

    def train(**kwargs):
        state = repl.replicate({"w": w0})
        return rp.fit(
            repl, linear_step, state, input_fn, steps=6, log_every=1, progress=False, **kwargs
        )

    plain = train()
    evaluated = train(eval_fn=eval_fn, eval_every=2)
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
    with pytest.raises(ValueError, match=r"rp\.fit: eval_fn .*state leaf \['w'\]"):
        rp.fit(
            repl,
            linear_step,
            state,
            input_fn,
            steps=4,
            eval_fn=eval_fn,
            eval_every=2,
            progress=False,
        )
