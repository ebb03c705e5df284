"""Faults injected into checkpoints and rp.fit runs, each with its expected outcome: an exact
resume, a clear error, or a safe stop with nothing good lost."""

import errno
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator import cli
from replicator.cli import config

LIKE = {"w": np.zeros((3, 1), np.float32)}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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


def fit(directory, steps, data, *, lr=0.1, step_fn=None, every=2, logging=(), **checkpointing):
    """`rp.fit` of the linear step on ``data``, checkpoints in ``directory`` (None: none) every
    ``every`` steps with the other ``checkpointing`` options, a log every step (``logging``:
    other `LoggingOptions`)."""
    repl = rp.Replicator()
    saving = None
    if directory is not None:
        saving = rp.training.CheckpointOptions(directory, every=every, **checkpointing)
    logging = {"every": 1, "progress": False, **dict(logging)}
    return rp.fit(
        repl,
        step_fn or linear_step(lr),
        repl.replicate(LIKE),
        lambda ctx: iter(data),
        steps=steps,
        checkpointing=saving,
        logging=rp.training.LoggingOptions(**logging),
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
        fit(None, 4, batches(4, {2: nan_rows}))


def test_between_logs_the_save_step_checks_the_outputs(tmp_path):
    with pytest.raises(rp.NonFiniteError, match=r"'loss' is nan at step 4\."):
        fit(tmp_path, 8, batches(8, {3: nan_rows}), logging={"every": 100})
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
        checkpointing=rp.training.CheckpointOptions(tmp_path, every=2),
        logging=rp.training.LoggingOptions(every=1, progress=False),
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
            checkpointing=rp.training.CheckpointOptions(tmp_path / "ckpt", every=2),
            logging=rp.training.LoggingOptions(every=1, metrics_path=metrics, progress=False),
        )
    with open(metrics, "a") as f:
        f.write('{"step": 6, "lo')  # a line cut short by a kill
    resumed = fit(tmp_path / "ckpt", 8, data, logging={"metrics_path": metrics})
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


# -- a full disk ----------------------------------------------------------------------------

