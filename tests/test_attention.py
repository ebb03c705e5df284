"""Attention across a sequence split over `context` (`replicator.attention`): a one-layer model
(qkv projection, attention, output projection) trained three SGD steps on {"data": 2,
"context": 4} with each impl, mask and layout against one device with the full batch; the zigzag
layout against `reference` at its positions; the errors; the ring refused inside 1F1B; and the
collectives of the compiled step against the ring's and Ulysses' formulas."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle import rel_err

import replicator as rp
from replicator import attention as att
from replicator import pipeline

TOL = 1e-5
B, S, H, DH = 8, 16, 4, 8  # global batch 8; per device: 4 sequences, 4 of the 16 tokens
DM = H * DH
MESH = {"data": 2, "context": 4}
C = MESH["context"]


def make_repl(mesh_shape):
    n = math.prod(mesh_shape.values())
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


def params0():
    k = jax.random.split(jax.random.key(0), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[0])
    return {
        "qkv": normal(k[0], (DM, 3 * DM)),
        "qkv_bias": 0.1 * jax.random.normal(k[1], (3 * DM,), jnp.float32),
        "out": normal(k[2], (DM, DM)),
        "out_bias": 0.1 * jax.random.normal(k[3], (DM,), jnp.float32),
    }


def batches(n=3, seed=0):
    rng = np.random.default_rng(seed)
    make = lambda: rng.normal(size=(B, S, DM)).astype(np.float32)
    return [(make(), make()) for _ in range(n)]


def loss_fn(params, x, y, *, causal, impl, layout):
    """``mean((attention(x) - y)^2)``, written once for the mesh and for one device.

    The zigzag layout is a promise about the order of the sequence dimension: ``attention``
    then masks by the positions ``zigzag_order(S, C)``. So, as `gpt.loss` does, the model lays
    its inputs and targets out in that order first (the loss is a mean over tokens, the same in
    any order). On one device ``C = 1``, the order is the natural one and ``attention`` is plain
    `reference` attention: the oracle below is natural-order attention, written without any ring
    or zigzag, and the mesh's zigzag ring must equal it. (Comparing a zigzag mesh with the same
    code on one device *without* the permutation would not test the mask: there ``layout`` is
    natural order. `test_zigzag_layout_is_reference_at_its_positions` checks the positions
    themselves.)"""
    order = att.zigzag_order(S, att.context_size()) if layout == "zigzag" else None
    if order is not None:
        x, y = x[:, order], y[:, order]
    x = att.constrain_tokens(x)
    b = x.shape[0]
    qkv = (x @ params["qkv"] + params["qkv_bias"]).reshape(b, S, H, 3 * DH)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    out = att.attention(q, k, v, causal=causal, impl=impl, layout=layout)
    out = att.constrain_tokens(out.reshape(b, S, DM) @ params["out"] + params["out_bias"])
    return jnp.mean((out - y) ** 2)


@functools.cache
def oracle(causal):
    """Three SGD steps on one device with the full batch. Outside a mesh ``attention`` is
    `reference` in natural order whatever ``impl`` and ``layout`` say (see
    `test_one_device_is_reference_attention`), so one oracle per mask serves every impl and
    layout."""
    params, tx = params0(), optax.sgd(0.1)
    loss = functools.partial(loss_fn, causal=causal, impl="ring", layout="contiguous")

    @jax.jit
    def step(params, opt, x, y):
        value, g = jax.value_and_grad(loss)(params, x, y)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, value

    opt, losses = tx.init(params), []
    for x, y in batches():
        params, opt, value = step(params, opt, x, y)
        losses.append(float(value))
    return params, np.array(losses)


def train_step(tx, **how):
    def step(state, x, y):
        value, g = jax.value_and_grad(functools.partial(loss_fn, **how))(state["params"], x, y)
        updates, opt = tx.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(value, "mean")}

    return step


def initial_state(repl, tx):
    placed = repl.replicate(params0())
    return {"params": placed, "opt": tx.init(placed)}


slow = pytest.mark.slow


@pytest.mark.parametrize(
    "impl, causal, layout",
    [  # the fast lane: the ring's causal skip and its zigzag halves, Ulysses' positions
        ("ring", True, "contiguous"),
        ("ring", True, "zigzag"),
        ("all_to_all", True, "zigzag"),
        pytest.param("ring", False, "contiguous", marks=slow),
        pytest.param("ring", False, "zigzag", marks=slow),
        pytest.param("all_to_all", True, "contiguous", marks=slow),
        pytest.param("all_to_all", False, "contiguous", marks=slow),
        pytest.param("all_to_all", False, "zigzag", marks=slow),
    ],
    ids=lambda v: {True: "causal", False: "full"}.get(v, v) if isinstance(v, bool) else v,
)
def test_context_parallel_attention_trains_as_one_device(impl, causal, layout):
    """{"data": 2, "context": 4}: each device holds 4 sequences' 4 of 16 tokens; three SGD
    steps give one device's losses and parameters."""
    repl = make_repl(MESH)
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    step = train_step(tx, causal=causal, impl=impl, layout=layout)
    state, losses = initial_state(repl, tx), []
    for x, y in batches():
        state, out = repl.run(step, state, x, y)
        losses.append(float(np.asarray(out["loss"])[0]))
    want, want_losses = oracle(causal)
    got = jax.tree.map(np.asarray, state["params"])
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert rel_err(np.array(losses), want_losses) <= TOL
    assert rel_err(got, params0()) > 1e-3  # training moved them


