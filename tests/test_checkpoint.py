"""rp.Checkpoints: exact resume, keeping the newest, fallback from a broken checkpoint, and
restoring onto another mesh."""

import os
from pathlib import Path

import jax
import numpy as np
import pytest
from oracle import OPTIMIZERS, batches, mlp_state, mlp_step, rel_err, single_device

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
    with pytest.warns(UserWarning, match=r"checkpoint step 3 .* is unreadable"):
        state, record = rp.Checkpoints(tmp_path).restore({"w": np.zeros(4, np.float32)})
    assert record["step"] == 2 and state["w"].tolist() == [2.0] * 4
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
