"""Faults injected into checkpoints and rp.fit runs, each with its expected outcome: an exact
resume, a clear error, or a safe stop with nothing good lost."""

import json
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp

LIKE = {"w": np.zeros((3, 1), np.float32)}


def linear_data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.array([[1.0], [-2.0], [0.5]], np.float32)}


def batches(n, poison=None):
    """``n`` global batches of 8; ``poison`` = {step (1-based): function of the batch}."""
    data = linear_data(8 * n)
    out = [{k: v[8 * i : 8 * i + 8].copy() for k, v in data.items()} for i in range(n)]
    for step, change in (poison or {}).items():
        out[step - 1] = change(out[step - 1])
    return out


def linear_step(lr=0.1):
    def step_fn(state, batch):
        def loss_fn(w):
            return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

        loss, grad = jax.value_and_grad(loss_fn)(state["w"])
        grad = rp.all_reduce(grad, "mean")
        return {"w": state["w"] - lr * grad}, {"loss": rp.all_reduce(loss, "mean")}

    return step_fn


def fit(directory, steps, data, *, lr=0.1, step_fn=None, **kwargs):
    repl = rp.Replicator()
    kwargs = {"checkpoint_every": 2, "log_every": 1, "progress": False, **kwargs}
    return rp.fit(
        repl,
        step_fn or linear_step(lr),
        repl.replicate(LIKE),
        lambda ctx: iter(data),
        steps=steps,
        checkpoint_dir=directory,
        **kwargs,
    )


def saved_w(directory, step):
    state, _ = rp.Checkpoints(directory).restore(LIKE, step=step)
    return np.asarray(state["w"])


def corrupt_array_file(step_dir):
    files = [p for p in sorted(Path(step_dir, "state").rglob("*")) if p.is_file()]
    for path in files:
        if "metadata" not in path.name.lower():
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])


def garble_metadata(step_dir):
    for path in Path(step_dir, "state").rglob("*"):
        if path.is_file() and "metadata" in path.name.lower():
            path.write_bytes(b"\x00garbled{")