def qkv_inputs(batch=B, seq=S, heads=H, seed=3):
    rng = np.random.default_rng(seed)
    make = lambda: rng.normal(size=(batch, seq, heads, DH)).astype(np.float32)
    return make(), make(), make()


def test_one_device_is_reference_attention():
    q, k, v = qkv_inputs()
    for causal in (True, False):
        want = att.reference(q, k, v, causal=causal)
        for impl in att.IMPLS:
            for layout in att.LAYOUTS:
                got = att.attention(q, k, v, causal=causal, impl=impl, layout=layout)
                assert rel_err(np.asarray(got), want) <= 1e-6, (impl, layout)
    assert att.context_size() == 1


@pytest.mark.parametrize("impl", att.IMPLS)
def test_zigzag_layout_is_reference_at_its_positions(impl):
    """Inputs given in zigzag order, no permutation: on {"data": 2, "context": 4} the causal
    output is `reference` masked by ``zigzag_order(S, 4)``, and that mask is not the natural
    one (so a ring that ignored the layout would fail here)."""
    repl = make_repl(MESH)

    def step(state, q, k, v):
        assert att.context_size() == C
        out = att.attention(q, k, v, causal=True, impl=impl, layout="zigzag")
        return state, {"out": out}

    q, k, v = qkv_inputs()
    _, out = repl.run(step, repl.replicate({}), q, k, v)
    got = np.asarray(out["out"]).reshape(B, S, H, DH)  # replica-major: the global order
    order = att.zigzag_order(S, C)
    want = att.reference(q, k, v, causal=True, positions=order)
    assert rel_err(got, want) <= TOL
    assert rel_err(got, att.reference(q, k, v, causal=True)) > 0.1
    # The same tokens in natural order are natural-order causal attention.
    inverse = np.argsort(order)
    natural = att.reference(*(a[:, inverse] for a in (q, k, v)), causal=True)
    assert rel_err(got[:, inverse], natural) <= TOL


def test_zigzag_order():
    assert att.zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert att.zigzag_order(8, 4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    assert att.zigzag_order(6, 1).tolist() == list(range(6))  # one device: natural order
    order = att.zigzag_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))  # a permutation
    chunks = order.reshape(4, 2, 2)[:, :, 0] // 2  # device c holds chunks c and 2C - 1 - c
    assert chunks.tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # Under a causal mask every device's queries see the same number of keys.
    live = order[:, None] >= order[None, :]
    per_device = live.reshape(4, 4, 16).sum(axis=(1, 2))
    assert per_device.tolist() == [per_device[0]] * 4
    with pytest.raises(
        ValueError,
        match=r"^zigzag_order: seq_len=12 must divide into 2 \* context = 8 chunks for the "
        r"zigzag layout; use seq_len a multiple of 8, or layout='contiguous'\.$",
    ):
        att.zigzag_order(12, 4)


