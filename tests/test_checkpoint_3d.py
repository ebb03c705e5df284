"""Checkpoints of a 3-D (data x stage x model) state: saved on one layout, restored onto another
and trained on equal to one device; the errors of specs and checkpoints that do not fit a mesh."""

import warnings

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from oracle import rel_err
from test_pipeline import (
    from_pipeline,
    init_params,
    layer_fn,
    loss_fn,
    make_batch,
    oracle_loss,
    pipelined_grads,
)
from test_tensor_parallel import make_repl, tp_stage_specs, train_oracle

import replicator as rp
from replicator import pipeline

TOL = 1e-5
MESH_3D = {"data": 2, "stage": 2, "model": 2}
MESH_2D = {"data": 4, "stage": 2}
BATCHES = [make_batch(16, seed=20 + i) for i in range(4)]


def adam():
    return optax.adam(1e-2)


def trainer(repl):
    """``(step, place)`` for one mesh: a one-replica 1F1B step with Adam, and the placement a
    user writes once for every mesh (stage layers over `stage`, their last dimension over
    `model`; `place` drops the axes a mesh lacks)."""
    wrapped = repl.wrap_optimizer(adam())
    grads = pipelined_grads(pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=pipeline.OneFOneB()
    ))  # fmt: skip

    def step(state, x, t):
        loss, g = grads(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    def place(params):
        stacked = pipeline.stack_stages(params["layers"], num_stages=2)
        placed = {
            "embed": repl.replicate(params["embed"]),
            "stages": repl.place(stacked, tp_stage_specs(stacked, 1)),
            "head": repl.replicate(params["head"]),
        }
        return {"params": placed, "opt": wrapped.init(placed)}

    return step, place


def train(repl, step, state, batches):
    for x, t in batches:
        state, _ = repl.run(step, state, x, t)
    return state


@pytest.mark.parametrize(
    "before,after", [(MESH_3D, MESH_2D), (MESH_2D, MESH_3D)], ids=["3d_to_2d", "2d_to_3d"]
)
@pytest.mark.slow
def test_a_3d_adam_state_restores_onto_another_layout_and_trains_on_as_one_device(
    tmp_path, before, after
):
    """Two Adam steps on one layout, saved; restored onto the other (the `like` built there as
    on any mesh, from fresh parameters), two more steps: equal to four steps on one device."""
    params = init_params()
    repl = make_repl(before)
    step, place = trainer(repl)
    state = train(repl, step, place(params), BATCHES[:2])
    rp.Checkpoints(tmp_path).save(2, state, data_position=2)
    saved = from_pipeline(state["params"], 1)
    del state

    repl = make_repl(after)
    step, place = trainer(repl)
    like = place(init_params(seed=5))  # any values: only the structure and shardings count
    restored, record = rp.Checkpoints(tmp_path).restore(like)
    assert record == {"step": 2, "data_position": 2}
    assert rel_err(from_pipeline(restored["params"], 1), saved) == 0.0
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        assert got.sharding == want.sharding
    # Adam's moments of the stage layers follow them: over `model` too where there is one.
    split = 2 if "model" in after else 1
    mu = restored["opt"][0].mu["stages"]["w"]
    assert {s.data.shape for s in mu.addressable_shards} == {(1, 8, 8, 8 // split)}
    state = train(repl, step, restored, BATCHES[record["data_position"] :])

    want = train_oracle(oracle_loss, params, adam(), BATCHES)
    assert rel_err(from_pipeline(state["params"], 1), want) <= TOL
    assert rel_err(from_pipeline(state["params"], 1), saved) > 1e-3  # the last steps moved it
    w = state["params"]["stages"]["w"]
    assert {s.data.shape[-1] for s in w.addressable_shards} == {w.shape[-1] // split}


def test_a_spec_naming_an_axis_no_mesh_has_is_refused_with_the_fix():
    """A typo in a tree of specs on the 3-D mesh: refused by `place`, before any step, with
    the axis meant."""
    repl = make_repl(MESH_3D)
    stacked = pipeline.stack_stages(init_params()["layers"], num_stages=2)
    specs = {"w": P("stage", None, None, "modle"), "b": P("stage", None, "model")}
    with pytest.raises(
        ValueError,
        match=r"Replicator\.place: spec P\('stage', None, None, 'modle'\) names axis 'modle', "
        r"which is not an axis of this mesh \(\{'data': 2, 'stage': 2, 'model': 2\}.*"
        r"\(did you mean 'model'\?\)",
    ):
        repl.place(stacked, specs)


def test_a_stage_dimension_that_does_not_divide_over_model_is_refused_with_the_fix():
    """A stage's layers whose last dimension (7) does not split over `model` (2): refused by
    `place` on the 3-D mesh, naming the leaf and a size that would."""
    repl = make_repl(MESH_3D)
    layers = {**init_params()["layers"], "b": np.ones((16, 7), np.float32)}
    stacked = pipeline.stack_stages(layers, num_stages=2)
    with pytest.raises(
        ValueError,
        match=r"Replicator\.place: leaf \['b'\] of shape \[2, 8, 7\] cannot be split by "
        r"P\('stage', None, 'model'\): dimension 2 has size 7, which does not divide over 2 "
        r"devices of 'model'\. Use a size that is a multiple of 2 \(e\.g\. 8\), or leave that "
        r"dimension whole \(None in the spec\)\.",
    ):
        repl.place(stacked, tp_stage_specs(stacked, 1))


def test_a_checkpoint_leaf_that_does_not_divide_over_the_new_mesh_is_refused_with_the_fix(
    tmp_path,
):
    """Hidden units of 6 split over `model` = 2, restored into a `like` of
    ``jax.ShapeDtypeStruct``s (no memory used) split over `model` = 4: refused before any step
    is read, naming the leaf and the fix; no step is taken for broken, none is moved."""
    repl = make_repl(MESH_3D)
    stages = {"w": np.ones((2, 8, 6), np.float32), "b": np.ones((2, 6), np.float32)}
    specs = {"w": P("stage", None, "model"), "b": P("stage", "model")}
    ckpt = rp.Checkpoints(tmp_path)
    for step in (1, 2):
        ckpt.save(step, repl.place(stages, specs))

    mesh = make_repl({"data": 2, "model": 4}).mesh
    like = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        stages,
        {"w": P(None, None, "model"), "b": P(None, "model")},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "unreadable", no fallback to step 1
        with pytest.raises(
            ValueError,
            match=r"rp\.Checkpoints\.restore: leaf \['b'\] of shape \[2, 6\] cannot be restored "
            r"with P\(None, 'model'\) on this mesh \(\{'data': 2, 'model': 4\}\): dimension 1 "
            r"has size 6, which does not divide over 4 devices of 'model'\. Nothing was read "
            r"\(the checkpoints are fine\)\. .*leave the dimension whole \(None in the spec\)",
        ):
            ckpt.restore(like)
    assert ckpt.steps() == [1, 2]
    # Whole over `model`, the same leaves restore onto that mesh.
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
        stages,
    )
    restored, record = ckpt.restore(like)
    assert record["step"] == 2 and rel_err(restored, stages) == 0.0
