"""ZeRO with optax transformations that are not element-wise: global-norm clipping in a chain,
Adafactor, LAMB, and transformations written here. Each against optax on one device with the
full batch; each either runs on the shards or says, at init, that it is gathered."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle import batches, rel_err, zero3_loss, zero3_params, zero_spec
from test_optim import SIZES, init_params, loss_fn, oracle

import replicator as rp

STEPS = 3


def scale_by_leaf_mean(lr: float) -> optax.GradientTransformation:
    """A full reduction with a mean: each leaf's step is divided by the leaf's mean |g|."""

    def update(grads, state, params=None):
        del params
        return jax.tree.map(lambda g: -lr * g / (jnp.mean(jnp.abs(g)) + 1e-3), grads), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def normalize_rows(lr: float) -> optax.GradientTransformation:
    """A reduction over one axis only: each row of a matrix normalised to unit norm."""

    def update(grads, state, params=None):
        del params

        def rows(g):
            if g.ndim < 2:
                return -lr * g
            return -lr * g / (jnp.linalg.norm(g, axis=-1, keepdims=True) + 1e-3)

        return jax.tree.map(rows, grads), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def max_abs_momentum(lr: float) -> optax.GradientTransformation:
    """State that is not shaped like the parameters' padding: a max over negative values too."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        del params
        state = jax.tree.map(lambda m, g: 0.9 * m + g, state, grads)
        step = jax.tree.map(lambda m: -lr * m / (jnp.max(m) - jnp.min(m) + 1e-3), state)
        return step, state

    return optax.GradientTransformation(init, update)


def clip_by_quantile(lr: float) -> optax.GradientTransformation:
    """A sort over every element of a leaf: steps clipped at the 90th percentile of |g|, which
    has no rule on parts (the sorted order mixes the replicas' parts)."""

    def update(grads, state, params=None):
        del params

        def clipped(g):
            cap = jnp.sort(jnp.abs(g).ravel())[int(0.9 * (g.size - 1))]
            return -lr * jnp.clip(g, -cap, cap)

        return jax.tree.map(clipped, grads), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


# name -> (transformation, runs on the shards?)
TRANSFORMS = {
    "clip_chain": (lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5)), True),
    "lamb": (lambda: optax.lamb(1e-2, weight_decay=1e-2), True),
    "adafactor": (lambda: optax.adafactor(1e-2), True),  # no leaf >= 128: not factored
    "adafactor_factored": (lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4), True),
    "leaf_mean": (lambda: scale_by_leaf_mean(0.05), True),
    "max_abs_momentum": (lambda: max_abs_momentum(0.05), True),
    "normalize_rows": (lambda: normalize_rows(0.05), True),  # a reduction over one axis
    "clip_by_quantile": (lambda: clip_by_quantile(0.05), False),  # a sort of every element
    "muon": (lambda: optax.contrib.muon(1e-2), False),  # Newton-Schulz: products of whole matrices
}


def zero_run(repl, tx, data, zero_stage):
    wrapped = repl.wrap_optimizer(tx, zero_stage=zero_stage)
    params = repl.replicate(init_params())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = {"params": params, "opt": wrapped.init(params)}

    def step(state, batch):
        grads = jax.grad(loss_fn)(state["params"], batch)
        updates, opt = wrapped.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    for batch in data:
        state, _ = repl.run(step, state, batch)
    warned = [str(w.message) for w in caught if "wrap_optimizer" in str(w.message)]
    return state, warned, wrapped.plan(params)


@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.slow
def test_zero_1_2_with_any_transformation_equal_one_device(name, zero_stage):
    make, on_shards = TRANSFORMS[name]
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])
    state, warned, plan = zero_run(rp.Replicator(), make(), data, zero_stage)
    want = oracle(make(), data)
    assert rel_err(state["params"], want) <= 1e-5
    assert rel_err(state["params"], init_params()) > 1e-3  # it trained
    assert plan.on_shards == on_shards, plan.gathered
    for leaf, planned in zip(jax.tree.leaves(state["opt"].inner), plan.state, strict=True):
        assert leaf.sharding.spec == planned.spec and leaf.shape == planned.shape
        if planned.why_whole != "reduced":  # a moment, like its parameter: 1/8 where 8 divides
            assert leaf.sharding.spec == zero_spec(leaf.shape), (planned.path, leaf.sharding)
    if on_shards:
        assert not warned
        assert "the update runs on shards" in str(plan)
    else:
        assert len(warned) == 1 and "gathered for each step" in warned[0], warned
        assert ("sort" if name == "clip_by_quantile" else "scan") in warned[0]


