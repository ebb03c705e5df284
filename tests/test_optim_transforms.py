"""The optimizer's parts, each an optax transformation tested alone, against optax or NumPy on
one device: the cross-replica mean, ZeRO's slice and sharded update, global-norm clipping, the
loss scale and the accumulation scan; and `DistributedOptimizer` as an optax transformation."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from oracle import batches, rel_err

import replicator as rp
from replicator._src.optim import (
    accumulation,
    clipping,
    loss_scaling,
    replica_mean,
    zero,
    zero_transforms,
)

EMPTY = optax.EmptyState()


def tree(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(8, 3)).astype(np.float32), "b": np.full((3,), 0.5, np.float32)}


def local_grads(batch):
    """A different gradient on every replica: a function of its rows of the batch."""
    return {"w": batch["x"][:, :8].T @ batch["y"][:, :3], "b": jnp.sum(batch["y"][:, :3], 0)}


def mean_of_local_grads(batch, n=8):
    """The mean over the n replicas of `local_grads` of each one's rows, on one device."""
    rows = len(batch["x"]) // n
    parts = [{k: v[r * rows : (r + 1) * rows] for k, v in batch.items()} for r in range(n)]
    return jax.tree.map(lambda *g: np.mean(g, 0), *map(local_grads, parts))


def row(tree, r):
    return {k: v[r] for k, v in tree.items()}


@pytest.mark.parametrize("grad_dtype", [None, jnp.bfloat16])
def test_mean_over_replicas_is_the_mean_of_the_local_gradients(grad_dtype):
    repl = rp.Replicator()
    data = batches(1)[0]
    tx = replica_mean.mean_over_replicas(grad_dtype=grad_dtype)

    def step(state, batch):
        return state, tx.update(local_grads(batch), tx.init(None))[0]

    _, out = repl.run(step, repl.replicate({"n": jnp.zeros(())}), data)
    want = mean_of_local_grads(data)
    for r in range(8):
        got = row(out, r)
        assert rel_err(got, want) <= (1e-2 if grad_dtype else 1e-6)
        assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype("float32")}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("with_params", [True, False])
def test_zero_slice_and_sharded_update_equal_optax_on_the_mean(stage, with_params):
    repl = rp.Replicator()
    layout = zero.Zero(repl.mesh, stage=stage)
    scatter, update = (
        zero_transforms.scatter_mean(layout),
        zero_transforms.sharded_update(optax.adam(0.1), layout),
    )
    params = repl.replicate(tree())
    state = {"params": params, "opt": update.init(params)}

    def step(state, batch):
        grads = local_grads(batch)
        slices = scatter.update(grads, scatter.init(None))[0]
        p = state["params"] if with_params else None
        updates, opt = update.update(slices, state["opt"], p, local_grads=grads)
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    data = batches(2)
    for batch in data:
        state, _ = repl.run(step, state, batch)
    tx, want = optax.adam(0.1), tree()
    opt = tx.init(want)
    for batch in data:
        updates, opt = tx.update(mean_of_local_grads(batch), opt, want)
        want = optax.apply_updates(want, updates)
    assert rel_err(state["params"], want) <= 1e-5
    mu = state["opt"][0].mu  # Adam's moments in the parameters' shapes, split where 8 divides
    assert mu["w"].shape == (8, 3) and {s.data.shape for s in mu["w"].addressable_shards} == {
        (1, 3)
    }
    assert mu["b"].shape == (3,) and {s.data.shape for s in mu["b"].addressable_shards} == {(3,)}


def test_clip_by_global_norm_on_one_device_is_optax():
    grads = jax.tree.map(lambda x: 3 * x, tree(1))
    want, _ = optax.clip_by_global_norm(0.5).update(grads, EMPTY)
    tx = clipping.clip_by_global_norm(0.5)
    assert float(optax.tree.norm(grads)) > 1
    assert rel_err(tx.update(grads, tx.init(None))[0], want) <= 1e-7
    norm = clipping.global_norm(grads, None, over_replicas=False)
    assert abs(float(norm) - float(optax.tree.norm(grads))) <= 1e-5 * float(norm)
    given = tx.update(grads, EMPTY, grad_norm=2 * norm)[0]  # the caller's norm is used
    assert rel_err(given, jax.tree.map(lambda g: g * 0.25 / norm, grads)) <= 1e-6


def test_clip_by_global_norm_of_zero_slices_is_the_norm_of_the_whole():
    repl = rp.Replicator()
    layout = zero.Zero(repl.mesh, stage=1)
    data = batches(1)[0]
    grads = {"w": jnp.asarray(np.arange(1.0, 17.0, dtype=np.float32))}

    def step(state, batch):
        mine = zero_transforms.scatter_mean(layout).update(grads, EMPTY)[0]  # 2 of the 16 elements
        tx = clipping.clip_by_global_norm(1.0, over_replicas=True)
        norm = clipping.global_norm(mine, None, over_replicas=True)
        return state, {"norm": norm, "clipped": tx.update(mine, EMPTY)[0]["w"]}

    _, out = repl.run(step, repl.replicate({"n": jnp.zeros(())}), data)
    whole = np.arange(1.0, 17.0)
    assert np.allclose(out["norm"], np.linalg.norm(whole), rtol=1e-6)
    assert np.allclose(out["clipped"].reshape(-1), whole / np.linalg.norm(whole), rtol=1e-6)


