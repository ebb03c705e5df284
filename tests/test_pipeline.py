"""Pipeline engine: every schedule against the single-device sequential oracle, DP x PP training,
the sequential meaning without a stage axis, and the validation errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cases import pairwise
from jax.sharding import NamedSharding
from oracle import rel_err

import replicator as rp
from replicator import pipeline

D_IN, D, D_OUT = 5, 8, 3
LAYERS = 16  # splits into K=4 stages x V=2 repeats x 2 layers
TOL = 1e-5

SCHEDULES = {
    "gpipe": (pipeline.GPipe(), 1),
    "circular": (pipeline.Circular(repeats=2), 2),
    "1f1b": (pipeline.OneFOneB(), 1),
    "interleaved": (pipeline.Interleaved1F1B(repeats=2), 2),
}
MESHES = [{"data": 1, "stage": 4}, {"data": 2, "stage": 4}]


def layer_fn(p, h):
    return h + jnp.tanh(h @ p["w"] + p["b"])


def loss_fn(head, y, t):
    return jnp.mean((y @ head["w"] - t) ** 2)


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed": {"w": rng.normal(size=(D_IN, D)).astype(np.float32) / np.sqrt(D_IN)},
        "layers": {
            "w": rng.normal(size=(LAYERS, D, D)).astype(np.float32) / np.sqrt(D),
            "b": 0.1 * rng.normal(size=(LAYERS, D)).astype(np.float32),
        },
        "head": {"w": rng.normal(size=(D, D_OUT)).astype(np.float32) / np.sqrt(D)},
    }


def make_batch(n, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D_IN)).astype(np.float32)
    return x, np.sin(x[:, :D_OUT]) + 0.1 * rng.normal(size=(n, D_OUT)).astype(np.float32)


def oracle_loss(params, x, t):
    """The model on one device, the whole batch at once, layer by layer."""
    h = x @ params["embed"]["w"]
    for i in range(LAYERS):
        h = layer_fn(jax.tree.map(lambda a, i=i: a[i], params["layers"]), h)
    return loss_fn(params["head"], h, t)


def to_pipeline(params, repl, k, v):
    """Stage params stacked and sharded over 'stage'; embedding and head replicated."""
    stacked = pipeline.stack_stages(params["layers"], num_stages=k, repeats=v)
    return {
        "embed": repl.replicate(params["embed"]),
        "stages": repl.place(stacked, pipeline.stage_spec(v)),
        "head": repl.replicate(params["head"]),
    }


def from_pipeline(tree, v):
    out = {k: tree[k] for k in ("embed", "head")}
    out["layers"] = pipeline.unstack_stages(tree["stages"], repeats=v)
    return jax.tree.map(np.asarray, out)


def pipelined_grads(f):
    """A one-replica function of (params, x, t): the pipeline's loss and gradients of all."""

    def grads(params, x, t):
        h, embed_vjp = jax.vjp(lambda e: x @ e["w"], params["embed"])
        loss, (g_stages, g_h, g_head) = f(params["stages"], h, t, params["head"])
        (g_embed,) = embed_vjp(g_h)
        return loss, {"embed": g_embed, "stages": g_stages, "head": g_head}

    return grads