def run_attention(seq=S, heads=H, **how):
    repl = make_repl(MESH)

    def step(state, q, k, v):
        return state, {"out": att.attention(q, k, v, **how)}

    return repl.run(step, repl.replicate({}), *qkv_inputs(seq=seq, heads=heads))


def test_splits_that_do_not_fit_are_refused_with_the_fix():
    with pytest.raises(
        ValueError,
        match=r"^attention: the sequence of 6 tokens does not split over the 4 devices of "
        r"'context'; use a seq_len that divides by 4, or a smaller context axis\.",
    ):
        run_attention(seq=6, causal=True, impl="ring")
    with pytest.raises(ValueError, match=r"^zigzag_order: seq_len=12 must divide into 2 \*"):
        run_attention(seq=12, causal=True, impl="ring", layout="zigzag")
    run_attention(seq=12, causal=True, impl="ring")  # 12 splits over 4 contiguously
    with pytest.raises(
        ValueError,
        match=r"^attention\(impl='all_to_all'\): 2 heads per 'model' device do not split over "
        r"the 4 devices of 'context'; use impl='ring', or num_heads a multiple of 4\.",
    ):
        run_attention(heads=2, causal=False, impl="all_to_all")
    run_attention(heads=2, causal=False, impl="ring")  # the ring splits no heads


def test_unknown_impl_and_layout_are_refused():
    q, k, v = qkv_inputs(batch=1)
    with pytest.raises(
        ValueError, match=r"^attention: impl='flash'; use one of 'ring', 'all_to_all'\.$"
    ):
        att.attention(q, k, v, impl="flash")
    with pytest.raises(
        ValueError, match=r"^attention: layout='striped'; use one of 'contiguous', 'zigzag'\.$"
    ):
        att.attention(q, k, v, layout="striped")


# -- inside a pipeline ---------------------------------------------------------------------------


def attention_stage(impl):
    def stage(p, h):
        b = h.shape[0]
        qkv = (att.constrain_tokens(h) @ p["qkv"]).reshape(b, S, H, 3 * DH)
        out = att.attention(*jnp.split(qkv, 3, axis=-1), causal=True, impl=impl)
        return h + out.reshape(b, S, DM) @ p["out"]

    return pipeline.scan_layers(stage)


def pipeline_step(impl, schedule):
    f = pipeline.value_and_grad(
        attention_stage(impl),
        lambda head, y, t: jnp.mean((y - t) ** 2),
        num_microbatches=2,
        schedule=schedule,
    )

    def step(stages, x, y):  # the stages' gradients as the new state: laid out as the stages
        loss, (g, _, _) = f(stages, x, y)
        return rp.all_reduce(g, "mean"), {"loss": rp.all_reduce(loss, "mean")}

    return step


def staged_params(repl, repeats=1):
    """Four layers (scaled copies of one) in two stages of ``repeats`` virtual stages."""
    p = {k: params0()[k] for k in ("qkv", "out")}
    stacked = jax.tree.map(lambda a: jnp.stack([s * a for s in (1.0, 0.5, -0.5, 0.25)]), p)
    stages = pipeline.stack_stages(stacked, num_stages=2, repeats=repeats)
    return repl.place(stages, pipeline.stage_spec(repeats))


@pytest.mark.parametrize(
    "schedule",
    [pipeline.OneFOneB(), pipeline.ZeroBubble(), pipeline.Interleaved1F1B(repeats=2)],
    ids=lambda s: s.name,
)
def test_ring_inside_a_gated_schedule_is_refused_with_the_fix(schedule):
    """1F1B, ZeroBubble and interleaved 1F1B run each stage's work under its own
    ``lax.cond``; a collective-permute there is reached by some devices only, so the ring
    refuses at trace time (before anything runs) and names the fixes."""
    repl = make_repl({"data": 2, "stage": 2, "context": 2})
    stages = staged_params(repl, schedule.repeats)
    with pytest.raises(
        ValueError,
        match=rf"^replicator: a ring over 'context' \(ring attention's key/value blocks\) cannot "
        rf"run inside the '{schedule.name}' pipeline schedule, whose work each stage runs or "
        r"skips on its own: .* Use attention impl='all_to_all' .*, or the 'gpipe' or "
        r"'circular' schedule\.",
    ):
        repl.run(pipeline_step("ring", schedule), stages, *batches(1)[0])


