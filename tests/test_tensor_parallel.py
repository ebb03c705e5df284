"""Tensor parallelism on the `model` axis: a one-replica step_fn on model-sharded parameters
equals one device, alone (DP x TP), under a pipeline (DP x PP x TP) and with ZeRO."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from oracle import rel_err
from test_pipeline import (
    SCHEDULES,
    from_pipeline,
    init_params,
    layer_fn,
    loss_fn,
    make_batch,
    oracle_loss,
    pipelined_grads,
)

import replicator as rp
from replicator import pipeline

TOL = 1e-5
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
D_IN, HIDDEN, D_OUT = 12, 32, 6

# The Megatron layout of a two-layer MLP: the first weight split by columns (its hidden units),
# the second by rows; each device holds 1/T of the hidden units.
MLP_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(size=(D_IN, HIDDEN)).astype(np.float32) / np.sqrt(D_IN),
        "b1": 0.1 * rng.normal(size=(HIDDEN,)).astype(np.float32),
        "w2": rng.normal(size=(HIDDEN, D_OUT)).astype(np.float32) / np.sqrt(HIDDEN),
        "b2": 0.1 * rng.normal(size=(D_OUT,)).astype(np.float32),
    }


def mlp_loss(p, x, t):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - t) ** 2)


def mlp_batch(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D_IN)).astype(np.float32)
    return x, np.cos(x[:, :D_OUT]) + 0.1 * rng.normal(size=(n, D_OUT)).astype(np.float32)


def make_repl(mesh_shape):
    n = int(np.prod(list(mesh_shape.values())))
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


def train_oracle(loss, params, tx, batches):
    opt = tx.init(params)
    for x, t in batches:
        updates, opt = tx.update(jax.grad(loss)(params, x, t), opt, params)
        params = optax.apply_updates(params, updates)
    return params


def train_mlp(repl, wrapped, tx, traces=None):
    """Three steps of the Megatron MLP on ``repl`` with ``wrapped``, and the one-device oracle:
    ``(state, last outputs, initial params, oracle params)``."""

    def step(state, x, t):
        if traces is not None:
            traces.append(1)
        loss, grads = jax.value_and_grad(mlp_loss)(state["params"], x, t)
        updates, opt_state = wrapped.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt_state}, {"loss": rp.all_reduce(loss, "mean")}

    params = mlp_params()
    placed = repl.place(params, MLP_SPECS)
    state = {"params": placed, "opt": wrapped.init(placed)}
    batches = [mlp_batch(16, seed=10 + i) for i in range(3)]
    for x, t in batches:
        state, out = repl.run(step, state, x, t)
    return state, out, params, train_oracle(mlp_loss, params, tx, batches)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_dp_x_tp_trains_as_one_device(opt):
    """{"data": 2, "model": 4}: step_fn is one replica's, written as for one device; the
    parameters stay split over `model` (1/4 per device) and training equals one device."""
    repl = make_repl({"data": 2, "model": 4})
    tx = OPTIMIZERS[opt]()
    traces = []
    state, out, params, want = train_mlp(repl, repl.wrap_optimizer(tx), tx, traces)
    got = jax.tree.map(np.asarray, state["params"])
    assert rel_err(got, want) <= TOL
    assert rel_err(got, params) > 1e-2  # training moved them
    assert len(traces) == 1
    w1 = state["params"]["w1"]
    assert w1.sharding.spec == P(None, "model")
    assert {s.data.shape for s in w1.addressable_shards} == {(D_IN, HIDDEN // 4)}
    assert out["loss"].shape == (2,)


def tp_stage_specs(stacked, v):
    """`pipeline.stage_spec`, plus the layers' last dimension split over `model`."""
    base = tuple(pipeline.stage_spec(v))
    return jax.tree.map(lambda a: P(*base, *([None] * (a.ndim - len(base) - 1)), "model"), stacked)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_dp_x_pp_x_tp_trains_as_one_device(name):
    """{"data": 2, "stage": 2, "model": 2} with every schedule: stage layers split over `stage`
    and, inside each stage, over `model`; three SGD steps equal one device."""
    schedule, v = SCHEDULES[name]
    repl = make_repl({"data": 2, "stage": 2, "model": 2})
    tx = optax.sgd(0.1)
    wrapped = repl.wrap_optimizer(tx)
    grads = pipelined_grads(pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=schedule
    ))  # fmt: skip

    def step(state, x, t):
        loss, g = grads(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    params = init_params()
    stacked = pipeline.stack_stages(params["layers"], num_stages=2, repeats=v)
    placed = {
        "embed": repl.replicate(params["embed"]),
        "stages": repl.place(stacked, tp_stage_specs(stacked, v)),
        "head": repl.replicate(params["head"]),
    }
    state = {"params": placed, "opt": wrapped.init(placed)}
    batches = [make_batch(16, seed=10 + i) for i in range(3)]
    for x, t in batches:
        state, _ = repl.run(step, state, x, t)
    want = train_oracle(oracle_loss, params, tx, batches)
    assert rel_err(from_pipeline(state["params"], v), want) <= TOL
    w = state["params"]["stages"]["w"]
    assert w.sharding.spec[-1] == "model"
    assert {s.data.shape[-1] for s in w.addressable_shards} == {w.shape[-1] // 2}


def test_explain_reports_the_model_axis_collectives():
    """XLA's own all-reduces over `model` (Megatron's: the row-split layer's output, and its
    input's gradient) show in `explain`, apart from the gradient mean over `data`."""
    repl = make_repl({"data": 2, "model": 4})
    wrapped = repl.wrap_optimizer(optax.sgd(0.1))

    def step(state, x, t):
        params, opt = state
        grads = jax.grad(mlp_loss)(params, x, t)
        updates, opt = wrapped.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {}

    params = repl.place(mlp_params(), MLP_SPECS)
    report = repl.explain(step, (params, wrapped.init(params)), *mlp_batch(16, seed=1))
    by_axes = {c.axes: c for c in report.collectives if c.kind == "all-reduce"}
    assert ("model",) in by_axes, report.collectives
    assert ("data",) in by_axes, report.collectives
    assert by_axes[("model",)].bytes > 0


def test_specs_that_do_not_fit_are_refused_with_the_fix():
    repl = make_repl({"data": 2, "model": 4})
    params = mlp_params()
    with pytest.raises(ValueError, match=r"Replicator\.place: leaf \['w1'\] of shape \[12, 30\] "
                       r"cannot be split by .*dimension 1 has size 30, which does not divide "
                       r"over 4 devices of 'model'.*multiple of 4 \(e\.g\. 32\)"):  # fmt: skip
        repl.place({**params, "w1": np.ones((D_IN, 30), np.float32)}, MLP_SPECS)
    with pytest.raises(ValueError, match=r"Replicator\.place: the tree of specs must have the "):
        repl.place(params, {"w1": P(None, "model")})
    with pytest.raises(ValueError, match=r"Replicator\.place: .*'modle'"):
        repl.place(params, {**MLP_SPECS, "b1": P("modle")})
