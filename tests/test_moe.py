"""The mixture of experts (`replicator.moe`): routing and gates against a loop written by hand,
expert parallelism over {"data": 2, "expert": 4} (with and without ZeRO-3) against one device
with the full batch, the very same tokens dropped, and the all-to-all bytes of the compiled step
against the capacity buffers that must cross the `expert` axis."""

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from oracle import rel_err

import replicator as rp
from replicator import moe
from replicator._src.report import hlo
from replicator._src.sharded import dropless, exchange
from replicator._src.sharded import routing as routing_lib

TOL = 1e-5
B, S, D, F, E = 8, 16, 32, 32, 8  # global batch: 8 groups of 16 tokens
MESH = {"data": 2, "expert": 4}
AUX = 0.01


def make_repl(mesh_shape):
    n = math.prod(mesh_shape.values())
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


def batches(n=3, batch=B, seed=0):
    rng = np.random.default_rng(seed)
    make = lambda: rng.normal(size=(batch, S, D)).astype(np.float32)
    return [(make(), make()) for _ in range(n)]


def params0():
    # A router this wide makes the choices far from ties, so rounding cannot flip one.
    return {**moe.init(jax.random.key(0), d_model=D, hidden=F, num_experts=E), "router": router()}


def router():
    return 0.5 * jax.random.normal(jax.random.key(1), (D, E), jnp.float32)


apply = jax.jit(moe.apply, static_argnames=("routing", "activation", "dtype"))


def loss_fn(params, x, t, routing):
    """``y = x + moe(x)``: squared error plus the mean load-balancing loss of the groups."""
    y, stats = moe.apply(params, x, routing=routing)
    return jnp.mean((x + y - t) ** 2) + AUX * jnp.mean(stats.aux_loss), stats


@functools.cache
def oracle(top_k, capacity_factor):
    """Three SGD steps on one device with the full batch: parameters, losses, per-group stats."""
    routing = moe.Routing(num_experts=E, top_k=top_k, capacity_factor=capacity_factor)
    params, tx = params0(), optax.sgd(0.1)

    @jax.jit
    def step(params, opt, x, t):
        (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params, x, t, routing)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss, stats

    opt, losses, stats = tx.init(params), [], []
    for x, t in batches():
        params, opt, loss, st = step(params, opt, x, t)
        losses.append(float(loss))
        stats.append(jax.tree.map(np.asarray, st))
    return params, np.array(losses), stats


def train(repl, top_k, capacity_factor, zero_stage=0):
    """The same three steps, ``step_fn`` one replica's, on ``repl``: the trained parameters
    (as logical arrays), the losses, the per-group stats (replica-major: the global order)."""
    routing = moe.Routing(num_experts=E, top_k=top_k, capacity_factor=capacity_factor)
    tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=zero_stage)

    def step(state, x, t):
        grad = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, stats), g = grad(state["params"], x, t, routing)
        updates, opt = tx.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {
            "loss": rp.all_reduce(loss, "mean"),
            **stats._asdict(),
        }

    placed = repl.place(params0(), moe.partition_specs())
    stored = tx.shard_params(placed) if zero_stage == 3 else placed
    state = {"params": stored, "opt": tx.init(stored)}
    losses, stats = [], []
    for x, t in batches():
        state, out = repl.run(step, state, x, t)
        losses.append(float(np.asarray(out["loss"])[0]))
        stats.append({k: np.asarray(out[k]).reshape(-1) for k in moe.Stats._fields})
    return state["params"], np.array(losses), stats


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


# -- expert parallelism against one device -------------------------------------------------------