def make_repl(mesh_shape):
    n = int(np.prod(list(mesh_shape.values())))
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m.values())))
@pytest.mark.parametrize(
    "name,m",
    [
        ("gpipe", 4),
        ("gpipe", 2),
        ("circular", 4),
        ("circular", 8),
        ("1f1b", 4),
        ("1f1b", 6),
        ("interleaved", 4),
        ("interleaved", 8),
    ],
)
@pytest.mark.slow
def test_loss_and_every_gradient_equal_the_sequential_model(name, m, mesh_shape):
    schedule, v = SCHEDULES[name]
    repl = make_repl(mesh_shape)
    params = init_params()
    x, t = make_batch(24 * mesh_shape["data"] if m == 6 else 16)
    want_loss, want = jax.value_and_grad(oracle_loss)(params, x, t)

    grads = pipelined_grads(pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=m, schedule=schedule
    ))  # fmt: skip

    def step(state, x, t):
        loss, g = grads(state["params"], x, t)
        loss, g = rp.all_reduce((loss, g), "mean")  # per-replica means -> the global mean
        return {**state, "grads": g}, {"loss": loss}

    placed = to_pipeline(params, repl, 4, v)
    state = {"params": placed, "grads": jax.tree.map(jnp.zeros_like, placed)}
    state, out = repl.run(step, state, x, t)
    got = from_pipeline(state["grads"], v)
    assert rel_err(out["loss"], np.full(repl.num_replicas, want_loss)) <= TOL
    for part in ("embed", "layers", "head"):
        assert rel_err(got[part], want[part]) <= TOL, part
    assert np.abs(got["layers"]["w"]).min() > 0  # every layer got a gradient


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
@pytest.mark.parametrize("name", [*SCHEDULES, "zerobubble"])
@pytest.mark.slow
def test_every_remat_policy_gives_the_sequential_gradients(name, remat):
    """Each schedule under each remat policy on {"data": 2, "stage": 4}: what a layer keeps
    for its backward pass changes the work, never the numbers."""
    schedule, v = SCHEDULES.get(name, (pipeline.ZeroBubble(), 1))
    repl = make_repl({"data": 2, "stage": 4})
    params = init_params(seed=3)
    x, t = make_batch(32, seed=4)
    want_loss, want = jax.value_and_grad(oracle_loss)(params, x, t)
    grads = pipelined_grads(pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=schedule,
        remat=remat,
    ))  # fmt: skip

    def step(state, x, t):
        loss, g = rp.all_reduce(grads(state["params"], x, t), "mean")
        return {**state, "grads": g}, {"loss": loss}

    placed = to_pipeline(params, repl, 4, v)
    state = {"params": placed, "grads": jax.tree.map(jnp.zeros_like, placed)}
    state, out = repl.run(step, state, x, t)
    assert rel_err(out["loss"], np.full(repl.num_replicas, want_loss)) <= TOL
    assert rel_err(from_pipeline(state["grads"], v), want) <= TOL