@pytest.mark.slow
def test_pipelined_attention_gradients_equal_one_device():
    """The fixes the refusal names work: the ring under GPipe and Circular, all-to-all under
    1F1B, on {"data": 2, "stage": 2, "context": 2}: the same loss and stage gradients as one
    device."""
    repl = make_repl({"data": 2, "stage": 2, "context": 2})
    x, y = batches(1)[0]
    for impl, schedule in [
        ("ring", pipeline.GPipe()),
        ("ring", pipeline.Circular(repeats=2)),
        ("all_to_all", pipeline.OneFOneB()),
    ]:
        host = jax.tree.map(np.asarray, staged_params(repl, schedule.repeats))
        want, want_loss = jax.jit(pipeline_step(impl, schedule))(host, x, y)  # sequential
        stages = staged_params(repl, schedule.repeats)
        got, out = repl.run(pipeline_step(impl, schedule), stages, x, y)
        assert rel_err(float(np.asarray(out["loss"])[0]), float(want_loss["loss"])) <= TOL
        assert rel_err(jax.tree.map(np.asarray, got), want) <= TOL, (impl, schedule.name)


# -- what the compiled step moves over `context` ---------------------------------------------


def context_collectives(impl, causal=True, layout="contiguous"):
    """The `context` collectives of one training step (one attention call, forward and
    backward), split into the forward pass's and the backward pass's (``transpose`` in the
    JAX operation they come from)."""
    repl = make_repl(MESH)
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    step = train_step(tx, causal=causal, impl=impl, layout=layout)
    report = repl.explain(step, initial_state(repl, tx), *batches(1)[0])
    kind = "collective-permute" if impl == "ring" else "all-to-all"
    ours = [c for c in report.collectives if c.kind == kind]
    assert all(c.axes == ("context",) and c.dtype == "f32" for c in ours), ours
    backward = [c for c in ours if "transpose(" in c.op_name]
    forward = [c for c in ours if "transpose(" not in c.op_name]
    others = {(c.kind, c.axes) for c in report.collectives if c not in ours}
    # Besides: the parameters' gradients, summed over the tokens of `context`, then `data`.
    assert others == {("all-reduce", ("context",)), ("all-reduce", ("data",))}, others
    return forward, backward


BLOCK = B // MESH["data"] * S // C * H * DH * 4  # one device's K (or V, Q, ...) block, fp32


@pytest.mark.parametrize("layout", att.LAYOUTS)
def test_ring_sends_k_and_v_round_forward_and_their_gradients_home_backward(layout):
    """Per attention call and device: forward, K and V each travel ``C - 1`` hops (2 (C - 1)
    block sends); backward, K and V again ``C - 1`` hops and dK, dV ``C`` hops (``C - 1``
    alongside them, one more to their owner). The causal skip and the zigzag balance change
    the work, never the sends."""
    forward, backward = context_collectives("ring", layout=layout)
    assert {c.bytes for c in forward + backward} == {BLOCK}  # 4 * 4 * 4 * 8 * 4 = 2048
    assert not any(c.conditional for c in forward + backward)  # every device sends every hop
    assert sum(c.count for c in forward) == 2 * (C - 1)  # 6
    assert sum(c.count for c in backward) == 2 * (C - 1) + 2 * C  # 14
    assert sum(c.wire_bytes for c in forward) == 2 * (C - 1) * BLOCK
    assert sum(c.wire_bytes for c in backward) == (4 * C - 2) * BLOCK


def test_all_to_all_moves_q_k_v_there_and_the_output_back():
    """Ulysses: forward, Q, K and V to the heads' layout and the output back (4 all-to-alls of
    one device's activation block); backward, their transposes (4 more). Each sends
    ``(C - 1) / C`` of its block off the device."""
    forward, backward = context_collectives("all_to_all")
    assert {(c.bytes, c.count) for c in forward + backward} == {(BLOCK, 1)}
    assert len(forward) == 4 and len(backward) == 4
    assert sum(c.wire_bytes for c in forward) == 4 * (C - 1) / C * BLOCK


