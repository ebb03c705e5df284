"""rp.Checkpoints: exact resume, keeping the newest, fallback from a broken checkpoint, and
restoring onto another mesh."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from oracle import (
    OPTIMIZERS,
    batches,
    mlp_state,
    mlp_step,
    rel_err,
    single_device,
    zero3_loss,
    zero3_params,
)

import replicator as rp


def train(repl, state, data):
    for batch in data:
        state, _ = repl.run(mlp_step, state, batch)
    return state


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    repl = rp.Replicator()
    data = batches()
    tx = repl.wrap_optimizer(OPTIMIZERS["adam"]())
    straight = train(repl, repl.replicate(mlp_state(tx)), data)

    ckpt = rp.Checkpoints(tmp_path, keep=2)
    state = train(repl, repl.replicate(mlp_state(tx)), data[:4])
    ckpt.save(4, state, data_position=4)
    del state  # as if the process had died here
    like = repl.replicate(mlp_state(tx))
    restored, record = rp.Checkpoints(tmp_path).restore(like)
    assert record == {"step": 4, "data_position": 4}
    assert restored.params[0]["w"].sharding == like.params[0]["w"].sharding
    resumed = train(repl, restored, data[record["data_position"] :])
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keeps_the_newest_and_falls_back_from_a_broken_one(tmp_path):
    ckpt = rp.Checkpoints(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": np.full(4, float(step), np.float32)})
    assert ckpt.steps() == [2, 3]
    # An interrupted save leaves a temporary directory: it is never taken for a checkpoint.
    (tmp_path / "4.orbax-checkpoint-tmp-1234").mkdir()
    assert rp.Checkpoints(tmp_path, keep=2).steps() == [2, 3]
    # Break the newest: its array data disappears.
    for path in sorted(Path(tmp_path, "3", "state").rglob("*")):
        if path.is_file() and "metadata" not in path.name:
            path.write_bytes(b"")
    ckpt = rp.Checkpoints(tmp_path, keep=2)
    with pytest.warns(UserWarning) as caught:
        state, record = ckpt.restore({"w": np.zeros(4, np.float32)})
    assert record["step"] == 2 and state["w"].tolist() == [2.0] * 4
    # The warning says what was wrong and where the broken step went: moved aside, not deleted.
    text = "\n".join(str(w.message) for w in caught)
    assert re.search(r"checkpoint step 3 .* is unreadable \(\w+(Error|Exception)\w*: .+\)", text)
    (aside,) = [p for p in os.listdir(tmp_path) if p.startswith("3.broken-")]
    assert f"moved it aside to {tmp_path / aside} (kept, not deleted)" in text
    assert os.path.isdir(tmp_path / aside / "state") and ckpt.steps() == [2]
    ckpt.save(3, state)  # the run can save step 3 again
    assert ckpt.steps() == [2, 3] and rp.Checkpoints(tmp_path).steps() == [2, 3]
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in"):
        rp.Checkpoints(os.path.join(tmp_path, "empty")).restore({"w": np.zeros(4)})


def test_saved_on_8_devices_restores_on_4_and_training_goes_on(tmp_path):
    data = batches()
    repl8 = rp.Replicator()
    tx8 = repl8.wrap_optimizer(OPTIMIZERS["sgd"]())
    state = train(repl8, repl8.replicate(mlp_state(tx8)), data[:5])
    rp.Checkpoints(tmp_path).save(5, state, data_position=5)

    repl4 = rp.Replicator(devices=jax.devices()[:4])
    tx4 = repl4.wrap_optimizer(OPTIMIZERS["sgd"]())
    restored, record = rp.Checkpoints(tmp_path).restore(repl4.replicate(mlp_state(tx4)))
    assert {d.id for d in restored.params[0]["w"].sharding.device_set} == {0, 1, 2, 3}
    resumed = train(repl4, restored, data[record["data_position"] :])
    oracle, _ = single_device("mlp", OPTIMIZERS["sgd"](), data)
    assert rel_err(resumed.params, oracle.params) <= 1e-5


def run_worker(devices, root, steps):
    worker = Path(__file__).parent / "workers" / "reshard_run.py"
    result = subprocess.run(
        [sys.executable, str(worker), str(devices), str(root), str(steps)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {
        line.split()[0]: dict(kv.split("=") for kv in line.split()[1:])
        for line in result.stdout.splitlines()
    }


RUNS = {"dp_sgd": (0, "sgd"), "zero1_adam": (1, "adam"), "zero3_sgd": (3, "sgd")}
RUNS["zero3_adam"] = (3, "adam")


@pytest.mark.slow
def test_states_saved_on_8_devices_train_on_from_4_equal_to_the_oracle(tmp_path):
    first = run_worker(8, tmp_path, 3)
    second = run_worker(4, tmp_path, 6)
    data = batches(8, din=16, dout=4)
    for name, (_, opt) in RUNS.items():
        assert first[name]["resumed_from"] == "None" and second[name]["resumed_from"] == "3"
        tx = OPTIMIZERS[opt]()
        want, opt_state = zero3_params(), tx.init(zero3_params())
        for batch in data[:6]:
            updates, opt_state = tx.update(jax.grad(zero3_loss)(want, batch), opt_state, want)
            want = optax.apply_updates(want, updates)
        saved = np.load(tmp_path / f"{name}.npz")
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        assert rel_err(got, jax.tree.leaves(want)) <= 1e-5, name
        assert rel_err(got, jax.tree.leaves(zero3_params())) > 1e-3, name
    # ZeRO keeps every leaf in its own shape: the same arrays on 8 devices and on 4, split over
    # the replicas on both (the head's bias [4] is whole on 8, split on 4).
    for name in RUNS:
        assert first[name]["shapes"] == second[name]["shapes"], name
    for name, on8, on4 in [("zero1_adam", 8, 10), ("zero3_sgd", 4, 5), ("zero3_adam", 12, 15)]:
        assert (int(first[name]["split"]), int(second[name]["split"])) == (on8, on4), name


def test_a_state_of_another_shape_is_an_error_not_a_fallback(tmp_path):
    repl = rp.Replicator()
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(1, {"w": repl.replicate(np.ones(16, np.float32))})
    ckpt.save(2, {"w": repl.replicate(np.ones(16, np.float32))})
    with pytest.raises(rp.StateMismatchError, match=r"leaf \['w'\] of checkpoint step 2 has shape"):
        ckpt.restore({"w": repl.replicate(np.ones(12, np.float32))})
    # Split 8 ways, a length of 24 holds 17..24 true elements; the saved 16 (unsplit) cannot.
    sharded = repl.place(np.ones(24, np.float32), jax.sharding.PartitionSpec("data"))
    with pytest.raises(rp.StateMismatchError):
        ckpt.restore({"w": sharded})


def test_a_state_of_another_structure_names_the_leaves_and_warns_of_nothing(tmp_path):
    repl = rp.Replicator()
    rng = np.random.default_rng(0)
    saved = {"params": {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)}}
    saved = repl.replicate(jax.tree.map(lambda x: x.astype(np.float32), saved))
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(1, saved)
    ckpt.save(2, saved)
    # An EMA added and the bias removed: the checkpoints are fine, the state changed.
    like = {"params": {"w": saved["params"]["w"]}, "ema": {"w": saved["params"]["w"]}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "unreadable", no fallback to step 1
        with pytest.raises(rp.StateMismatchError) as caught:
            ckpt.restore(like)
    message = str(caught.value)
    assert "Checkpoints.restore" in message and "checkpoint step 2" in message
    assert "Added (in the state, not in the checkpoint): ['ema']['w']\n" in message
    assert "Missing (in the checkpoint, not in the state): ['params']['b']\n" in message
    assert "['params']['w']" not in message  # a leaf both have is not named
    assert (
        "Restore into the structure that was saved" in message and "new checkpoint_dir" in message
    )
    # The checkpoints were left alone: they restore into the structure that saved them.
    restored, record = ckpt.restore(repl.replicate(jax.tree.map(np.zeros_like, saved)))
    assert record["step"] == 2 and ckpt.steps() == [1, 2]
    assert rel_err(restored, saved) == 0.0


def test_a_state_of_another_dtype_is_an_error_not_a_cast(tmp_path):
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(1, {"w": np.full(4, 1.1, np.float32), "b": np.ones(2, np.float32)})
    like = {"w": jax.numpy.zeros(4, jax.numpy.bfloat16), "b": np.zeros(2, np.float32)}
    with pytest.raises(
        rp.StateMismatchError,
        match=r"leaf \['w'\] of checkpoint step 1 is float32, but .* bfloat16.*cast=True",
    ):
        ckpt.restore(like)
    state, _ = ckpt.restore(like, cast=True)  # asked for: cast
    assert state["w"].dtype == jax.numpy.bfloat16
    np.testing.assert_allclose(np.asarray(state["w"], np.float32), 1.1, rtol=1e-2)


def test_saving_a_donated_state_is_a_clear_error_and_writes_nothing(tmp_path):
    repl = rp.Replicator()
    state = repl.replicate({"params": {"w": np.ones((16, 2), np.float32)}})
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(1, state)
    new_state, _ = repl.run(lambda s, x: (s, {}), state, np.ones(8, np.float32))  # donates state
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"Checkpoints\.save: state leaf \['params'\]\['w'\] was donated .* the state that "
        r"repl\.run returned .*Replicator\(donate=False\)",
    ):
        ckpt.save(2, state)
    assert ckpt.steps() == [1] and sorted(os.listdir(tmp_path)) == before
    ckpt.save(2, new_state)
    assert ckpt.steps() == [1, 2]