@pytest.mark.parametrize("lowering", ["shard_map", "local"])
@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.slow
def test_three_sgd_steps_of_dp_x_pp_equal_single_device_training(name, lowering):
    """The same step_fn and placement on {"data": 2, "stage": 4}, and unchanged under the local
    lowering (one device, the sequential model)."""
    schedule, v = SCHEDULES[name]
    if lowering == "local":
        repl = rp.Replicator(lowering="local")
    else:
        repl = make_repl({"data": 2, "stage": 4})
    tx = optax.sgd(0.1)
    wrapped = repl.wrap_optimizer(tx)
    grads = pipelined_grads(pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=schedule
    ))  # fmt: skip
    traces = []

    def step(state, x, t):
        traces.append(1)
        loss, g = grads(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    params = init_params()
    placed = to_pipeline(params, repl, 4, v)
    state = {"params": placed, "opt": wrapped.init(placed)}
    want, opt = params, tx.init(params)
    for i in range(3):
        x, t = make_batch(16, seed=10 + i)
        state, _ = repl.run(step, state, x, t)
        updates, opt = tx.update(jax.grad(oracle_loss)(want, x, t), opt, want)
        want = optax.apply_updates(want, updates)
    assert len(traces) == (1 if lowering == "shard_map" else 3)  # local runs eagerly
    assert rel_err(from_pipeline(state["params"], v), want) <= TOL
    assert rel_err(from_pipeline(state["params"], v), params) > 1e-2  # training moved them


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, remat, opt",
    pairwise(name=[*SCHEDULES, "zerobubble"], remat=["none", "full", "dots"], opt=["sgd", "adam"]),
)
def test_three_steps_under_each_remat_policy_equal_single_device_training(name, remat, opt):
    """Every schedule under every remat policy on {"data": 2, "stage": 4}: the losses and the
    parameters after 3 steps (SGD, and Adam with eps 1e-3 as elsewhere) equal one device's."""
    schedule, v = SCHEDULES.get(name, (pipeline.ZeroBubble(), 1))
    repl = make_repl({"data": 2, "stage": 4})
    tx = optax.sgd(0.1) if opt == "sgd" else optax.adam(0.01, eps=1e-3)
    wrapped = repl.wrap_optimizer(tx)
    grads = pipelined_grads(pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=schedule,
        remat=remat,
    ))  # fmt: skip

    def step(state, x, t):
        loss, g = grads(state["params"], x, t)
        updates, opt_state = wrapped.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt_state}, {"loss": rp.all_reduce(loss, "mean")}

    params = init_params()  # a well-conditioned start: SGD at 0.1 trains, not diverges
    placed = to_pipeline(params, repl, 4, v)
    state = {"params": placed, "opt": wrapped.init(placed)}
    want, opt_state = params, tx.init(params)
    for i in range(3):
        x, t = make_batch(16, seed=20 + i)
        state, out = repl.run(step, state, x, t)
        want_loss, g = jax.value_and_grad(oracle_loss)(want, x, t)
        assert rel_err(out["loss"], np.full(repl.num_replicas, want_loss)) <= TOL
        updates, opt_state = tx.update(g, opt_state, want)
        want = optax.apply_updates(want, updates)
    assert rel_err(from_pipeline(state["params"], v), want) <= TOL
    assert rel_err(from_pipeline(state["params"], v), params) > 1e-2  # training moved them


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_global_norm_clipping_adds_the_stages_and_counts_the_rest_once(name):
    """clip_global_norm under a pipeline: the norm of the whole gradient (stage blocks summed
    over the stages, embedding and head once), so the clip equals optax's on one device."""
    schedule, v = SCHEDULES[name]
    repl = make_repl({"data": 2, "stage": 4})
    max_norm = 0.01
    wrapped = repl.wrap_optimizer(optax.sgd(0.5), clip_global_norm=max_norm)
    grads = pipelined_grads(pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=schedule
    ))  # fmt: skip

    def step(state, x, t):
        loss, g = grads(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    params = init_params()
    placed = to_pipeline(params, repl, 4, v)
    state = {"params": placed, "opt": wrapped.init(placed)}
    tx = optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(0.5))
    want, opt = params, tx.init(params)
    for i in range(3):
        x, t = make_batch(16, seed=10 + i)
        assert float(optax.tree.norm(jax.grad(oracle_loss)(want, x, t))) > 4 * max_norm
        state, _ = repl.run(step, state, x, t)
        updates, opt = tx.update(jax.grad(oracle_loss)(want, x, t), opt, want)
        want = optax.apply_updates(want, updates)
    assert rel_err(from_pipeline(state["params"], v), want) <= TOL

    def no_params(state, x, t):  # the norm cannot tell stage blocks from whole leaves
        _, g = grads(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    with pytest.raises(ValueError, match=r"(?s)clip_global_norm.*stage.*state\[.params.\]"):
        repl.run(no_params, state, *make_batch(16))


@pytest.mark.parametrize(
    "lowering,mesh_shape", [("local", {"data": 1}), ("shard_map", {"data": 8})]
)
def test_without_a_stage_axis_the_call_is_the_sequential_model(lowering, mesh_shape):
    repl = rp.Replicator(
        mesh_shape=mesh_shape, lowering=lowering, devices=jax.devices()[: mesh_shape["data"]]
    )
    params = init_params()
    x, t = make_batch(16)
    want_loss, want = jax.value_and_grad(oracle_loss)(params, x, t)
    for name, (schedule, v) in SCHEDULES.items():
        grads = pipelined_grads(pipeline.value_and_grad(
            pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=2, schedule=schedule
        ))  # fmt: skip

        def step(state, x, t, grads=grads):
            loss, g = rp.all_reduce(grads(state, x, t), "mean")
            return state, {"loss": loss, "g": g}

        # Placed as on a mesh with a stage axis: without one, stage_spec means replicated.
        stacked = pipeline.stack_stages(params["layers"], num_stages=4, repeats=v)
        state = repl.replicate({"embed": params["embed"], "head": params["head"]})
        state["stages"] = repl.place(stacked, pipeline.stage_spec(v))
        assert state["stages"]["w"].sharding.is_fully_replicated
        _, out = repl.run(step, state, x, t)
        got = jax.tree.map(lambda a: np.asarray(a)[0], out["g"])  # row 0: reduced
        got["layers"] = pipeline.unstack_stages(got.pop("stages"), repeats=v)
        assert rel_err(out["loss"][0], want_loss) <= TOL, name
        for part in ("embed", "layers", "head"):
            assert rel_err(got[part], want[part]) <= TOL, (name, part)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_apply_equals_the_sequential_forward(name):
    schedule, v = SCHEDULES[name]
    repl = make_repl({"data": 2, "stage": 4})
    params = init_params()
    x, _ = make_batch(16)
    h = x @ params["embed"]["w"]
    want = h
    for i in range(LAYERS):
        want = layer_fn(jax.tree.map(lambda a, i=i: a[i], params["layers"]), want)
    f = pipeline.apply(pipeline.scan_layers(layer_fn), num_microbatches=4, schedule=schedule)

    def step(state, h):
        return state, {"y": f(state["stages"], h)}

    _, out = repl.run(step, to_pipeline(params, repl, 4, v), h)
    assert rel_err(np.asarray(out["y"]).reshape(16, D), want) <= TOL


# -- validation ---------------------------------------------------------------------------------


def run_once(mesh_shape, f, batch=16, v=1, stages=None):
    repl = make_repl(mesh_shape)
    params = init_params()
    placed = to_pipeline(params, repl, mesh_shape.get("stage", 1), v)
    if stages is not None:
        placed["stages"] = stages(repl, params)
    x, t = make_batch(batch)
    step = lambda s, x, t: (s, {"loss": f(s["stages"], x @ s["embed"]["w"], t, s["head"])[0]})
    return repl.run(step, placed, x, t)


@pytest.mark.parametrize("schedule", [pipeline.Circular(repeats=1), pipeline.OneFOneB()])
def test_fewer_microbatches_than_stages(schedule):
    f = pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=2, schedule=schedule
    )
    with pytest.raises(ValueError, match=r"num_microbatches.*2.*4"):
        run_once({"data": 1, "stage": 4}, f)