@pytest.mark.parametrize("impl", ["ring", "all_to_all"])
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_blockwise_attention_equals_reference_values_and_gradients(impl, causal, monkeypatch):
    """Blocks longer than a tile are folded a tile of keys at a time (the memory-efficient
    path: on one device for a sequence longer than `TILE`, on each device of the ring for its
    block, on each device of all-to-all for the whole sequence). With tiles of 3 keys, the
    values and the gradients of q, k, v equal plain attention, on one device and on
    {"data": 2, "context": 4} (the ring's half blocks tiled too: 12 tokens a device)."""
    from replicator._src.sharded import attention as impl_module

    monkeypatch.setattr(impl_module, "TILE", 3)
    q, k, v, w = jax.random.normal(jax.random.key(5), (4, 4, 48, H, DH))
    order = att.zigzag_order(48, C) if causal and impl == "ring" else np.arange(48)
    layout = "zigzag" if causal and impl == "ring" else "contiguous"

    def want(q, k, v, w):
        return jnp.sum(att.reference(q, k, v, causal=causal, positions=order) * w)

    def got(q, k, v, w):
        return jnp.sum(att.attention(q, k, v, causal=causal, impl=impl, layout=layout) * w)

    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2))
    ref_loss, ref_grads = grad(want)(q, k, v, w)
    # one device: natural positions (C = 1), the tiled kernel for 48 > 3 keys
    one = grad(lambda *a: jnp.sum(att.attention(*a[:3], causal=causal, impl=impl) * a[3]))
    plain = jax.value_and_grad(
        lambda q, k, v: jnp.sum(att.reference(q, k, v, causal=causal) * w), argnums=(0, 1, 2)
    )
    assert rel_err(one(q, k, v, w), plain(q, k, v)) <= TOL
    repl = make_repl(MESH)

    def step(state, q, k, v, w):
        loss, grads = grad(got)(q, k, v, w)
        return state, {"loss": rp.all_reduce(loss, "sum"), "grads": grads}

    _, out = repl.run(step, {}, q, k, v, w)
    assert rel_err(float(np.asarray(out["loss"])[0]), float(ref_loss)) <= TOL
    grads = jax.tree.map(lambda g: np.concatenate(list(np.asarray(g)), 0), out["grads"])
    assert rel_err(grads, ref_grads) <= TOL


