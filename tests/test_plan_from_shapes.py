"""Planning from shapes: repl.abstract builds the state's shapes with the shardings the real
calls give, and repl.explain of those equals repl.explain of the allocated state, figure for
figure. A shape whose sharding the library cannot know is refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from test_report import WIDTH, mlp, mlp_loss, zero_loss, zero_params

import replicator as rp
from replicator import pipeline


def figures(report: rp.StepReport) -> dict:
    data = json.loads(report.to_json())
    del data["compile_seconds"]
    return data


def zero_state(repl, stage):
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=stage, loss_scale="dynamic")

    def init():
        params = jax.tree.map(jnp.asarray, zero_params())
        if stage == 3:
            params = opt.shard_params(params, stacked=["layers"])
        else:
            params = repl.replicate(params)
        return {"params": params, "opt": opt.init(params)}

    def step(state, batch):
        params, opt_state, metrics = opt.step(zero_loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    return init, step


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.slow
def test_explain_from_shapes_equals_explain_of_the_allocated_state_zero(stage):
    repl = rp.Replicator()
    init, step = zero_state(repl, stage)
    rng = np.random.default_rng(3)
    data = {
        "x": rng.normal(size=(64, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(64, 8)).astype(np.float32),
    }
    concrete = repl.explain(step, init(), data)
    shapes = repl.abstract(init)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    abstract = repl.explain(step, shapes, jax.eval_shape(lambda: data))
    assert figures(abstract) == figures(concrete)
    if stage:  # the optimizer state really is sharded in the shapes: 1/8 per device
        mu = shapes["opt"].inner[0].mu
        w = mu["layers"]["w"].value if stage == 3 else mu["layers"]["w"]
        assert "data" in w.sharding.spec and w.shape[-2:] == (WIDTH, WIDTH)


def test_explain_from_shapes_equals_explain_of_the_allocated_state_data_parallel():
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.sgd(0.1))

    def init():
        params = repl.replicate(jax.tree.map(jnp.asarray, mlp()))
        return {"params": params, "opt": opt.init(params)}

    def step(state, batch):
        params, opt_state, metrics = opt.step(mlp_loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    rng = np.random.default_rng(1)
    data = {
        "x": rng.normal(size=(64, 16)).astype(np.float32),
        "y": rng.normal(size=(64, 4)).astype(np.float32),
    }
    concrete = repl.explain(step, init(), data)
    abstract = repl.explain(step, repl.abstract(init), jax.eval_shape(lambda: data))
    assert figures(abstract) == figures(concrete)


def test_explain_from_shapes_equals_explain_of_the_allocated_state_pipeline():
    k, layers, w = 4, 8, 16
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": k})
    grad_fn = pipeline.value_and_grad(
        pipeline.scan_layers(lambda p, h: jnp.tanh(h @ p["w"])),
        lambda head, y, t: jnp.mean((y @ head - t) ** 2),
        num_microbatches=4,
        schedule=pipeline.OneFOneB(),
    )

    def init():
        stack = {"w": jax.random.normal(jax.random.key(0), (layers, w, w)) / 4}
        return {
            "stages": repl.place(pipeline.stack_stages(stack, num_stages=k), pipeline.stage_spec()),
            "head": repl.replicate(jnp.ones((w, 2))),
        }

    def step(state, x, t):
        loss, (g_stages, _, g_head) = grad_fn(state["stages"], x, t, state["head"])
        new = {
            "stages": jax.tree.map(lambda a, g: a - 0.1 * g, state["stages"], g_stages),
            "head": state["head"] - 0.1 * rp.all_reduce(g_head, "mean"),
        }
        return new, {"loss": rp.all_reduce(loss, "mean")}

    x = np.ones((32, w), np.float32)
    concrete = repl.explain(step, init(), x, x[:, :2])
    shapes = repl.abstract(init)
    assert shapes["stages"]["w"].sharding.spec == pipeline.stage_spec()
    abstract = repl.explain(
        step, shapes, jax.eval_shape(lambda: x), jax.eval_shape(lambda: x[:, :2])
    )
    assert figures(abstract) == figures(concrete)


def test_a_shape_without_a_sharding_is_refused_not_replicated():
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=1)
    init, step = zero_state(repl, 1)
    unknown = jax.eval_shape(init)  # jax.eval_shape alone: the ZeRO shardings are lost
    with pytest.raises(
        ValueError, match=r"state leaf \['opt'\].*without a sharding.*repl\.abstract"
    ):
        repl.explain(step, unknown, {"x": jnp.ones((64, WIDTH)), "y": jnp.ones((64, 8))})
    del opt


def test_abstract_refuses_a_leaf_it_did_not_see_placed():
    repl = rp.Replicator()

    def init():
        return {"w": repl.replicate(jnp.ones(4)), "step": jnp.zeros((), jnp.int32)}

    with pytest.raises(ValueError, match=r"state leaf \['step'\] is a shape without a sharding"):
        repl.abstract(init)


def test_abstract_allocates_nothing():
    """A 17-billion-parameter state (68 GB in fp32) on a 24 GiB machine, in milliseconds."""
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=1)

    def init():
        params = repl.replicate({"w": jax.random.normal(jax.random.key(0), (64, 16384, 16384))})
        return {"params": params, "opt": opt.init(params)}

    shapes = repl.abstract(init)
    assert shapes["params"]["w"].shape == (64, 16384, 16384)
    nu = shapes["opt"].inner[0].nu["w"]  # the parameter's shape, its first axis split
    assert nu.shape == (64, 16384, 16384) and nu.sharding.spec == P("data")


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
@pytest.mark.parametrize(
    "mesh_shape, specs",
    [
        ({"data": 2, "stage": 4}, {"w": P("stage"), "b": P()}),
        ({"data": 2, "model": 4}, {"w": P(None, None, "model"), "b": P()}),
        ({"data": 2, "stage": 2, "model": 2}, {"w": P("stage", None, "model"), "b": P()}),
    ],
)
def test_abstract_optimizer_state_of_split_parameters_has_the_real_shardings(
    mesh_shape, specs, zero_stage
):
    """The optimizer state of parameters split over `stage` or `model` (Adam's moments, which
    eagerly inherit the parameters' sharding, and ZeRO's blocks, laid out by the parameters'
    split) gets from repl.abstract the shapes and shardings the real init gives them; before,
    the traced parameters' split was invisible and the moments came out replicated."""
    repl = rp.Replicator(mesh_shape=mesh_shape)
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=zero_stage)

    def init():
        params = repl.place({"w": jnp.ones((4, 8, 8)), "b": jnp.ones((8,))}, specs)
        if zero_stage == 3:
            params = opt.shard_params(params)
        return {"params": params, "opt": opt.init(params)}

    def described(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [(jax.tree_util.keystr(k), x.shape, x.dtype, x.sharding.spec) for k, x in flat]

    assert described(repl.abstract(init)) == described(init())


def test_abstract_refuses_an_optimizer_state_leaf_not_shaped_like_the_parameters():
    """A state leaf the library cannot tie to a parameter (here a [3] buffer) is refused when
    built from shapes, instead of being assumed replicated."""
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 4})

    def odd_init(params):
        return {"buffer": jnp.zeros((3,)), "mu": jax.tree.map(jnp.zeros_like, params)}

    tx = repl.wrap_optimizer(optax.GradientTransformation(odd_init, lambda g, s, p=None: (g, s)))

    def init():
        params = repl.place({"w": jnp.ones((4, 8))}, P("stage"))
        return {"params": params, "opt": tx.init(params)}

    with pytest.raises(ValueError, match=r"wrap_optimizer: .*shape \[3\].*placement.*guess"):
        repl.abstract(init)


def test_abstract_refuses_optimizer_state_of_parameters_placed_outside_the_library():
    """Adam's moments of a parameter placed by jax.device_put (whose sharding a traced leaf
    does not carry) are refused, not assumed replicated, even when only the optimizer state is
    returned."""
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 4})
    tx = repl.wrap_optimizer(optax.adam(1e-3))

    def init():
        sharding = jax.sharding.NamedSharding(repl.mesh, P("stage"))
        return tx.init({"w": jax.device_put(jnp.ones((4, 8)), sharding)})

    with pytest.raises(ValueError, match=r"wrap_optimizer: .*parameter was not placed"):
        repl.abstract(init)