def test_batch_that_does_not_split_into_microbatches():
    f = pipeline.value_and_grad(pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4)
    with pytest.raises(
        ValueError,
        match=r"batch of 6 examples per replica does not split into num_microbatches=4.*"
        r"multiple of num_replicas x num_microbatches = 2 x 4 = 8",
    ):
        run_once({"data": 2, "stage": 4}, f, batch=12)


def test_layers_that_do_not_split_into_stages():
    with pytest.raises(ValueError, match=r"stack_stages.*10.*num_stages=4"):
        pipeline.stack_stages({"w": np.ones((10, 2, 2))}, num_stages=4)
    with pytest.raises(ValueError, match=r"stack_stages.*16.*num_stages=4.*repeats=3"):
        pipeline.stack_stages({"w": np.ones((16, 2, 2))}, num_stages=4, repeats=3)


def test_stage_params_must_be_sharded_over_stage():
    f = pipeline.value_and_grad(pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4)
    replicated = lambda repl, params: repl.replicate(
        pipeline.stack_stages(params["layers"], num_stages=4)
    )
    with pytest.raises(ValueError, match=r"stage_params\['b'\] has shape \(4, 4, 8\).*stage_spec"):
        run_once({"data": 1, "stage": 4}, f, stages=replicated)


def test_stage_fn_must_keep_the_activation_shape_and_options_are_checked():
    f = pipeline.value_and_grad(lambda p, h: h[:, :2], loss_fn, num_microbatches=2)
    with pytest.raises(ValueError, match=r"stage_fn must return an activation with the structure"):
        f(jnp.ones((4, 1)), jnp.ones((4, D)), jnp.ones((4, D_OUT)), {"w": jnp.ones((2, D_OUT))})
    with pytest.raises(ValueError, match=r"remat must be one of 'none', 'full', 'dots'.*'some'"):
        pipeline.value_and_grad(layer_fn, loss_fn, num_microbatches=4, remat="some")
    with pytest.raises(TypeError, match=r"remat must be one of .*got 2"):
        pipeline.value_and_grad(layer_fn, loss_fn, num_microbatches=4, remat=2)
    with pytest.raises(ValueError, match=r"num_microbatches must be an int >= 1; got 0"):
        pipeline.value_and_grad(layer_fn, loss_fn, num_microbatches=0)