@pytest.mark.parametrize(
    "impl, kv", [("ring", 2), ("ring", 1), ("all_to_all", 4), ("all_to_all", 2)]
)
@pytest.mark.slow  # 8 s
def test_grouped_query_attention_sends_kv_heads_and_equals_repeated_heads(impl, kv):
    """8 query heads, ``kv`` key/value heads: on {"data": 2, "context": 4} the values and the
    gradients of q, k, v equal plain attention with each key/value head repeated for its group
    (the k, v gradients summed over it), and what travels is K and V with their ``kv`` heads:
    the ring's sends, and Ulysses' all-to-alls where ``kv`` splits over the 4 devices (2 does
    not: K and V are then repeated first, as before)."""
    h = 8
    keys = jax.random.split(jax.random.key(9), 4)
    q, w = (jax.random.normal(key, (B, S, h, DH)) for key in keys[:2])
    k, v = (jax.random.normal(key, (B, S, kv, DH)) for key in keys[2:])
    order = att.zigzag_order(S, C) if impl == "ring" else np.arange(S)
    layout = "zigzag" if impl == "ring" else "contiguous"
    wide = lambda x: jnp.repeat(x, h // kv, axis=2)

    def want(q, k, v):
        out = att.reference(q, wide(k), wide(v), causal=True, positions=order)
        return jnp.sum(out * w), out

    def got(q, k, v, w):
        out = att.attention(q, k, v, causal=True, impl=impl, layout=layout)
        return jnp.sum(out * w), out

    (_, ref_out), ref_grads = jax.value_and_grad(want, (0, 1, 2), has_aux=True)(q, k, v)
    repl = make_repl(MESH)

    def step(state, q, k, v, w):
        (_, out), grads = jax.value_and_grad(got, (0, 1, 2), has_aux=True)(q, k, v, w)
        return state, {"out": out, "grads": grads}

    _, out = repl.run(step, {}, q, k, v, w)
    assert rel_err(np.asarray(out["out"]).reshape(ref_out.shape), ref_out) <= TOL
    grads = jax.tree.map(lambda g: np.concatenate(list(np.asarray(g)), 0), out["grads"])
    assert [g.shape for g in grads] == [(B, S, h, DH), (B, S, kv, DH), (B, S, kv, DH)]
    assert rel_err(grads, ref_grads) <= TOL
    kind = "collective-permute" if impl == "ring" else "all-to-all"
    report = repl.explain(step, {}, q, k, v, w)
    sizes = sorted({c.bytes for c in report.collectives if c.kind == kind})
    block = B // MESH["data"] * S // C * DH * 4  # one device's block, per head
    if impl == "ring":  # K, V, dK, dV: kv heads, never repeated
        assert sizes == [block * kv], (sizes, block)
    else:  # Q and the output at 8 heads; K and V at theirs where they split over 4 devices
        assert sizes == sorted({block * h, block * (kv if kv % C == 0 else h)}), (sizes, block)


# -- the platform's kernels: splash (Pallas, interpreted here) and cuDNN's selection -----------


def pallas_case(impl, c, kv, causal, layout, seq):
    """Values and gradients of q, k, v under `kernels.forced("splash")` (the TPU's kernel in
    Pallas's interpreter) on {"context": c} (one device for c = 1) against `reference` at the
    layout's positions; the kernel's calls counted, so a path that fell back to XLA's blockwise
    kernel fails."""
    from replicator._src.sharded import kernels, splash

    h, dh = 4, 8
    keys = jax.random.split(jax.random.key(11), 4)
    q, w = (jax.random.normal(key, (2, seq, h, dh)) for key in keys[:2])
    k, v = (jax.random.normal(key, (2, seq, kv, dh)) for key in keys[2:])
    order = att.zigzag_order(seq, c) if layout == "zigzag" else np.arange(seq)

    def want(q, k, v):
        out = att.reference(q, k, v, causal=causal, positions=order)
        return jnp.sum(out * w), out

    def got(q, k, v, w):
        out = att.attention(q, k, v, causal=causal, impl=impl, layout=layout)
        return jnp.sum(out * w), out

    (_, ref_out), ref_grads = jax.value_and_grad(want, (0, 1, 2), has_aux=True)(q, k, v)
    calls = []
    counted = lambda f: lambda *a, **kw: calls.append(f.__name__) or f(*a, **kw)
    patch = pytest.MonkeyPatch()
    for name in ("attend", "block_forward", "block_backward"):
        patch.setattr(splash, name, counted(getattr(splash, name)))
    repl = make_repl({"data": 1, "context": c}) if c > 1 else make_repl({"data": 1})

    def step(state, q, k, v, w):
        (_, out), grads = jax.value_and_grad(got, (0, 1, 2), has_aux=True)(q, k, v, w)
        return state, {"out": out, "grads": grads}

    with patch.context(), kernels.forced("splash"):
        _, out = repl.run(step, {}, q, k, v, w)
    patch.undo()
    assert rel_err(np.asarray(out["out"])[0], ref_out) <= TOL
    assert rel_err([np.asarray(g)[0] for g in out["grads"]], list(ref_grads)) <= TOL
    return calls


@pytest.mark.parametrize(
    "impl, c, kv, causal, layout, seq",
    [  # one device, the ring's blocks (zigzag halves and whole), Ulysses at zigzag positions
        ("ring", 1, 2, True, "contiguous", 256),
        pytest.param("ring", 2, 2, True, "zigzag", 512, marks=slow),
        pytest.param("ring", 4, 1, False, "contiguous", 512, marks=slow),
        pytest.param("ring", 2, 4, True, "contiguous", 256, marks=slow),
        pytest.param("all_to_all", 2, 2, True, "zigzag", 256, marks=slow),
        pytest.param("all_to_all", 4, 4, False, "contiguous", 256, marks=slow),
    ],
)
def test_splash_kernels_equal_the_reference_on_one_device_and_over_context(
    impl, c, kv, causal, layout, seq
):
    """The Pallas path of every attention: whole sequences (one device; each device after
    the all-to-all, masked at the zigzag positions), and each block of the ring, folded by
    its log-sum-exp forward and differentiated with the global one backward. GQA, causal and
    not; values and gradients to 1e-5."""
    calls = pallas_case(impl, c, kv, causal, layout, seq)
    if impl == "ring" and c > 1:
        assert {"block_forward", "block_backward"} <= set(calls), calls
    else:
        assert "attend" in calls, calls


def test_the_kernel_is_chosen_by_platform(monkeypatch):
    """TPU: splash where its tiles divide; GPU: cuDNN for whole bf16/fp16 sequences in natural
    order (a ring block, fp32 or zigzag positions keep XLA's kernel); CPU: XLA's. On a GPU the
    one-device path calls ``jax.nn.dot_product_attention(implementation="cudnn")``."""
    from replicator._src.sharded import kernels, splash

    pick = lambda platform, **kw: kernels.choose(
        **{"seqs": (1024,), "dtype": jnp.bfloat16, "head_dim": 128, **kw}, platform=platform
    )
    assert pick("tpu") == "splash" and pick("tpu", seqs=(1024, 96)) == "xla"
    assert pick("tpu", head_dim=64) == "xla"
    assert pick("gpu") == "cudnn" and pick("gpu", whole=False) == "xla"
    assert pick("gpu", dtype=jnp.float32) == "xla" and pick("gpu", natural=False) == "xla"
    assert pick("gpu", head_dim=256) == "xla" and pick("cpu") == "xla"
    with kernels.forced("splash"):
        assert pick("cpu") == "splash"
    with pytest.raises(ValueError, match=r"^forced: kernel='flash'; use one of 'xla'"):
        kernels.forced("flash").__enter__()
    seen = []

    def cudnn(q, k, v, *, is_causal, implementation):
        seen.append(implementation)
        return att.reference(q, k, v, causal=is_causal)

    monkeypatch.setattr(splash, "platform", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in qkv_inputs(seq=128))
    att.attention(q, k, v, causal=True)
    assert seen == ["cudnn"]
    att.attention(*(a.astype(jnp.float32) for a in (q, k, v)), causal=True)
    assert seen == ["cudnn"]  # fp32: XLA's kernel


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, name", [({"data": 2, "context": 2}, "ring"),
                                              ({"data": 2, "context": 2}, "all_to_all")])  # fmt: skip