def empty_step_dir(step_dir):
    for path in sorted(Path(step_dir).rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()


def drop_record(step_dir):
    for path in sorted(Path(step_dir, "record").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()


# -- checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "breaks", [corrupt_array_file, garble_metadata, empty_step_dir, drop_record]
)
def test_a_broken_newest_step_is_moved_aside_and_the_run_saves_that_step_again(tmp_path, breaks):
    data = batches(8)
    straight = fit(tmp_path / "straight", 8, data)
    fit(tmp_path / "ckpt", 6, data)  # checkpoints 2, 4, 6
    good4 = saved_w(tmp_path / "ckpt", 4)
    breaks(tmp_path / "ckpt" / "6")
    with pytest.warns(UserWarning) as caught:
        resumed = fit(tmp_path / "ckpt", 8, data)
    text = "\n".join(str(w.message) for w in caught)
    assert "checkpoint step 6" in text and "is unreadable (" in text and ": " in text
    aside = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("6.broken-")]
    assert len(aside) == 1 and f"moved it aside to {tmp_path / 'ckpt' / aside[0]}" in text
    assert resumed.resumed_from == 4 and resumed.step == 8  # step 6 saved again on the way
    np.testing.assert_array_equal(np.asarray(resumed.state["w"]), np.asarray(straight.state["w"]))
    np.testing.assert_array_equal(saved_w(tmp_path / "ckpt", 4), good4)
    assert rp.Checkpoints(tmp_path / "ckpt").steps() == [4, 6, 8]
    np.testing.assert_array_equal(saved_w(tmp_path / "ckpt", 6), saved_w(tmp_path / "straight", 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no crash loop: the next run reads step 8 cleanly
        again = fit(tmp_path / "ckpt", 8, data)
    assert again.resumed_from == 8 and again.step == 8


def test_the_two_newest_broken_are_both_moved_aside(tmp_path):
    ckpt = rp.Checkpoints(tmp_path, keep=5)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": np.full((3, 1), float(step), np.float32)})
    corrupt_array_file(tmp_path / "3")
    garble_metadata(tmp_path / "2")
    with pytest.warns(UserWarning, match=r"moved it aside"):
        state, record = ckpt.restore(LIKE)
    assert record["step"] == 1 and float(state["w"][0, 0]) == 1.0
    names = sorted(os.listdir(tmp_path))
    assert names[0] == "1" and names[1].startswith("2.broken-") and names[2].startswith("3.broken-")
    ckpt.save(2, state)  # the step numbers are free again
    assert ckpt.steps() == [1, 2]


def test_a_file_named_like_a_step_is_not_a_checkpoint_and_is_left_alone(tmp_path):
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(1, {"w": np.ones((3, 1), np.float32)})
    (tmp_path / "5").write_text("not a checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, record = rp.Checkpoints(tmp_path).restore(LIKE)
    assert record["step"] == 1 and (tmp_path / "5").read_text() == "not a checkpoint"


def test_when_no_step_restores_nothing_is_moved_and_the_error_says_why(tmp_path):
    ckpt = rp.Checkpoints(tmp_path)
    for step in (1, 2):
        ckpt.save(step, {"w": np.ones((3, 1), np.float32)})
        corrupt_array_file(tmp_path / str(step))
    with (
        pytest.warns(UserWarning, match=r"is unreadable \(\w+"),
        pytest.raises(FileNotFoundError, match=r"no readable checkpoint .*None was moved"),
    ):
        ckpt.restore(LIKE)
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_a_dtype_change_is_a_mismatch_and_moves_nothing(tmp_path):
    ckpt = rp.Checkpoints(tmp_path)
    for step in (1, 2):
        ckpt.save(step, {"w": np.ones((3, 1), np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(rp.StateMismatchError, match=r"is float32, but .* bfloat16"):
            ckpt.restore({"w": jnp.zeros((3, 1), jnp.bfloat16)})
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


# -- non-finite training --------------------------------------------------------------------


def nan_rows(batch):
    batch["x"][:] = np.nan
    return batch


def nan_in_one_replica(batch):
    batch["x"][0, 0] = np.nan  # replica 0's single example
    return batch


def huge(batch):
    batch["x"][:] = 1e30  # the squared error overflows to inf
    return batch


def test_a_nan_learning_rate_stops_before_saving_and_keeps_every_good_checkpoint(tmp_path):
    data = batches(12)
    fit(tmp_path, 4, data)  # good checkpoints 2 and 4
    good = {s: saved_w(tmp_path, s) for s in (2, 4)}
    # Step 5 starts from finite weights (finite loss) and makes them nan: step 6's loss is nan.
    with pytest.raises(
        rp.NonFiniteError,
        match=r"rp\.fit: the training output 'loss' is nan at step 6\. Stopped before saving "
        r"anything non-finite: the checkpoints in .* are kept \(newest: step 4\)\.\n"
        r"Lower the learning rate.* to resume from step 4\.",
    ):
        fit(tmp_path, 12, data, lr=float("nan"))
    assert rp.Checkpoints(tmp_path).steps() == [2, 4]
    for step, w in good.items():
        np.testing.assert_array_equal(saved_w(tmp_path, step), w)
    assert issubclass(rp.NonFiniteError, FloatingPointError)
    resumed = fit(tmp_path, 8, data)  # a good learning rate goes on from step 4
    assert resumed.resumed_from == 4 and np.isfinite(np.asarray(resumed.state["w"])).all()


@pytest.mark.parametrize(
    ("poison", "value"), [(nan_rows, "nan"), (huge, "inf"), (nan_in_one_replica, "nan")]
)
def test_non_finite_data_at_step_3_is_a_clear_error(tmp_path, poison, value):
    data = batches(10, {3: poison})
    with pytest.raises(rp.NonFiniteError, match=rf"'loss' is {value} at step 3\."):
        fit(tmp_path, 10, data)
    assert rp.Checkpoints(tmp_path).steps() == [2]
    assert np.isfinite(saved_w(tmp_path, 2)).all()


def test_a_nan_loss_at_step_1_saves_nothing(tmp_path):
    with pytest.raises(rp.NonFiniteError, match=r"at step 1\. .*no checkpoint in .* yet"):
        fit(tmp_path, 4, batches(4, {1: nan_rows}))
    assert rp.Checkpoints(tmp_path).steps() == []


def test_without_checkpoints_the_error_says_nothing_was_saved():
    with pytest.raises(rp.NonFiniteError, match=r"there is no checkpoint_dir, so nothing"):
        fit(None, 4, batches(4, {2: nan_rows}), checkpoint_every=None)


def test_between_logs_the_save_step_checks_the_outputs(tmp_path):
    with pytest.raises(rp.NonFiniteError, match=r"'loss' is nan at step 4\."):
        fit(tmp_path, 8, batches(8, {3: nan_rows}), log_every=100)
    assert rp.Checkpoints(tmp_path).steps() == [2]


def test_a_non_finite_state_with_a_finite_loss_is_not_saved(tmp_path):
    def step_fn(state, batch):  # reports a finite loss, but its weights become nan
        bad = jnp.where(jnp.any(batch["x"] > 100.0), jnp.nan, 1.0)
        return {"w": state["w"] * bad}, {"loss": jnp.float32(1.0)}

    data = batches(8, {3: lambda b: {**b, "x": b["x"] + 1000.0}})
    with pytest.raises(
        rp.NonFiniteError,
        match=r"state leaf \['w'\] is not finite \(nan or inf\) at step 4\. .*newest: step 2",
    ):
        fit(tmp_path, 8, data, step_fn=step_fn)
    assert rp.Checkpoints(tmp_path).steps() == [2]


def test_a_step_skipped_by_dynamic_loss_scaling_is_not_an_error(tmp_path):
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.sgd(0.1), loss_scale="dynamic")

    def loss_fn(w, batch):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    def step_fn(state, batch):
        w, opt_state, metrics = opt.step(loss_fn, state["w"], state["opt"], batch)
        return {"w": w, "opt": opt_state}, metrics

    w = repl.replicate(LIKE["w"])
    state = {"w": w, "opt": opt.init(w)}
    data = batches(6, {3: nan_rows})
    result = rp.fit(
        repl,
        step_fn,
        state,
        lambda ctx: iter(data),
        steps=6,
        checkpoint_dir=tmp_path,
        checkpoint_every=2,
        log_every=1,
        progress=False,
    )
    by_step = {r["step"]: r for r in result.history}
    assert np.isnan(by_step[3]["loss"]) and by_step[3]["skipped"] == 1
    assert result.step == 6 and rp.Checkpoints(tmp_path).steps() == [2, 4, 6]
    assert np.isfinite(np.asarray(result.state["w"])).all()


# -- finished runs, metrics, inputs that end ------------------------------------------------


def test_rerunning_a_finished_run_says_it_is_complete(tmp_path, capsys):
    data = batches(6)
    done = fit(tmp_path, 6, data)
    capsys.readouterr()
    again = fit(tmp_path, 6, data)
    err = capsys.readouterr().err
    assert "rp.fit: the run is complete at step 6 (steps=6)" in err and len(err.splitlines()) == 1
    assert again.step == 6 and again.resumed_from == 6 and again.history == []
    np.testing.assert_array_equal(np.asarray(again.state["w"]), np.asarray(done.state["w"]))
    assert rp.Checkpoints(tmp_path).steps() == [2, 4, 6]
    fewer = fit(tmp_path, 4, data)  # fewer steps than done: complete as well, nothing undone
    assert fewer.step == 6 and "complete at step 6 (steps=4)" in capsys.readouterr().err


def test_rerunning_with_more_steps_goes_on_exactly(tmp_path):
    data = batches(10)
    straight = fit(tmp_path / "straight", 10, data)
    fit(tmp_path / "ckpt", 6, data)
    more = fit(tmp_path / "ckpt", 10, data)
    assert more.resumed_from == 6 and more.step == 10
    np.testing.assert_array_equal(np.asarray(more.state["w"]), np.asarray(straight.state["w"]))


def test_after_a_crash_metrics_have_each_step_once(tmp_path):
    data = batches(8)
    metrics = tmp_path / "metrics.jsonl"

    def crashing(ctx):
        yield from data[:5]
        raise RuntimeError("the host died")  # after step 5, past checkpoint 4

    repl = rp.Replicator()
    with pytest.raises(RuntimeError, match="the host died"):
        rp.fit(
            repl,
            linear_step(),
            repl.replicate(LIKE),
            crashing,
            steps=8,
            checkpoint_dir=tmp_path / "ckpt",
            checkpoint_every=2,
            log_every=1,
            metrics_path=metrics,
            progress=False,
        )
    with open(metrics, "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a kill
    resumed = fit(tmp_path / "ckpt", 8, data, metrics_path=metrics)
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert resumed.resumed_from == 4
    assert [r["step"] for r in lines] == list(range(1, 9))
    straight = fit(tmp_path / "straight", 8, data)
    assert [r["loss"] for r in lines] == [r["loss"] for r in straight.history]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_an_input_that_ends_early_saves_where_it_ended(tmp_path, capsys):
    data = batches(10)
    short = fit(tmp_path, 10, data[:5])
    err = capsys.readouterr().err
    assert short.step == 5 and rp.Checkpoints(tmp_path).steps() == [2, 4, 5]
    assert (
        f"rp.fit: the input (input_fn) ended at step 5 of 10, before steps; checkpoint of step "
        f"5 saved in {tmp_path}." in err
    )
    np.testing.assert_array_equal(saved_w(tmp_path, 5), np.asarray(short.state["w"]))
    resumed = fit(tmp_path, 10, data)  # a longer input goes on from step 5 exactly
    straight = fit(tmp_path / "straight", 10, data)
    assert resumed.resumed_from == 5
    np.testing.assert_array_equal(np.asarray(resumed.state["w"]), np.asarray(straight.state["w"]))


def test_an_input_with_no_batch_saves_nothing_and_says_so(tmp_path, capsys):
    result = fit(tmp_path, 4, [])
    assert result.step == 0 and rp.Checkpoints(tmp_path).steps() == []
    assert "ended at step 0 of 4" in capsys.readouterr().err
