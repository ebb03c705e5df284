"""Outputs come back whole: a leaf that differs across the stage (or model) axis is concatenated
over it, never cut to one block; what cannot come back whole is refused before the step runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from oracle import rel_err
from test_pipeline import (
    SCHEDULES,
    init_params,
    layer_fn,
    loss_fn,
    make_batch,
    make_repl,
    oracle_loss,
    pipelined_grads,
    to_pipeline,
)

import replicator as rp
from replicator import pipeline
from replicator._src.core import variance

TOL = 1e-5
DP_PP = {"data": 2, "stage": 4}


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.slow  # 3.2 s
def test_stage_gradients_and_stage_params_come_back_whole(name):
    schedule, v = SCHEDULES[name]
    repl = make_repl(DP_PP)
    params = init_params()
    x, t = make_batch(16)
    grads = pipelined_grads(pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=schedule
    ))  # fmt: skip
    traces = []

    def step(state, x, t):
        traces.append(1)
        loss, g = grads(state, x, t)  # per replica: the gradient of its half of the batch
        return state, {
            "loss": rp.all_reduce(loss, "mean"),
            "g_stages": g["stages"],
            "g_head": g["head"],
            "stages": state["stages"],
        }

    state = to_pipeline(params, repl, 4, v)
    want_stages = jax.tree.map(np.asarray, state["stages"])
    for _ in range(2):
        state, out = repl.run(step, state, x, t)
    assert len(traces) == 1

    shapes = [(2, *np.shape(a)) for a in jax.tree.leaves(want_stages)]  # [2, K, Lv, ...]
    assert [np.shape(a) for a in jax.tree.leaves(out["g_stages"])] == shapes
    assert [np.shape(a) for a in jax.tree.leaves(out["stages"])] == shapes
    assert out["loss"].shape == (2,)
    assert out["g_head"]["w"].shape == (2, *params["head"]["w"].shape)
    for r in range(2):
        assert rel_err(jax.tree.map(lambda a, r=r: a[r], out["stages"]), want_stages) == 0
        half = slice(8 * r, 8 * r + 8)
        want = jax.grad(oracle_loss)(params, x[half], t[half])
        got = jax.tree.map(lambda a, r=r: np.asarray(a)[r], out["g_stages"])
        assert rel_err(pipeline.unstack_stages(got, repeats=v), want["layers"]) <= TOL
        assert rel_err(np.asarray(out["g_head"]["w"])[r], want["head"]["w"]) <= TOL
    want_loss = oracle_loss(params, x, t)
    assert rel_err(out["loss"], np.full(2, want_loss)) <= TOL


def test_a_stage_varying_scalar_output_is_refused_before_the_step_runs():
    repl = make_repl(DP_PP)
    w = repl.place(jnp.arange(8.0).reshape(4, 2), pipeline.stage_spec())
    ran = []

    def step(state, x):
        jax.debug.callback(lambda: ran.append(1))
        return state, {"ok": rp.all_reduce(x.sum(), "sum"), "norm": jnp.sum(state["w"] ** 2)}

    with pytest.raises(
        ValueError,
        match=r"Replicator\.run: output \['norm'\] of step_fn .* is a scalar that differs across "
        r"the mesh axis 'stage'.*x\[None\].*one row per stage.*psum\(x, 'stage'\)",
    ):
        repl.run(step, {"w": w}, np.ones(8, np.float32))
    assert not ran
    assert not w.is_deleted()  # refused before anything was donated


def test_a_replicated_state_leaf_made_stage_dependent_is_refused():
    repl = make_repl(DP_PP)
    state = {"count": repl.replicate(jnp.zeros((), jnp.int32)), "b": repl.replicate(jnp.ones(3))}

    def step(state, x):
        s = lax.axis_index("stage")
        return {"count": state["count"] + 1, "b": state["b"] * s}, {}

    with pytest.raises(
        ValueError,
        match=r"Replicator\.run: step_fn .* returned state leaf \['b'\] that differs across the "
        r"mesh axis 'stage', but its sharding P\(\) keeps one copy for all of 'stage'"
        r".*pmean\(x, 'stage'\) from jax\.lax.*leading axis of size 4.*P\('stage'\)",
    ):
        repl.run(step, state, np.ones(8, np.float32))


def test_reduced_outputs_keep_one_row_per_replica_and_varying_ones_get_every_stage():
    repl = make_repl(DP_PP)

    def step(state, x):
        s = lax.axis_index("stage").astype(jnp.float32)
        return (
            state,
            {
                "sum": lax.psum(s, "stage"),  # reduced over stage: (2,)
                "gathered": lax.all_gather(s, "stage"),  # every stage's value on each: (2, 4)
                "row": (x[:1] + s)[:, None] * jnp.ones(3),  # one row per stage: (2, 4, 3)
                "replica": rp.replica_id() + x[:0].sum(),  # differs over data only: (2,)
            },
        )

    _, out = repl.run(step, {}, np.ones(8, np.float32))
    np.testing.assert_array_equal(out["sum"], [6.0, 6.0])
    np.testing.assert_array_equal(out["gathered"], np.tile(np.arange(4.0), (2, 1)))
    np.testing.assert_array_equal(
        out["row"], np.broadcast_to(1 + np.arange(4.0)[:, None], (2, 4, 3))
    )
    np.testing.assert_array_equal(out["replica"], [0, 1])


def test_control_flow_carries_variation_to_the_outputs():
    repl = make_repl(DP_PP)

    def step(state, x):
        s = lax.axis_index("stage")

        def body(carry, _):  # the stage index reaches `a` only on the second iteration
            _, b = carry
            return (b, s.astype(jnp.float32) * jnp.ones(2)), None

        (a, _), _ = lax.scan(body, (jnp.zeros(2), jnp.zeros(2)), None, length=3)
        picked = lax.cond(s == 3, lambda: jnp.ones(2), lambda: jnp.zeros(2))
        counted = lax.while_loop(lambda c: c[0] < s, lambda c: (c[0] + 1, c[1] + 1.0), (0, 0.0))
        return state, {"a": a, "picked": picked, "counted": counted[1][None]}

    _, out = repl.run(step, {}, np.ones(8, np.float32))
    np.testing.assert_array_equal(out["a"], np.tile(np.repeat(np.arange(4.0), 2), (2, 1)))
    np.testing.assert_array_equal(out["picked"], np.tile([0, 0, 0, 0, 0, 0, 1, 1.0], (2, 1)))
    np.testing.assert_array_equal(out["counted"], np.tile(np.arange(4.0), (2, 1)))


def test_stage_blocks_are_concatenated_and_model_leaves_come_back_whole():
    """`stage` is mapped by hand: a stage-varying output is concatenated over it. `model` is
    left to XLA: step_fn sees whole values along it, and they come back whole."""
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 2, "model": 2})
    w = jax.device_put(
        np.arange(8.0, dtype=np.float32).reshape(2, 4),
        NamedSharding(repl.mesh, PartitionSpec("stage", "model")),
    )

    def step(state, x):
        assert state["w"].shape == (1, 4)  # its stage's row, whole along `model`
        return state, {"w": state["w"], "w_sum": state["w"].sum(axis=1) + x[:0].sum()}

    whole = np.asarray(w)
    _, out = repl.run(step, {"w": w}, np.ones(8, np.float32))
    np.testing.assert_array_equal(out["w"], np.stack([whole] * 2))
    np.testing.assert_array_equal(out["w_sum"], np.tile([6.0, 22.0], (2, 1)))


def test_the_loop_and_the_lowered_program_agree_with_run():
    repl = make_repl(DP_PP)
    w = repl.place(jnp.arange(8.0).reshape(4, 2), pipeline.stage_spec())
    step = lambda state, x: (state, {"w": state["w"] * x.sum()})
    lowered = repl.lower(step, {"w": w}, np.ones(8, np.float32))
    assert lowered.out_info[1]["w"].shape == (2, 4, 2)
    _, out = repl.run(step, {"w": w}, np.ones(8, np.float32))
    np.testing.assert_array_equal(out["w"], np.stack([4 * np.arange(8.0).reshape(4, 2)] * 2))


def test_circular_stage_params_come_back_stage_major_along_the_first_axis():
    """Circular's [V, K, ...] params are placed P(None, "stage"): each stage's [V, 1, ...] block
    is concatenated along the first axis, so stage s, repeat r is row s * V + r."""
    v = SCHEDULES["circular"][1]
    repl = make_repl(DP_PP)
    state = to_pipeline(init_params(), repl, 4, v)
    want = np.asarray(state["stages"]["w"])  # [V=2, K=4, Lv=2, D, D]
    _, out = repl.run(lambda s, x: (s, {"w": s["stages"]["w"]}), state, np.ones(8, np.float32))
    assert out["w"].shape == (2, 4 * v, 1, *want.shape[2:])
    got = np.asarray(out["w"]).reshape(2, 4, v, *want.shape[2:]).swapaxes(1, 2)
    np.testing.assert_array_equal(got, np.stack([want] * 2))


def test_the_analysis_follows_calls_and_takes_the_unknown_as_varying():
    @jax.custom_vjp
    def twice(x):
        return 2 * x

    twice.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))

    def f(x, w):
        s = lax.axis_index("stage")
        host = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct((), jnp.float32), x)
        return (
            jax.jit(lambda a: a * 3)(x),  # equal: a call on an equal input
            jax.checkpoint(lambda a: a + s)(x),  # varies inside the checkpoint
            twice(w),  # w is split over stage
            lax.psum(w, "data"),  # a reduction over data keeps the stage variation
            lax.pmax(w, ("data", "stage")),
            host,  # a host callback may differ anywhere
            lax.ppermute(x, "stage", [(0, 1), (1, 0)]),
            jnp.sum(lax.all_gather(w, "stage")),
        )

    closed = jax.make_jaxpr(f, axis_env=[("data", 2), ("stage", 2)])(jnp.float32(1), jnp.ones(2))
    got = variance.varying_axes(closed, [frozenset(), frozenset({"stage"})], ["stage"])
    stage = frozenset({"stage"})
    assert got == [frozenset(), stage, stage, stage, frozenset(), stage, stage, frozenset()]