@pytest.mark.parametrize("where", ["stage", "pipeline", "local"])
def test_a_scanned_layer_that_changes_the_activation_is_refused(where):
    widen = pipeline.scan_layers(lambda p, h: h @ p["w"])  # [b, 8] -> [b, 5]
    params = {"w": np.ones((4, 2, D, D_IN), np.float32)}  # 4 stages of 2 layers
    message = (
        r"rp.pipeline.scan_layers\(<lambda>\): layer_fn maps an activation float32\[2, 8\] "
        r"to float32\[2, 5\].*every layer in a stack must map activations to the same shape "
        r"and dtype.*outside the stages"
    )
    if where == "stage":  # a stage called directly, on one stage's [layers, ...] params
        with pytest.raises(ValueError, match=message):
            widen(jax.tree.map(lambda a: a[0], params), jnp.ones((2, D)))
        return
    f = pipeline.value_and_grad(widen, loss_fn, num_microbatches=4)
    if where == "pipeline":
        repl = make_repl({"data": 2, "stage": 4})
    else:
        repl = rp.Replicator(lowering="local")
    state = {
        "stages": repl.place(params, pipeline.stage_spec()),
        "head": repl.replicate({"w": np.ones((D, D_OUT), np.float32)}),
    }
    step = lambda s, h, t: (s, {"loss": f(s["stages"], h, t, s["head"])[0]})
    h, t = np.ones((8 * repl.num_replicas, D), np.float32), np.ones((8 * repl.num_replicas, 3))
    with pytest.raises(ValueError, match=message):
        repl.run(step, state, h, t)
    layer_dtype = pipeline.scan_layers(lambda p, h: (h @ p["w"]).astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"float32\[2, 8\] to bfloat16\[2, 8\]"):
        layer_dtype({"w": jnp.ones((2, D, D))}, jnp.ones((2, D)))


def test_check_replicas_sees_a_divergence_in_any_stage_block():
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 4}, check_replicas=True)
    w = jax.device_put(np.ones((4, 3), np.float32), NamedSharding(repl.mesh, pipeline.stage_spec()))

    def step(state, x):  # replicas drift apart in the last stage's block only
        last = jax.lax.axis_index("stage") == 3
        return {"w": state["w"] + jnp.where(last, rp.replica_id(), 0)}, {}

    with pytest.raises(rp.ReplicasDivergedError, match=r"\['w'\]"):
        repl.run(step, {"w": w}, np.ones(8))
    fine = lambda state, x: ({"w": state["w"] + rp.all_reduce(jnp.sum(x), "sum")}, {})
    w = jax.device_put(np.ones((4, 3), np.float32), NamedSharding(repl.mesh, pipeline.stage_spec()))
    state, _ = repl.run(fine, {"w": w}, np.ones(8))
    np.testing.assert_array_equal(state["w"], np.full((4, 3), 9.0))


# (interleaved: circular's virtual stages on another timetable, which the scanned loop runs in
# every test above; unrolled, its ticks compile one by one for half a minute)
@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "interleaved"])
@pytest.mark.slow
def test_the_unrolled_debug_loop_runs_the_same_ticks(name):
    schedule, v = SCHEDULES[name]
    repl = make_repl({"data": 1, "stage": 4})
    params = init_params()
    x, t = make_batch(16)
    results = []
    for unroll in (False, True):
        grads = pipelined_grads(pipeline.value_and_grad(
            pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=schedule,
            unroll=unroll,
        ))  # fmt: skip

        def step(state, x, t, grads=grads):
            loss, g = grads(state["params"], x, t)
            return {**state, "grads": g}, {"loss": loss}

        placed = to_pipeline(params, repl, 4, v)
        state = {"params": placed, "grads": jax.tree.map(jnp.zeros_like, placed)}
        state, out = repl.run(step, state, x, t)
        results.append((from_pipeline(state["grads"], v), np.asarray(out["loss"])))
    assert rel_err(results[1], results[0]) <= 1e-6