def test_gpt_with_the_splash_kernel_over_context_trains_as_one_device(mesh_shape, name):
    """`replicator.models.gpt` with its attention on the splash kernel (`kernels.forced`: on a
    TPU, the platform's choice), 256 tokens over ``context``: the ring's blocks (128 tokens a
    device) and Ulysses' whole sequences. Three SGD steps equal one device's (XLA's kernel)."""
    from replicator._src.sharded import kernels
    from replicator.models import gpt

    config = gpt.GPTConfig(vocab_size=64, seq_len=256, d_model=32, num_heads=4, num_kv_heads=2,
                           num_layers=1, attention=name, zigzag=False, bias=False)  # fmt: skip
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 64, size=(4, 257)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss = lambda p, b: gpt.loss(p, b["tokens"], b["targets"], config=config)

    def train(repl):
        tx = repl.wrap_optimizer(optax.sgd(0.5))
        params = repl.replicate(gpt.init(config, jax.random.key(0)))
        state, losses = {"params": params, "opt": tx.init(params)}, []

        def step(state, batch):
            params, opt, metrics = tx.step(loss, state["params"], state["opt"], batch)
            return {"params": params, "opt": opt}, {"loss": metrics["loss"]}

        for _ in range(3):
            state, out = repl.run(step, state, batch)
            losses.append(float(np.asarray(out["loss"])[0]))
        return jax.tree.map(np.asarray, state["params"]), np.array(losses)

    want, want_losses = train(make_repl({"data": 1}))
    with kernels.forced("splash"):
        got, losses = train(make_repl(mesh_shape))
    assert rel_err(losses, want_losses) <= TOL
    assert rel_err(got, want) <= TOL