# tensorstore's error for a checkpoint array written into a full filesystem, word for word as on
# a full tmpfs (orbax-checkpoint 0.12, tensorstore 0.1.86): a ValueError out of the array write,
# after orbax made the step's temporary directory. (RLIMIT_FSIZE would give EFBIG instead.)
NO_SPACE = (
    'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file "{tmp}/state.orbax-'
    'checkpoint-tmp/ocdbt.process_0/": Failed writing: "{tmp}/state.orbax-checkpoint-tmp/'
    'ocdbt.process_0/d/c06e6124f6029d3020c83113f95eed7e": Failed to write 3365248 bytes to file '
    "7: No space left on device [os_error_code='28']"
)


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(directory, step)``: tensorstore's writes of checkpoint steps >= ``step`` into
    ``directory`` fail as on a full filesystem; ``full_disk(None)``: space again."""
    import tensorstore as ts

    write, full = ts.TensorStore.write, {}

    def failing_write(self, *args, **kwargs):
        for tmp in Path(full["dir"]).glob("*.orbax-checkpoint-tmp*") if full else ():
            if int(tmp.name.split(".")[0]) >= full["step"]:

                async def no_space(tmp=tmp):
                    raise ValueError(NO_SPACE.format(tmp=tmp))

                return no_space()
        return write(self, *args, **kwargs)

    def fill(directory, step=0):
        full.clear()
        if directory is not None:
            full.update(dir=directory, step=step)

    monkeypatch.setattr(ts.TensorStore, "write", failing_write)
    return fill


def leftovers(directory):
    return [p.name for p in Path(directory).iterdir() if ".orbax-checkpoint-tmp" in p.name]


@pytest.mark.parametrize("async_checkpoints", [False, True])
def test_a_full_disk_is_one_clear_error_and_the_good_checkpoints_resume(
    tmp_path, full_disk, async_checkpoints, caplog
):
    data = batches(8)
    ckpt = tmp_path / "ckpt"
    full_disk(ckpt, 6)
    with pytest.raises(rp.CheckpointWriteError) as caught:
        fit(ckpt, 8, data, async_save=async_checkpoints)
    e = caught.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.step == 6
    assert str(e) == (
        f"rp.Checkpoints.save: checkpoint step 6 could not be written to {ckpt}: no space left "
        f"on device (ENOSPC). Its partial directory was removed; the complete checkpoints there "
        f"are untouched (newest: step 4), so running again resumes from step 4. Make room on "
        f"that filesystem: free space (or quota), keep fewer checkpoints (keep=3 now; a save "
        f"needs room for one checkpoint more before the oldest beyond keep is deleted), or give "
        f"checkpoint_dir a larger disk."
    )
    assert e.__cause__ is None and e.__suppress_context__  # no chain of orbax's tracebacks
    assert not [r for r in caplog.records if "No space left" in r.getMessage()]  # orbax's logs
    assert leftovers(ckpt) == [] and rp.Checkpoints(ckpt).steps() == [2, 4]
    full_disk(None)  # space again: the rerun resumes from step 4, exactly
    resumed = fit(ckpt, 8, data, async_save=async_checkpoints)
    straight = fit(tmp_path / "straight", 8, data)
    assert resumed.resumed_from == 4 and rp.Checkpoints(ckpt).steps() == [4, 6, 8]
    np.testing.assert_array_equal(np.asarray(resumed.state["w"]), np.asarray(straight.state["w"]))


def test_a_full_disk_before_any_checkpoint_says_none_and_step_0(tmp_path, full_disk):
    full_disk(tmp_path)
    ckpt = rp.Checkpoints(tmp_path, async_save=True)
    ckpt.save(1, {"w": np.ones((3, 1), np.float32)})  # returns; the write fails meanwhile
    with pytest.raises(
        rp.CheckpointWriteError,
        match=r"step 1 .*\(newest: none\), so running "
        r"again resumes from step 0\.",
    ):
        ckpt.wait()
    assert leftovers(tmp_path) == [] and ckpt.steps() == []
    ckpt.close()


def test_a_full_disk_in_replicator_train_is_one_line(capsys, tmp_path, full_disk):
    full_disk(tmp_path / "mlp_zero" / "checkpoints", 4)
    argv = ["train", str(CONFIGS / "mlp_zero.yaml"), f"out_dir={tmp_path}", "plot=false",
            "steps=6", "checkpoint_every=2", "model.layers=2", "keep=2"]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    logged, message = err.splitlines(keepends=True)  # step 1's log line, then the error's line
    assert logged.startswith("step      1/6  "), err
    assert message.startswith(
        "replicator train: rp.Checkpoints.save: checkpoint step 4 could not be written to "
    ), err
    assert "(newest: step 2)" in message and "keep=2 now" in message, err


def _can_mount_a_tmpfs():
    probe = "mount -t tmpfs -o size=64k tmpfs /mnt"
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", probe], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow  # a real full disk: replicator train in a subprocess, on a 1.5 MB tmpfs
@pytest.mark.skipif(not _can_mount_a_tmpfs(), reason="needs unshare -rm and a tmpfs mount")
def test_a_really_full_disk_in_replicator_train_is_one_line(tmp_path):
    train = (
        f"mount -t tmpfs -o size=1500k tmpfs /mnt && {sys.executable} -m replicator.cli train "
        f"{CONFIGS / 'mlp_zero.yaml'} out_dir=/mnt steps=30 checkpoint_every=10 log_every=1000 "
        f"plot=false async_checkpoints=true; echo exit=$?; ls -a /mnt/mlp_zero/checkpoints"
    )
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", train], capture_output=True, text=True, timeout=300
    )
    err = run.stderr
    assert "Traceback" not in err and "ERROR" not in err, err[-3000:]
    logged, message = err.splitlines(keepends=True)  # step 1's log line, then the error's line
    assert logged.startswith("step      1/30  "), err
    assert message.startswith("replicator train: rp.Checkpoints.save: "), err
    assert "no space left on device (ENOSPC)" in message and "keep=3 now" in message, err
    assert "exit=1" in run.stdout, run.stdout
    left = run.stdout.split("exit=1")[1].split()
    assert not [n for n in left if "tmp" in n], left  # the partial step was removed


# -- metrics of a run that starts over ------------------------------------------------------


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_run_killed_before_its_first_checkpoint_leaves_each_step_once(tmp_path, checkpoints):
    data = batches(8)
    metrics = tmp_path / "metrics.jsonl"
    directory = tmp_path / "ckpt" if checkpoints else None

    def killed(ctx):
        yield from data[:3]
        raise RuntimeError("killed")  # after step 3, before checkpoint 5

    repl = rp.Replicator()
    with pytest.raises(RuntimeError, match="killed"):
        rp.fit(
            repl,
            linear_step(),
            repl.replicate(LIKE),
            killed,
            steps=8,
            checkpointing=rp.training.CheckpointOptions(directory, every=5)
            if checkpoints
            else None,
            logging=rp.training.LoggingOptions(every=1, metrics_path=metrics, progress=False),
        )
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3]
    again = fit(directory, 8, data, every=5, logging={"metrics_path": metrics})
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert again.resumed_from is None and [r["step"] for r in lines] == list(range(1, 9))
    assert [r["loss"] for r in lines] == [r["loss"] for r in again.history]


# -- checkpoints none of which is readable ---------------------------------------------------


def test_unreadable_checkpoints_stop_fit_and_the_error_names_the_way_out(tmp_path):
    fit(tmp_path, 4, batches(4))  # checkpoints 2 and 4
    for step in (2, 4):
        corrupt_array_file(tmp_path / str(step))
    with (
        pytest.warns(UserWarning, match=r"is unreadable"),
        pytest.raises(
            FileNotFoundError,
            match=r"None was moved .*rp\.fit's CheckpointOptions\("
            r"start_over_if_unreadable=True\) \(replicator train: "
            r"start_over_if_unreadable=true\)",
        ),
    ):
        fit(tmp_path, 8, batches(8))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["2", "4"]


def test_start_over_if_unreadable_moves_them_aside_and_trains_from_step_0(tmp_path):
    data = batches(8)
    fit(tmp_path, 4, data)
    for step in (2, 4):
        corrupt_array_file(tmp_path / str(step))
    with pytest.warns(UserWarning) as caught:
        result = fit(tmp_path, 8, data, start_over_if_unreadable=True)
    text = "\n".join(str(w.message) for w in caught)
    for step in (2, 4):
        aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{step}.broken-")]
        assert len(aside) == 1 and f"moved it aside to {aside[0]}" in text, text
        assert (aside[0] / "state").is_dir()  # kept, not deleted
    assert "no step restores" in text and "starts over from step 0" in text
    straight = fit(tmp_path / "straight", 8, data)
    assert result.resumed_from is None and result.step == 8
    np.testing.assert_array_equal(np.asarray(result.state["w"]), np.asarray(straight.state["w"]))
    assert rp.Checkpoints(tmp_path).steps() == [4, 6, 8]


def test_start_over_if_unreadable_leaves_readable_checkpoints_alone(tmp_path):
    data = batches(8)
    fit(tmp_path, 4, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = fit(tmp_path, 8, data, start_over_if_unreadable=True)
    assert result.resumed_from == 4 and not [p for p in tmp_path.iterdir() if "broken" in p.name]


@pytest.mark.slow  # three short replicator train runs
def test_replicator_train_names_and_takes_start_over_if_unreadable(capsys, tmp_path):
    argv = ["train", str(CONFIGS / "mlp_zero.yaml"), f"out_dir={tmp_path}", "plot=false",
            "steps=2", "checkpoint_every=2", "model.layers=2"]  # fmt: skip
    assert cli.main(argv) == 0
    corrupt_array_file(tmp_path / "mlp_zero" / "checkpoints" / "2")
    capsys.readouterr()
    with pytest.warns(UserWarning, match="is unreadable"):
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "start_over_if_unreadable=true" in err, err
    with pytest.warns(UserWarning) as caught:
        assert cli.main([*argv, "start_over_if_unreadable=true"]) == 0
    assert any("moved it aside" in str(w.message) for w in caught)
    names = os.listdir(tmp_path / "mlp_zero" / "checkpoints")
    assert "2" in names and [n for n in names if n.startswith("2.broken-")], names


# -- emergency checkpoints on SIGTERM -------------------------------------------------------


class SigtermAt:
    """A metric writer that sends this process SIGTERM when ``step`` is logged."""

    def __init__(self, step):
        self.step = step

    def write(self, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self):
        pass


@pytest.mark.parametrize(
    ("emergency_after", "saved"), [(1, [4, 6]), (2, [4, 6]), (3, [4]), (None, [4])]
)
def test_emergency_after_decides_the_save_on_sigterm(tmp_path, capsys, emergency_after, saved):
    data = batches(12)
    result = fit(
        tmp_path,
        12,
        data,
        every=4,
        logging={"writers": [SigtermAt(5)]},
        emergency_after=emergency_after,
    )
    assert result.preempted and result.step == 6  # the signal at step 5's log: stops after 6
    assert rp.Checkpoints(tmp_path).steps() == saved
    err = capsys.readouterr().err
    if saved[-1] == 6:
        assert "rp.fit: stopped by SIGTERM at step 6; checkpoint saved" in err, err
    else:
        assert (
            f"rp.fit: stopped by SIGTERM at step 6; no checkpoint saved (emergency_after="
            f"{emergency_after}; newest: step 4): running again resumes from step 4" in err
        ), err
    resumed = fit(tmp_path, 12, data, every=4)
    straight = fit(tmp_path / "straight", 12, data, every=4)
    assert resumed.resumed_from == saved[-1]
    np.testing.assert_array_equal(np.asarray(resumed.state["w"]), np.asarray(straight.state["w"]))


def test_emergency_after_is_checked_in_fit_and_in_configs(tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(
            ValueError,
            match=r"rp\.training\.CheckpointOptions: emergency_after must be an int >= 1 or "
            r"None",
        ):
            fit(tmp_path, 2, batches(2), emergency_after=bad)
    with pytest.raises(TypeError, match=r"start_over_if_unreadable must be True or False"):
        fit(tmp_path, 2, batches(2), start_over_if_unreadable="yes")
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nemergency_after: null\nstart_over_if_unreadable: true\nkeep: 2\n")
    cfg = config.load(path)
    assert (cfg.emergency_after, cfg.start_over_if_unreadable, cfg.keep) == (None, True, 2)
    assert config.load(path, ["emergency_after=5"]).emergency_after == 5
    for bad in ("emergency_after=0", "keep=0"):
        with pytest.raises(ValueError, match=rf"{bad.split('=')[0]} must be an int >= 1"):
            config.load(path, [bad])