@pytest.mark.parametrize(
    "top_k, capacity_factor, zero_stage",
    [(1, 0.5, 0), (2, 0.5, 0), (2, 0.5, 3), (1, None, 3)],  # dropless: test_moe_rounds.py too
)
def test_expert_parallel_moe_trains_as_one_device(top_k, capacity_factor, zero_stage):
    """{"data": 2, "expert": 4}: each device holds 2 of the 8 experts and routes 1 of its
    replica's 4 groups; three SGD steps give one device's parameters and losses, and the same
    per-group aux losses and dropped counts (none without a capacity factor; some, the very
    same, with 0.5)."""
    repl = make_repl(MESH)
    params, losses, stats = train(repl, top_k, capacity_factor, zero_stage)
    want, want_losses, want_stats = oracle(top_k, capacity_factor)
    if zero_stage == 3:  # stored ZeRO-3 style: each leaf in its own shape, split over data too
        assert shard_shapes(params["up"].value) == {(E // 4, D // 2, F)}
        params = {k: p.value for k, p in params.items()}
    else:
        assert shard_shapes(params["up"]) == {(E // 4, D, F)}
        assert params["up"].sharding.spec == P("expert")
    # rel_err scales each leaf's largest difference by its largest entry, so the biases' entries
    # near zero (of those experts the few dropped tokens barely train) need no atol.
    got = jax.tree.map(np.asarray, params)
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert rel_err(got, params0()) > 1e-3  # training moved them
    assert rel_err(losses, want_losses) <= TOL
    for got_s, want_s in zip(stats, want_stats):
        np.testing.assert_array_equal(got_s["dropped"], want_s.dropped)
        np.testing.assert_array_equal(got_s["routed"], np.full(B, S * top_k))
        assert rel_err(got_s["aux_loss"], want_s.aux_loss) <= TOL
    dropped = np.concatenate([s.dropped for s in want_stats])
    if capacity_factor is None:
        assert not dropped.any()
    else:
        assert dropped.min() > 0, dropped


@pytest.mark.parametrize(
    "mesh_shape, capacity_factor",
    [
        ({"data": 8}, 0.5),
        ({"data": 4, "expert": 2}, 0.5),
        ({"data": 1, "expert": 8}, 0.5),  # every replica collective of one replica is the identity
        ({"data": 1, "expert": 8}, None),  # dropless: each device's rows to 8 devices and back
    ],
)
def test_other_meshes_are_one_device_too(mesh_shape, capacity_factor):
    """{"data": 8}: no mapping at all (data parallelism); {"data": 4, "expert": 2}: each
    device 1 of its replica's 2 groups and 4 of the 8 experts. Both equal one device, drops
    included."""
    params, losses, stats = train(make_repl(mesh_shape), 2, capacity_factor)
    want, want_losses, want_stats = oracle(2, capacity_factor)
    assert rel_err(jax.tree.map(np.asarray, params), want) <= TOL
    assert rel_err(losses, want_losses) <= TOL
    for got_s, want_s in zip(stats, want_stats):
        np.testing.assert_array_equal(got_s["dropped"], want_s.dropped)


# -- routing: gates, priority, capacity against a loop written by hand ------------------------


def loop_moe(params, x, routing):
    """`moe.apply`'s meaning, token by token in NumPy (fp64): the module docstring's rules."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    k, c = routing.top_k, routing.capacity(x.shape[1])
    # jax.nn.gelu's default, the tanh approximation
    gelu = lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    y, dropped = np.zeros_like(x), []
    for g in range(x.shape[0]):
        logits = x[g] @ p["router"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # ties: lowest index
        gates = np.take_along_axis(probs, order, -1)
        gates = gates / gates.sum(-1, keepdims=True) if k > 1 else gates
        used, drops = np.zeros(routing.num_experts, int), 0
        for j in range(k):  # every first choice, then every second choice
            for s in range(x.shape[1]):
                e = order[s, j]
                if used[e] >= c:
                    drops += 1
                    continue
                used[e] += 1
                if "gate" in p:  # SwiGLU, no biases
                    g_in = x[g, s] @ p["gate"][e]
                    h = g_in / (1 + np.exp(-g_in)) * (x[g, s] @ p["up"][e])
                    y[g, s] += gates[s, j] * (h @ p["down"][e])
                    continue
                h = gelu(x[g, s] @ p["up"][e] + p["up_bias"][e])
                y[g, s] += gates[s, j] * (h @ p["down"][e] + p["down_bias"][e])
        dropped.append(drops)
    return y, np.array(dropped)


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 1.0), (2, 0.5), (3, 0.75), (2, None)])
def test_apply_is_the_loop_by_hand(top_k, capacity_factor):
    routing = moe.Routing(num_experts=4, top_k=top_k, capacity_factor=capacity_factor)
    params = moe.init(jax.random.key(3), d_model=8, hidden=16, num_experts=4)
    params = {**params, "router": jax.random.normal(jax.random.key(4), (8, 4))}
    params = {**params, "down_bias": 0.1 * jax.random.normal(jax.random.key(5), (4, 8))}
    x = jax.random.normal(jax.random.key(6), (3, 12, 8))
    y, stats = apply(params, x, routing=routing)
    want, dropped = loop_moe(params, x, routing)
    assert rel_err(np.asarray(y), want) <= TOL
    np.testing.assert_array_equal(stats.dropped, dropped)
    np.testing.assert_array_equal(stats.routed, [12 * top_k] * 3)
    assert stats.dropped.dtype == stats.routed.dtype == jnp.int32
    if capacity_factor is None:
        assert not dropped.any()
    elif top_k > 1:
        assert dropped.any()


@pytest.mark.parametrize("capacity_factor", [0.5, None])
def test_gated_experts_are_the_loop_by_hand(capacity_factor):
    """Mixtral's experts: ``down(silu(x @ gate) * (x @ up))``, no biases, top-2."""
    routing = moe.Routing(num_experts=4, top_k=2, capacity_factor=capacity_factor)
    params = moe.init(jax.random.key(3), d_model=8, hidden=16, num_experts=4, gated=True,
                      bias=False)  # fmt: skip
    params = {k: 10 * v for k, v in params.items()}  # far from linear: silu(x) is not x / 2
    x = jax.random.normal(jax.random.key(6), (3, 12, 8))
    y, stats = apply(params, x, routing=routing, activation=jax.nn.silu)
    want, dropped = loop_moe(params, x, routing)
    assert rel_err(np.asarray(y), want) <= TOL
    np.testing.assert_array_equal(stats.dropped, dropped)
    assert dropped.any() == (capacity_factor is not None)
    wrong, _ = apply(params, x, routing=routing)  # GELU: another function
    assert rel_err(np.asarray(wrong), want) > 1e-2


def test_gates_priority_and_aux_loss_by_hand():
    """Four tokens of one group, router probabilities set by hand: the first choices all come
    before the second, ties go to the lowest expert, top-1 gates are the raw probability and
    top-2 gates are renormalised; the aux loss is E * sum_e f_e P_e."""
    probs = np.array(
        [[0.5, 0.3, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]]
    )
    x = jnp.asarray(np.log(probs)[None], jnp.float32)  # [1, 4, 4]: softmax(x @ I) = probs
    r2 = moe.Routing(num_experts=4, top_k=2, capacity_factor=0.5)  # 1 slot per expert
    choices, stats = routing_lib.route(jnp.eye(4), x, r2)
    # Priority order: token 0..3's first choices, then their second choices.
    assert choices.expert.tolist() == [[0, 0, 1, 0, 1, 1, 2, 1]]  # ties: the lowest expert
    assert choices.slot.tolist() == [[0, 1, 0, 2, 1, 2, 0, 3]]
    assert choices.token.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert r2.capacity(4) == 1 and stats.dropped.tolist() == [5]
    np.testing.assert_allclose(
        choices.gate[0], [5 / 8, 1 / 2, 6 / 8, 7 / 8, 3 / 8, 1 / 2, 2 / 8, 1 / 8], rtol=1e-6
    )
    first = np.array([3, 1, 0, 0]) / 4  # f_e: tokens whose first choice is e
    np.testing.assert_allclose(stats.aux_loss, [4 * first @ probs.mean(0)], rtol=1e-6)
    r1 = moe.Routing(num_experts=4, top_k=1)
    choices, _ = routing_lib.route(jnp.eye(4), x, r1)
    np.testing.assert_allclose(choices.gate[0], [0.5, 0.4, 0.6, 0.7], rtol=1e-6)


def test_capacity():
    cap = lambda e, k, cf, s: moe.Routing(num_experts=e, top_k=k, capacity_factor=cf).capacity(s)
    assert cap(8, 1, 1.25, 16) == 3  # ceil(2.5)
    assert cap(8, 2, 1.25, 16) == 5  # ceil(5.0)
    assert cap(8, 2, 0.5, 16) == 2
    assert cap(3, 1, 0.3, 10) == 1  # 0.3 * 10 / 3 is 1.0000000000000002 in floating point
    assert cap(2, 2, 4.0, 16) == 16  # at most the group: a token never picks an expert twice
    assert cap(8, 2, None, 16) == 16
    assert cap(64, 1, 1.0, 16) == 1


def test_bad_routing_and_shapes_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"top_k=3 is more than num_experts=2 .* top_k <= 2"):
        moe.Routing(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match=r"num_experts must be an int >= 1; got 0"):
        moe.Routing(num_experts=0)
    with pytest.raises(ValueError, match=r"top_k must be an int >= 1; got 1.5"):
        moe.Routing(num_experts=4, top_k=1.5)
    for bad in (0, -1.0, True, "1.25", math.inf):
        with pytest.raises(ValueError, match=r"capacity_factor must be a positive number, or None"):
            moe.Routing(num_experts=4, capacity_factor=bad)
    params = moe.init(jax.random.key(0), d_model=8, hidden=16, num_experts=4)
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, d_model\].*\[1, tokens"):
        moe.apply(params, jnp.ones((6, 8)), routing=moe.Routing(num_experts=4))
    with pytest.raises(ValueError, match=r"params\['router'\] has shape \(8, 4\).*num_experts=8"):
        moe.apply(params, jnp.ones((1, 6, 8)), routing=moe.Routing(num_experts=8))
    with pytest.raises(ValueError, match=r"params\['down'\] has shape \(4, 16, 4\); expected"):
        moe.apply({**params, "down": params["down"][..., :4]}, jnp.ones((1, 6, 8)),
                  routing=moe.Routing(num_experts=4))  # fmt: skip
    with pytest.raises(TypeError, match=r"routing must be a moe.Routing"):
        moe.apply(params, jnp.ones((1, 6, 8)), routing=4)


def mean_output_step(num_experts):
    def step(params, x):
        y, _ = moe.apply(params, x, routing=moe.Routing(num_experts=num_experts))
        return params, {"y": rp.all_reduce(jnp.mean(y), "mean")}

    return step


def test_splits_the_expert_axis_cannot_take_are_refused_with_the_fix():
    repl = make_repl(MESH)
    placed = repl.place(params0(), moe.partition_specs())
    x = np.ones((4, S, D), np.float32)  # 2 groups per replica, over 4 devices of `expert`
    with pytest.raises(
        ValueError,
        match=r"^moe\.apply: the step's batch has 2 groups \(sequences\), which do not split over "
        r"the 4 devices of the 'expert' axis .* multiple of 4 \(a global batch that is a multiple "
        r"of 4 x the number of data replicas\), or a smaller 'expert' axis\.",
    ):
        repl.run(mean_output_step(E), placed, x)
    six = repl.replicate(moe.init(jax.random.key(0), d_model=D, hidden=F, num_experts=6))
    with pytest.raises(
        ValueError,
        match=r"^moe\.apply: num_experts=6 does not split over the 4 devices of the 'expert' "
        r"axis; use num_experts a multiple of 4 \(e\.g\. 8\), or a smaller 'expert' axis\.",
    ):
        repl.run(mean_output_step(6), six, np.ones((8, S, D), np.float32))


def test_specs_by_role():
    specs = moe.partition_specs()
    assert specs == {
        "router": P(None, None),
        "up": P("expert", None, None),
        "up_bias": P("expert", None),
        "down": P("expert", None, None),
        "down_bias": P("expert", None),
    }
    params = moe.init(jax.random.key(0), d_model=8, hidden=16, num_experts=4, out_std=0.5)
    assert {k: len(a) for k, a in moe.logical_axes_for().items()} == {
        k: v.ndim for k, v in params.items()
    }
    gated = moe.init(jax.random.key(0), d_model=8, hidden=16, num_experts=4, gated=True,
                     bias=False)  # fmt: skip
    assert sorted(gated) == sorted(moe.partition_specs(gated=True, bias=False))
    assert {k: v.shape for k, v in gated.items()} == {
        "router": (8, 4), "gate": (4, 8, 16), "up": (4, 8, 16), "down": (4, 16, 8)
    }  # fmt: skip
    assert moe.partition_specs(gated=True)["gate"] == P("expert", None, None)
    assert {k: v.dtype for k, v in params.items()} == {k: jnp.float32 for k in params}
    assert float(jnp.std(params["down"])) > 0.3 > 0.1 > float(jnp.std(params["up"]))
    assert not params["up_bias"].any() and not params["down_bias"].any()
    # Without an `expert` axis the same specs replicate.
    placed = make_repl({"data": 8}).place(params, specs)
    assert {x.sharding.spec for x in jax.tree.leaves(placed)} == {P()}


def test_compute_dtype():
    params = moe.init(jax.random.key(0), d_model=8, hidden=16, num_experts=4)
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    routing = moe.Routing(num_experts=4, top_k=2, capacity_factor=None)
    y32, s32 = apply(params, x, routing=routing)
    y16, s16 = apply(params, x, routing=routing, dtype=jnp.bfloat16)
    assert y32.dtype == jnp.float32 and y16.dtype == jnp.bfloat16
    assert s16.aux_loss.dtype == jnp.float32  # the router runs in fp32 whatever the experts do
    np.testing.assert_array_equal(s16.aux_loss, s32.aux_loss)
    assert rel_err(np.asarray(y16, np.float32), y32) < 2e-2


# -- what the compiled step moves over `expert` -----------------------------------------------


@pytest.mark.parametrize("input_grad", [True, False])
def test_all_to_all_bytes_are_the_capacity_buffers_there_and_back(input_grad):
    """Per device and step, each all-to-all sends its ``[G_local, E, C, D]`` buffer, of which
    (N-1)/N leaves the device. Forward: one to the experts, one back. Backward: the outputs'
    cotangents go to the experts (the transpose of the way back) and, when the layer's input
    has a gradient, the inputs' cotangents come back (the transpose of the way there). With the
    input plain data, JAX does not build the second: 3 all-to-alls, not 4."""
    repl = make_repl(MESH)
    routing = moe.Routing(num_experts=E, top_k=2, capacity_factor=1.25)
    tx = repl.wrap_optimizer(optax.sgd(0.1))

    def loss(params, x, t):
        h = x @ params["w_in"] if input_grad else x
        return loss_fn(params["moe"], h, t, routing)[0]

    def step(state, x, t):
        g = jax.grad(loss)(state["params"], x, t)
        updates, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    specs = {"moe": moe.partition_specs(), "w_in": P()}
    placed = repl.place({"moe": params0(), "w_in": np.eye(D, dtype=np.float32)}, specs)
    report = repl.explain(step, {"params": placed, "opt": tx.init(placed)}, *batches(1)[0])
    a2a = [c for c in report.collectives if c.kind == "all-to-all"]
    n = MESH["expert"]
    g_local = B // MESH["data"] // n
    c = routing.capacity(S)  # ceil(1.25 * 16 * 2 / 8) = 5
    buffer = g_local * E * c * D * 4  # fp32
    assert {(x.axes, x.dtype, x.bytes, x.count) for x in a2a} == {(("expert",), "f32", buffer, 1)}
    trips = 4 if input_grad else 3  # 2 forward (there and back), 2 (or 1) backward
    assert len(a2a) == trips
    assert sum(x.wire_bytes for x in a2a) == trips * (n - 1) / n * buffer  # 3840 bytes each


# -- dropless: the routed rows only ---------------------------------------------------------------


@pytest.mark.parametrize("tile", [1, 4, 128])
def test_grouped_matmul_is_ragged_dot(tile):
    """The CPU's grouped matmul (a loop over row tiles, megablox's schedule) against
    ``jax.lax.ragged_dot``: values and both gradients, with an empty group, groups that share
    a tile and rows past the last group (zeros, no gradient)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(37, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 8, 5)), jnp.float32)
    sizes = jnp.asarray([9, 0, 20, 5], jnp.int32)  # 34 of the 37 rows
    ct = jnp.asarray(rng.normal(size=(37, 5)), jnp.float32)
    tiled = lambda x, w: dropless._tiled(x, w, sizes, tile)
    ragged = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
    for f in (lambda f: f, lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w) * ct), (0, 1))):
        got, want = jax.jit(f(tiled))(x, w), f(ragged)(x, w)
        assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert not np.asarray(tiled(x, w))[34:].any()
    if tile == 128:  # the TPU's: ragged_dot, and megablox's tgmm (interpreted here) for dw
        grads = lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w) * ct), (0, 1))(x, w)
        got = grads(lambda x, w: dropless._tpu(x, w, sizes))
        assert rel_err(got, grads(ragged)) <= TOL
    wrong = lambda x, w: dropless._tiled(x, w, sizes.at[0].add(1), tile)  # can fail
    assert rel_err(wrong(x, w), ragged(x, w)) > 1e-2


def test_dropless_flops_are_the_routed_rows():
    """With ``capacity_factor=None`` the experts compute each token's ``top_k`` rows: the
    compiled forward and backward count the router's and the routed rows' matmuls and at most
    2% more (the tiles groups share), where every expert computing every token was ``E / k`` =
    2x their FLOPs; a capacity factor keeps its ``[G, E, C, D]`` slots."""
    b, s, d, f, e, k = 4, 256, 16, 24, 4, 2
    params = moe.init(jax.random.key(0), d_model=d, hidden=f, num_experts=e)
    x = jax.random.normal(jax.random.key(1), (b, s, d))

    def matmul_flops(capacity_factor):
        routing = moe.Routing(num_experts=e, top_k=k, capacity_factor=capacity_factor)
        loss = lambda p, x: jnp.sum(moe.apply(p, x, routing=routing)[0] ** 2)
        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(params, x).compile()
        return hlo.analyze(compiled.as_text(), {"data": 1}).matmul_flops

    tokens = b * s
    ideal = 3 * (2 * tokens * d * e + 2 * 2 * tokens * k * d * f)  # forward, and 2x backward
    dropless_flops = matmul_flops(None)
    assert ideal <= dropless_flops <= 1.02 * ideal, dropless_flops / ideal
    slots = e * moe.Routing(num_experts=e, top_k=k, capacity_factor=1.5).capacity(s)
    capacity = 3 * (2 * tokens * d * e + 2 * 2 * b * slots * d * f)
    assert matmul_flops(1.5) == capacity  # 1.5x the routed rows


@pytest.mark.slow  # three small compiles for a TPU target, 10-30 s each
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_dropless_compiles_for_a_tpu_with_the_routed_rows_flops():
    """For v5p-16: the grouped matmuls are kernels (the compiler's ragged-dot, megablox's
    tgmm), 3 matmuls of the routed rows each (forward, dx, dw), also with the hidden units
    split over ``model`` (mapped by hand: no dense ``dw`` over every expert). Over ``expert``
    the rows travel by ``ragged_all_to_all`` in rounds: round 0's buffer of ``B`` rows, and the
    overflow rounds of ``B2`` rows, counted as one round (its backward recomputes what of the
    forward it needs): at most ``(3 B + 4 B2) / 3 R``, under 1.1x, where a buffer for the
    worst case was 4x."""
    b, s, d, f, e = 8, 512, 128, 256, 8
    routing = moe.Routing(num_experts=e, top_k=2, capacity_factor=None)
    params = {"moe": moe.init(jax.random.key(0), d_model=d, hidden=f, num_experts=e),
              "w": np.eye(d, dtype=np.float32)}  # fmt: skip
    by_hidden = {"up": P("expert", None, "model"), "up_bias": P("expert", "model"),
                 "down": P("expert", "model", None)}  # fmt: skip

    def kernel_flops(mesh_shape):
        repl = rp.Replicator(mesh_shape=mesh_shape, devices=rp.tpu_devices("v5p-16"))
        tx = repl.wrap_optimizer(optax.sgd(0.1))
        loss = lambda p, x: jnp.mean(moe.apply(p["moe"], x @ p["w"], routing=routing)[0] ** 2)

        def step(state, x):
            updates, opt = tx.update(jax.grad(loss)(state["params"], x), state["opt"])
            return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

        def init():
            placed = repl.place(params, {"moe": moe.partition_specs() | by_hidden, "w": P()})
            return {"params": placed, "opt": tx.init(placed)}

        x = jax.ShapeDtypeStruct((b, s, d), jnp.float32)
        return repl.explain(step, repl.abstract(init), x).kernel_flops

    rows = b // 8 * s * 2  # a device's routed rows: one sequence, top-2
    ideal = 3 * 2 * 2 * rows * d * f  # up and down: forward, dx, dw
    assert kernel_flops({"data": 8}) == ideal
    assert kernel_flops({"data": 4, "model": 2}) == ideal  # 2 sequences, half the hidden units
    b0, b2 = exchange.buffers(rows, 4, routing.receive_factor)  # 1080 and 32 rows of 1024
    rounds = kernel_flops({"data": 2, "expert": 4})
    assert ideal * b0 / rows < rounds <= ideal * (3 * b0 + 4 * b2) / (3 * rows) <= 1.1 * ideal
