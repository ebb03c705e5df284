"""Hybrid ZeRO (`wrap_optimizer(zero_axes=("data",))`): the state, and with ZeRO-3 the
parameters, split over ``data`` inside each slice and whole on every index of ``dcn_data``;
the slice axis emulated as an ordinary mesh axis, ``{dcn_data: 2, data: 4}`` on 8 CPU devices.
Three SGD steps with momentum equal one device with the whole batch."""

import dataclasses

import jax
import pytest
from oracle import rel_err
from test_cli_gpt_layouts import build_and_train, gpt_job, one_device

import replicator as rp

MESH = {"dcn_data": 2, "data": 4}
TOL = 1e-5


def spec_axes(spec) -> set:
    return {a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))}


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_hybrid_zero_equals_one_device(zero_stage):
    want = one_device("sgd")
    job = dataclasses.replace(gpt_job(MESH, zero_stage=zero_stage), zero_axes=["data"])
    if zero_stage == 2:
        job = dataclasses.replace(job, accumulate_steps=2)
    state, got = build_and_train(job)
    assert rel_err(got, want) <= TOL
    # every part is split over `data` alone: whole on each slice
    leaves = jax.tree.leaves(state["job"]["opt"])
    if zero_stage == 3:
        leaves += jax.tree.leaves(state["job"]["params"])
    split = [x for x in leaves if x.ndim and "data" in spec_axes(x.sharding.spec)]
    assert split, "nothing is split over data"
    assert not any("dcn_data" in spec_axes(x.sharding.spec) for x in leaves)


@pytest.mark.slow  # two gpt jobs
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_hybrid_zero_with_bf16_gradients_is_within_bf16_of_one_device(zero_stage):
    """``model.reduce_dtype: bfloat16`` below ZeRO-3 sends the reduce-scatter inside each slice
    and the mean across the slices in bf16: within bf16's rounding of one device, and not its
    fp32 result (the option is in effect)."""
    want = one_device("sgd")
    job = gpt_job(MESH, zero_stage=zero_stage, reduce_dtype="bfloat16")
    job = dataclasses.replace(job, zero_axes=["data"], accumulate_steps=zero_stage)
    _, got = build_and_train(job)
    assert 1e-6 < rel_err(got, want) <= 1e-2


@pytest.mark.slow  # two gpt jobs
def test_hybrid_zero3_sends_its_mean_across_slices_in_the_reduce_dtype():
    """bf16 compute with ``model.reduce_dtype: bfloat16``: ZeRO-3's gathers and scatters, and
    the parts' mean across the slices (the optimizer's ``grad_dtype``), in bf16; within bf16's
    rounding of the same job in fp32 reductions, and not equal to it."""
    base = dataclasses.replace(gpt_job(MESH, zero_stage=3, dtype="bfloat16"), zero_axes=["data"])
    narrow = gpt_job(MESH, zero_stage=3, dtype="bfloat16", reduce_dtype="bfloat16")
    _, want = build_and_train(base)
    _, got = build_and_train(dataclasses.replace(narrow, zero_axes=["data"]))
    assert 1e-6 < rel_err(got, want) <= 1e-2


def test_zero_axes_are_refused_where_they_cannot_hold():
    repl = rp.Replicator(mesh_shape=MESH)
    import optax

    with pytest.raises(ValueError, match="zero_stage=1, 2 or 3"):
        repl.wrap_optimizer(optax.sgd(0.1), zero_axes=("data",))
    with pytest.raises(ValueError, match="some, not all"):
        repl.wrap_optimizer(optax.sgd(0.1), zero_stage=1, zero_axes=("dcn_data", "data"))
    with pytest.raises(ValueError, match="some, not all"):
        repl.wrap_optimizer(optax.sgd(0.1), zero_stage=1, zero_axes=("model",))
    with pytest.raises(TypeError, match="tuple of mesh axis names"):
        repl.wrap_optimizer(optax.sgd(0.1), zero_stage=1, zero_axes="data")
    staged = rp.Replicator(mesh_shape={"dcn_data": 2, "data": 2, "stage": 2})
    with pytest.raises(ValueError, match="pipeline"):
        staged.wrap_optimizer(optax.sgd(0.1), zero_stage=1, zero_axes=("data",))
    with pytest.raises(ValueError, match="set zero_stage"):
        dataclasses.replace(gpt_job(MESH), zero_axes=["data"])
    with pytest.raises(ValueError, match="list of replica axes"):
        dataclasses.replace(gpt_job(MESH, zero_stage=1), zero_axes=["model"])