def test_loss_scale_skips_a_non_finite_step_and_adapts_the_scale():
    tx = loss_scaling.with_loss_scale(optax.sgd(1.0, momentum=0.5), loss_scale="dynamic", period=2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    assert float(state.loss_scale.scale) == 2.0**15
    history = []
    for g in [1.0, 1.0, np.inf, 1.0]:
        grads = {"w": jnp.full(2, g)}
        before = state
        updates, state = tx.update(grads, state, params)
        history.append((float(state.loss_scale.scale), int(state.loss_scale.skipped)))
        if not np.isfinite(g):  # skipped: no update, the inner state kept
            assert not np.any(updates["w"]) and rel_err(state.inner, before.inner) == 0
    assert history == [(2.0**15, 0), (2.0**16, 0), (2.0**15, 1), (2.0**15, 1)]
    static = loss_scaling.with_loss_scale(optax.sgd(1.0), loss_scale=128.0)
    updates, s = static.update({"w": jnp.ones(2)}, static.init(params))
    assert float(s.loss_scale.scale) == 128.0 and np.all(updates["w"] == -1.0)
    assert loss_scaling.with_loss_scale(optax.sgd(1.0)).init(params).loss_scale is None
    grads = loss_scaling.unscale({"w": jnp.full(2, 256.0)}, s.loss_scale)
    assert np.all(grads["w"] == 2.0)


def test_accumulated_grads_equal_the_gradient_of_the_whole_batch():
    batch = batches(1)[0]
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)}
    loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    want = jax.value_and_grad(loss_fn)(params, batch)
    loss, grads = accumulation.accumulated_grads(loss_fn, params, batch, steps=4, scale=8.0)
    assert abs(float(loss) - float(want[0])) <= 1e-6 * float(want[0])
    assert rel_err(grads, jax.tree.map(lambda g: 8 * g, want[1])) <= 1e-5  # of the scaled loss
    twice = accumulation.accumulated_grads(
        loss_fn, params, batch, steps=4, each=lambda g: jax.tree.map(lambda x: 2 * x, g)
    )
    assert rel_err(twice[1], jax.tree.map(lambda x: 2 * x, want[1])) <= 1e-5
    with pytest.raises(ValueError, match=r"\['x'\] of shape \(64, 16\) does not split into"):
        accumulation.accumulated_grads(loss_fn, params, batch, steps=3)


def test_accumulation_unrolled_is_the_same_gradient_without_a_loop():
    """`accumulation.unrolled` (for XLA's estimate of a step with accumulation, read per layer):
    the same loss and gradients, in straight-line code; the loop comes back after it."""
    batch = batches(1, seed=3)[0]
    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(16, 4)), jnp.float32)}
    loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    # a new function each time: jit's cache does not see the context
    step = lambda: lambda p, b: accumulation.accumulated_grads(loss_fn, p, b, steps=4)
    want = jax.value_and_grad(loss_fn)(params, batch)
    with accumulation.unrolled():
        text = jax.jit(step()).lower(params, batch).as_text()
        loss, grads = jax.jit(step())(params, batch)
    assert "stablehlo.while" not in text, text
    assert abs(float(loss) - float(want[0])) <= 1e-6 * float(want[0])
    assert rel_err(grads, want[1]) <= 1e-5
    assert "stablehlo.while" in jax.jit(step()).lower(params, batch).as_text()


def test_distributed_optimizer_is_an_optax_transformation_with_real_methods():
    opt = rp.Replicator().wrap_optimizer(optax.sgd(0.1, momentum=0.9), clip_global_norm=1.0)
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    assert {"init", "update", "step", "shard_params"} <= set(vars(rp.DistributedOptimizer))
    assert set(vars(opt)) == {"parts"}  # nothing attached after construction
    params, grads = tree(), jax.tree.map(lambda x: 3 * x, tree(1))
    want, _ = opt.update(grads, opt.init(params), params)
    init, update = opt  # optax.chain unpacks transformations so
    assert rel_err(update(grads, init(params), params)[0], want) == 0
    chained = optax.chain(opt, optax.identity())
    assert rel_err(chained.update(grads, chained.init(params), params)[0], want) == 0
    multi = optax.MultiSteps(opt, every_k_schedule=1)
    assert rel_err(multi.update(grads, multi.init(params), params)[0], want) == 0
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=opt)
    state = state.apply_gradients(grads=grads)
    assert rel_err(state.params, optax.apply_updates(params, want)) == 0
    assert copy.copy(opt).parts is opt.parts
    assert rp.Replicator().wrap_optimizer(opt).init(params)  # wraps again, as optax would
