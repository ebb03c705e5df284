"""rp.Checkpoints(async_save=True): save returns before the files are written, and keeps every
guarantee of a synchronous save (complete-or-absent steps, keep-n, exact restore)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
        "opt": {
            "mu": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
            "count": jnp.int32(seed),
        },
    }


def test_an_async_save_is_a_snapshot_even_if_the_buffers_are_donated_right_after(tmp_path):
    ckpt = rp.Checkpoints(tmp_path, keep=2, async_save=True)
    saved = state(1)
    want = jax.tree.map(np.asarray, saved)
    ckpt.save(10, saved, data_position=40)
    for leaf in jax.tree.leaves(saved):  # what repl.run(..., donate) does to the old state
        leaf.delete()
    got, record = ckpt.restore(state(0))
    assert record == {"step": 10, "data_position": 40}
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.tree.map(np.asarray, got), want))
    ckpt.close()


def test_async_saves_in_a_row_keep_the_newest_and_restore_exactly(tmp_path):
    ckpt = rp.Checkpoints(tmp_path, keep=2, async_save=True)
    for step in (1, 2, 3, 4):
        ckpt.save(step, state(step))
    assert ckpt.steps() == [3, 4]  # waits for the write in progress
    got, record = ckpt.restore(state(0))
    assert record["step"] == 4
    assert np.array_equal(got["w"], state(4)["w"]) and int(got["opt"]["count"]) == 4
    got, _ = ckpt.restore(state(0), step=3)
    assert np.array_equal(got["opt"]["mu"], state(3)["opt"]["mu"])
    ckpt.close()
    again = rp.Checkpoints(tmp_path, keep=2)  # a synchronous reader sees the same steps
    assert again.steps() == [3, 4]
    again.close()


def test_async_save_must_be_a_bool(tmp_path):
    with pytest.raises(
        TypeError, match=r"rp.Checkpoints: async_save must be True or False; got 'yes'"
    ):
        rp.Checkpoints(tmp_path, async_save="yes")


def test_fit_with_async_checkpoints_saves_every_step_it_says_and_resumes_exactly(tmp_path):
    from oracle import OPTIMIZERS, batches, mlp_state, mlp_step

    data = batches(10)
    repl = rp.Replicator()

    def input_fn(ctx):
        yield from data

    def fresh():
        return repl.replicate(mlp_state(repl.wrap_optimizer(OPTIMIZERS["adam"]())))

    logging = rp.training.LoggingOptions(progress=False)
    straight = rp.fit(repl, mlp_step, fresh(), input_fn, steps=10, logging=logging)
    options = dict(
        checkpointing=rp.training.CheckpointOptions(tmp_path, every=2, async_save=True),
        logging=logging,
    )
    first = rp.fit(repl, mlp_step, fresh(), input_fn, steps=6, **options)
    assert first.step == 6 and rp.Checkpoints(tmp_path).steps() == [2, 4, 6]  # written on return
    second = rp.fit(repl, mlp_step, fresh(), input_fn, steps=10, **options)
    assert second.resumed_from == 6 and rp.Checkpoints(tmp_path).steps() == [6, 8, 10]
    for got, want in zip(
        jax.tree.leaves(second.state.params), jax.tree.leaves(straight.state.params)
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fit_refuses_an_async_save_that_is_not_a_bool(tmp_path):
    with pytest.raises(
        TypeError, match=r"rp.training.CheckpointOptions: async_save must be True or False; got"
    ):
        rp.training.CheckpointOptions(tmp_path, async_save="yes")
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            TypeError, match=r"rp.fit: async_checkpoints must be True or False; got 'yes'"
        ),
    ):
        rp.fit(None, None, None, None, steps=1, checkpoint_dir=tmp_path, async_checkpoints="yes")