def test_factored_adafactor_keeps_its_statistics_on_shards():
    """Adafactor's row and column means of a [16, 24] matrix split along its rows (16): the
    column means are a reduction over the split axis, completed over the replicas (whole, 24
    floats); the row means are split like the rows. Nothing is gathered."""
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.adafactor(1e-2, min_dim_size_to_factor=4), zero_stage=1)
    params = repl.replicate(init_params())
    plan = opt.plan(params)
    assert plan.on_shards and "on shards" in str(plan)
    stats = {leaf.shape: leaf for leaf in plan.state if leaf.path.endswith("[0]['w']")}
    assert stats[(24,)].split is None and stats[(24,)].why_whole == "reduced"
    assert stats[(16,)].split == 0 and stats[(16,)].device_bytes == 4 * 16 // 8


def test_an_element_wise_run_of_a_non_element_wise_transformation_is_wrong():
    """What the oracle tests above guard against: optax run on each replica's flat slice."""
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])
    tx = TRANSFORMS["clip_chain"][0]()
    params = init_params()
    n = 8

    def sliced_update(grads, state, params):  # each of 8 slices clipped on its own
        flat, unravel = jax.flatten_util.ravel_pytree(grads)
        pad = -flat.size % n
        parts = jnp.pad(flat, (0, pad)).reshape(n, -1)
        out = jax.vmap(lambda g: tx.update(g, tx.init(g))[0])(parts)
        return unravel(out.reshape(-1)[: flat.size]), state

    for batch in data:
        updates, _ = sliced_update(jax.grad(loss_fn)(params, batch), None, params)
        params = optax.apply_updates(params, updates)
    assert rel_err(params, oracle(tx, data)) > 1e-3


@pytest.mark.parametrize(
    "name",
    ["clip_chain", "lamb", "adafactor_factored", "leaf_mean", "normalize_rows", "clip_by_quantile"],
)
@pytest.mark.slow
def test_zero_3_with_any_transformation_equals_one_device(name):
    make, _ = TRANSFORMS[name]
    data = batches(STEPS, din=16, dout=4)
    tx = make()
    params = jax.tree.map(jnp.asarray, zero3_params())
    opt_state = tx.init(params)
    for batch in data:
        updates, opt_state = tx.update(jax.grad(zero3_loss)(params, batch), opt_state, params)
        params = optax.apply_updates(params, updates)

    repl = rp.Replicator()
    wrapped = repl.wrap_optimizer(make(), zero_stage=3)
    sharded = wrapped.shard_params(zero3_params(), stacked=["layers"])
    assert wrapped.plan(sharded).on_shards == TRANSFORMS[name][1], wrapped.plan(sharded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"params": sharded, "opt": wrapped.init(sharded)}

    def step(state, batch):
        grads = jax.grad(zero3_loss)(state["params"], batch)
        updates, opt = wrapped.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    for batch in data:
        state, _ = repl.run(step, state, batch)
    got = jax.jit(rp.gather_params)(state["params"])  # one replica: crops the padding
    assert rel_err(got, params) <= 1e-5
    assert rel_err(got, zero3_params()) > 1e-3


def test_the_plan_is_known_before_a_step_and_names_the_operation():
    repl = rp.Replicator()
    params = repl.replicate(init_params())
    with pytest.warns(UserWarning, match=r"zero_stage=1.*gather.*over the replicas.*sort"):
        repl.wrap_optimizer(clip_by_quantile(0.1), zero_stage=1).init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repl.wrap_optimizer(optax.lamb(1e-3), zero_stage=1).init(params)
        repl.wrap_optimizer(normalize_rows(0.1), zero_stage=1).init(params)


def test_sharded_param_used_without_gather_params_says_to_gather():
    repl = rp.Replicator()
    wrapped = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=3)
    params = wrapped.shard_params({"w": np.ones((16, 4), np.float32)})
    state = {"params": params, "opt": wrapped.init(params)}

    def step(state, x):
        loss_of = lambda p: jnp.mean(x @ p["w"])  # forgot rp.gather_params
        jax.grad(loss_of)(state["params"])
        return state, {}

    with pytest.raises(TypeError, match=r"ShardedParam.*\(16, 4\).*rp.gather_params"):
        repl.run(step, state, np.ones((8, 16), np.float32))
    for use in (lambda w: w + 1, lambda w: jnp.dot(np.ones(16), w), lambda w: w[0]):
        with pytest.raises(TypeError, match="gather_params"):
            use(params["w"])
