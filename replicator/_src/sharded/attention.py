"""Attention that is exact across a sequence split over the ``context`` axis.

Inside ``Replicator.run`` the ``context`` axis is left to XLA: ``step_fn`` sees whole sequences,
and a model keeps its activations split along their sequence over ``context`` (`constrain_tokens`).
Everything in a transformer block but attention works token by token, on each device's chunk.
Attention needs every key for every query, and `attention` gets them one of two ways, mapped by
hand over ``context`` (`collectives.map_over`):

* ``impl="ring"`` (ring attention; Liu et al. 2023, Megatron-Core's context parallelism): each
  device keeps its queries, and the key/value blocks travel around the ring of ``C`` devices
  (``C - 1`` sends forward); an online softmax (as in flash attention) folds in one block at a
  time, so no device ever holds more than two blocks. The backward pass sends the blocks round
  again with their gradients. Under a causal mask a block that is all masked is skipped; with
  the ``"zigzag"`` layout device ``c`` holds chunks ``c`` and ``2C - 1 - c`` of ``2C``, so every
  device does the same work at every step. Its memory does not grow with ``C``; it wins on long
  sequences, many heads or few heads alike, and overlaps its sends with compute.
* ``impl="all_to_all"`` (DeepSpeed-Ulysses): one all-to-all turns ``[S / C, H]`` into ``[S,
  H / C]``, each device attends over the whole sequence for its heads, and another turns it
  back. It moves ``4 / C`` of the activations per layer (less than the ring's ``2 (C - 1) / C``
  of K and V alone for ``C > 2``), but needs the heads (per ``model`` device) to divide by
  ``C`` and holds the whole sequence's scores for its heads.

Without a ``context`` axis (or one of size 1) both are plain attention: the one-device oracle.
**Kernels.** Attention runs on the platform's kernel (`kernels.choose`): on a TPU the splash
Pallas kernel (whole sequences, each device's after the all-to-all, masked at the zigzag
positions, and each block of the ring, folded in by its log-sum-exp), on a GPU cuDNN's for whole
sequences, elsewhere XLA's blockwise kernel below (tiles of `TILE` keys, an online softmax).
`kernels.forced` picks one by hand.

**Grouped-query attention.** Keys and values may have fewer heads than the queries (``KV``
dividing ``H``: key/value head ``j`` serves query heads ``j G .. j G + G - 1``, ``G = H / KV``).
They travel with their ``KV`` heads (``G`` times fewer bytes), are repeated one tile at a time
where the scores are made, and their gradients are summed over each group before they go back.

>>> import jax, jax.numpy as jnp
>>> q = k = v = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))   # [batch, seq, heads, dim]
>>> out = attention(q, k, v, causal=True, impl="ring")
>>> bool(jnp.allclose(out, reference(q, k, v, causal=True), atol=1e-6))
True
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from replicator._src.core import collectives
from replicator._src.core.mesh import CONTEXT_AXIS, EXPERT_AXIS, MODEL_AXIS
from replicator._src.sharded import kernels, splash

IMPLS = ("ring", "all_to_all")
LAYOUTS = ("contiguous", "zigzag")
_NEG = -1e30  # a finite "minus infinity": exp() of it is 0, and max() of it stays finite
TILE = 64
"""Queries and keys per tile of the blockwise (online-softmax) attention: a device holds
``TILE x TILE`` scores per sequence and head at a time, so its attention memory is linear in its
part of the sequence, and a causal block skips the tile pairs its mask covers whole."""


def zigzag_order(seq_len: int, parts: int) -> np.ndarray:
    """The positions of a sequence in the ``"zigzag"`` layout, which balances a causal ring.

    Of ``2 * parts`` chunks, part ``c`` holds chunks ``c`` and ``2 * parts - 1 - c``, so under a
    causal mask every part of the ring does the same work. ``x[:, zigzag_order(S, C)]`` lays
    out a ``[B, S, ...]`` sequence; a loss that is a mean over tokens does not change.

    Args:
      seq_len: the sequence length S.
      parts: the ``context`` size C.

    Returns:
      ``[S]`` int positions: the token at each place of the layout.

    Raises:
      ValueError: if ``seq_len`` does not divide into ``2 * parts`` chunks.

    >>> zigzag_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if parts == 1:
        return np.arange(seq_len)
    if seq_len % (2 * parts):
        raise ValueError(
            f"zigzag_order: seq_len={seq_len} must divide into 2 * context = {2 * parts} "
            f"chunks for the zigzag layout; use seq_len a multiple of {2 * parts}, or "
            f"layout='contiguous'."
        )
    chunks = np.arange(seq_len).reshape(2 * parts, -1)
    return np.concatenate(
        [np.concatenate([chunks[c], chunks[2 * parts - 1 - c]]) for c in range(parts)]
    )


def context_size() -> int:
    """The number of devices of the ``context`` axis in the current step (1 outside one)."""
    return collectives.auto_axis_size(CONTEXT_AXIS)


def constrain_tokens(x: jax.Array, width: str | None = None) -> jax.Array:
    """``x`` held split over the token axes: a sharding constraint on activations.

    The sequence goes over ``context`` and the sequences over ``expert``: every activation of a
    block is held in chunks, outside the experts ``expert`` sharing out sequences as data.

    Args:
      x: ``[batch, seq, ...]`` activations, inside a step.
      width: an axis XLA partitions (``model``) to split the last axis over too, if it divides.
    """
    spec = [None] * x.ndim
    if collectives.auto_axis_size(EXPERT_AXIS) > 1:
        spec[0] = EXPERT_AXIS
    if context_size() > 1 and x.ndim > 1:
        spec[1] = CONTEXT_AXIS
    if width and (n := collectives.auto_axis_size(width)) > 1 and x.shape[-1] % n == 0:
        spec[-1] = width
    return x if not any(spec) else lax.with_sharding_constraint(x, P(*spec))


def _widen(x: jax.Array, heads: int) -> jax.Array:
    """Keys or values ``[B, S, KV, D]`` with each head repeated for its ``heads / KV`` query
    heads (grouped-query attention); ``x`` itself when it has ``heads`` heads."""
    group = heads // x.shape[2]
    return x if group == 1 else jnp.repeat(x, group, axis=2)


def _narrow(dx: jax.Array, kv_heads: int) -> jax.Array:
    """The gradient of `_widen`: each group of query heads' gradients summed."""
    b, s, h, d = dx.shape
    return dx if h == kv_heads else dx.reshape(b, s, kv_heads, h // kv_heads, d).sum(3)


def reference(q, k, v, *, causal: bool, positions=None) -> jax.Array:
    """Plain softmax attention over ``[B, S, H, D]`` with fp32 scores: the oracle.

    Args:
      q, k, v: ``[batch, seq, heads, head_dim]``; ``k`` and ``v`` may have fewer heads, a
        divisor of ``q``'s (grouped-query attention).
      causal: each token attends to itself and the tokens before it.
      positions: ``[S]``, each token's place for the causal mask (default ``arange(S)``).

    Returns:
      ``[B, S, H, D]`` in ``v``'s dtype.
    """
    k, v = _widen(k, q.shape[2]), _widen(v, q.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    if causal:
        pos = jnp.arange(q.shape[1]) if positions is None else jnp.asarray(positions)
        logits = jnp.where(pos[:, None] >= pos[None, :], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    impl: str = "ring",
    layout: str = "contiguous",
) -> jax.Array:
    """Softmax attention over a sequence split over the ``context`` axis, exact for any split.

    Args:
      q, k, v: ``[batch, seq, heads, head_dim]``, as ``step_fn`` sees them (whole); ``k`` and
        ``v`` may have fewer heads, a divisor of ``q``'s (grouped-query attention).
      causal: each token attends to itself and the tokens before it.
      impl: ``"ring"`` or ``"all_to_all"`` (see the module's docstring for when each wins).
      layout: the order of the sequence dimension: ``"contiguous"`` (natural order) or
        ``"zigzag"`` (`zigzag_order` for this ``context`` size: a causal ring's balance). The
        output is in the same order.

    Returns:
      ``[B, S, H, D]`` in ``v``'s dtype; equal to `reference` with the layout's positions.

    Raises:
      ValueError: for an unknown ``impl`` or ``layout``; for a sequence that does not divide
        into the context size (``2 C`` chunks for the zigzag layout), or heads per ``model``
        device that ``all_to_all`` cannot split over ``C``.
    """
    if impl not in IMPLS:
        raise ValueError(f"attention: impl={impl!r}; use one of {', '.join(map(repr, IMPLS))}.")
    if layout not in LAYOUTS:
        raise ValueError(
            f"attention: layout={layout!r}; use one of {', '.join(map(repr, LAYOUTS))}."
        )
    c, s, heads = context_size(), q.shape[1], q.shape[2]
    if k.shape != v.shape or heads % k.shape[2]:
        raise ValueError(
            f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape, with a "
            f"number of heads that divides q's {heads} (grouped-query attention)."
        )
    positions = zigzag_order(s, c) if layout == "zigzag" else np.arange(s)
    natural = not causal or kernels.natural(positions)
    if c == 1:  # one device: a kernel, plain attention, or blockwise where it spans tiles
        kernel = kernels.choose(seqs=(s,), dtype=q.dtype, head_dim=q.shape[3], natural=natural)
        whole = functools.partial(kernels.whole, causal=causal, positions=positions, kernel=kernel)
        if kernel == "cudnn":
            return whole(q, k, v)
        if kernel == "splash" and k.shape[2] % collectives.auto_axis_size(MODEL_AXIS):
            k, v = _widen(k, heads), _widen(v, heads)  # K/V heads that cannot split
        mapped = _kernel_by_hand(whole, kernel, q, k, v, None)
        if mapped is not None:
            return mapped(q, k, v)
        if s > TILE:
            return _ring(q, k, v, causal=causal, zigzag=False, positions=positions, ring=False)
        return reference(q, k, v, causal=causal, positions=positions)
    if s % c:
        raise ValueError(
            f"attention: the sequence of {s} tokens does not split over the {c} devices of "
            f"{CONTEXT_AXIS!r}; use a seq_len that divides by {c}, or a smaller context axis."
        )
    t = (
        collectives.auto_axis_size(MODEL_AXIS)
        if heads % collectives.auto_axis_size(MODEL_AXIS) == 0
        else 1
    )
    head_axis = MODEL_AXIS if t > 1 else None
    spec = P(None, CONTEXT_AXIS, head_axis, None)
    kv = k.shape[2]
    if kv % t or (impl == "all_to_all" and (kv // t) % c):  # K/V heads that cannot split
        k, v = _widen(k, heads), _widen(v, heads)
    zigzag = layout == "zigzag" and causal
    if impl == "all_to_all":
        if (heads // t) % c:
            raise ValueError(
                f"attention(impl='all_to_all'): {heads // t} heads per {MODEL_AXIS!r} device do "
                f"not split over the {c} devices of {CONTEXT_AXIS!r}; use impl='ring', or "
                f"num_heads a multiple of {c * t}."
            )
        kernel = kernels.choose(seqs=(s,), dtype=q.dtype, head_dim=q.shape[3], natural=natural)
        body = functools.partial(_all_to_all, causal=causal, positions=positions, kernel=kernel)
    else:
        seqs = (s // c, s // c // 2) if zigzag else (s // c,)
        kernel = kernels.choose(seqs=seqs, dtype=q.dtype, head_dim=q.shape[3], whole=False)
        body = functools.partial(
            _ring, causal=causal, zigzag=zigzag, positions=positions, kernel=kernel
        )
    mapped = _kernel_by_hand(body, kernel, q, k, v, CONTEXT_AXIS)
    if mapped is None:  # XLA's kernels, mapped over `context` and `model` only
        body = functools.partial(body, kernel="xla" if kernel == "splash" else kernel)
        axes = (CONTEXT_AXIS, MODEL_AXIS) if head_axis else (CONTEXT_AXIS,)
        mapped = collectives.map_over(body, in_specs=(spec,) * 3, out_specs=spec, axes=axes)
    return mapped(q, k, v)


def _kernel_by_hand(f, kernel: str, q, k, v, seq_axis):
    """``f`` mapped by hand over every axis left to XLA for the splash kernel (`splash.by_hand`:
    the TPU compiles a Pallas kernel only so), or None for the other kernels, or where the axes
    cannot split the heads or the batch (XLA's kernel then runs instead, as exact)."""
    if kernel != "splash":
        return None
    return splash.by_hand(f, batch=q.shape[0], heads=k.shape[2], layout="bshd",
                          seq_axis=seq_axis)[0]  # fmt: skip


def _all_to_all(q, k, v, *, causal: bool, positions, kernel: str = "xla") -> jax.Array:
    """Ulysses: ``[B, S/C, H, D]`` to ``[B, S, H/C, D]``, attention, and back."""
    to_heads = lambda x: collectives.all_to_all(x, CONTEXT_AXIS, split=2, concat=1)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    if kernel != "xla":  # the whole sequence for this device's heads: the platform's kernel
        out = kernels.whole(q, k, v, causal=causal, positions=positions, kernel=kernel)
    elif q.shape[1] > TILE:  # the whole sequence: blockwise, a tile of keys at a time
        out = _ring(q, k, v, causal=causal, zigzag=False, positions=positions, ring=False)
    else:
        out = reference(q, k, v, causal=causal, positions=positions)
    return collectives.all_to_all(out, CONTEXT_AXIS, split=1, concat=2)


def _ring(q, k, v, *, causal, zigzag, positions, ring=True, kernel="xla") -> jax.Array:
    """One device's part of ring attention: its queries against every key/value block, each
    block by ``kernel`` (``"xla"``: the blockwise kernel; ``"splash"``: the Pallas kernel)."""
    positions = tuple(int(p) for p in positions)
    return _ring_attention(q, k, v, causal, zigzag, positions, ring, kernel == "splash")


# -- ring attention: an online softmax over blocks that travel round the ring --------------------


def _branches(causal: bool, zigzag: bool, sc: int) -> tuple:
    """The work of a ring step whose block comes from an earlier device (first) or a later one
    (second), as static ``(query slice, key slice)`` pairs; None skips the block (all masked).
    The first step (a device's own block) is the diagonal, masked by position."""
    whole, first, second = slice(0, sc), slice(0, sc // 2), slice(sc // 2, sc)
    if not causal:
        return ((whole, whole), (whole, whole))
    if zigzag:  # chunks (c, 2C-1-c) against (j, 2C-1-j): exactly half a block is live
        return ((whole, first), (second, whole))
    return ((whole, whole), None)


def _tile(n: int) -> int:
    """The key/value tile a block is folded in: `TILE` or the largest divisor of ``n`` below it,
    so that the scores held at once are ``queries x tile``, linear in the block."""
    return max(t for t in range(1, min(n, TILE) + 1) if n % t == 0)


def _scores(q, k, qpos, kpos):
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(q.shape[-1]))
    if qpos is None:
        return s
    return jnp.where((qpos[:, None] >= kpos[None, :])[:, None, :], s, _NEG)


def _fold_tile(acc, q, k, v, qpos, kpos):
    o, m, total = acc  # unnormalised output, row maximum, sum of exp(score - maximum)
    k, v = _widen(k, q.shape[2]), _widen(v, q.shape[2])
    s = _scores(q, k, qpos, kpos)
    m_new = jnp.maximum(m, s.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    o = o * alpha[..., None] + jnp.einsum(
        "bqhk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return o, m_new, total * alpha + p.sum(-1)


def _grads_tile(q, k, v, do, lse, delta, qpos, kpos):
    kv = k.shape[2]
    k, v = _widen(k, q.shape[2]), _widen(v, q.shape[2])
    p = jnp.exp(_scores(q, k, qpos, kpos) - lse[..., None])
    f32 = dict(preferred_element_type=jnp.float32)
    dv = jnp.einsum("bqhk,bqhd->bkhd", p.astype(do.dtype), do, **f32)
    dp = jnp.einsum("bqhd,bkhd->bqhk", do, v, **f32)
    ds = p * (dp - delta[..., None]) * (1.0 / math.sqrt(q.shape[-1]))
    dq = jnp.einsum("bqhk,bkhd->bqhd", ds.astype(k.dtype), k, **f32)
    dk = jnp.einsum("bqhk,bqhd->bkhd", ds.astype(q.dtype), q, **f32)
    return dq, _narrow(dk, kv), _narrow(dv, kv)


def _live_pairs(positions: tuple, sc: int, ring: bool) -> list[tuple[int, int]] | None:
    """The (query tile, key tile) pairs of a device's own causal block not all masked, or None
    when every pair is live. A device's own positions increase in both layouts (zigzag's second
    chunk comes after its first), so on a ring every device has one device's pattern."""
    tile = _tile(sc)
    n = sc // tile
    pos = np.asarray(positions[:sc] if ring else positions)
    if ring:
        assert np.all(np.diff(pos) > 0), "a device's own positions increase"
    tiles = pos.reshape(n, tile)
    pairs = [(i, j) for i in range(n) for j in range(n) if tiles[i].max() >= tiles[j].min()]
    return None if len(pairs) == n * n else pairs


def _all_pairs(sq: int, sk: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(sq // _tile(sq)) for j in range(sk // _tile(sk))]


def _fold(acc, q, k, v, qpos=None, kpos=None, pairs=None):
    """Folds one key/value block into the running ``(o, m, l)`` of an online softmax, one
    (query tile, key tile) pair at a time (`TILE` x `TILE` scores held); ``pairs`` (`_live_pairs`)
    leaves out those a causal mask covers whole; ``qpos``/``kpos`` mask causally (None: no)."""
    tq, tk = _tile(q.shape[1]), _tile(k.shape[1])
    pairs = _all_pairs(q.shape[1], k.shape[1]) if pairs is None else pairs
    if len(pairs) == 1:
        return _fold_tile(acc, q, k, v, qpos, kpos)
    take = lambda x, i, t: lax.dynamic_slice_in_dim(x, i * t, t, 1)
    put = lambda x, y, i: lax.dynamic_update_slice_in_dim(x, y, i * tq, 1)
    qp = None if qpos is None else qpos.reshape(-1, tq)
    kp = None if kpos is None else kpos.reshape(-1, tk)

    def body(acc, ij):
        i, j = ij[0], ij[1]
        part = tuple(take(a, i, tq) for a in acc)
        masks = (None, None) if qp is None else (qp[i], kp[j])
        part = _fold_tile(part, take(q, i, tq), take(k, j, tk), take(v, j, tk), *masks)
        return tuple(put(a, p, i) for a, p in zip(acc, part, strict=True)), None

    return lax.scan(body, acc, jnp.asarray(pairs, jnp.int32))[0]


def _block_grads(q, k, v, do, lse, delta, qpos=None, kpos=None, pairs=None):
    """Gradients of one block from the saved log-sum-exp, ``(dq, dk, dv)`` in fp32, over the
    same (query tile, key tile) pairs as `_fold`."""
    tq, tk = _tile(q.shape[1]), _tile(k.shape[1])
    pairs = _all_pairs(q.shape[1], k.shape[1]) if pairs is None else pairs
    if len(pairs) == 1:
        return _grads_tile(q, k, v, do, lse, delta, qpos, kpos)
    take = lambda x, i, t: lax.dynamic_slice_in_dim(x, i * t, t, 1)
    add = lambda x, y, i, t: lax.dynamic_update_slice_in_dim(x, take(x, i, t) + y, i * t, 1)
    qp = None if qpos is None else qpos.reshape(-1, tq)
    kp = None if kpos is None else kpos.reshape(-1, tk)

    def body(carry, ij):
        (dq, dk, dv), i, j = carry, ij[0], ij[1]
        masks = (None, None) if qp is None else (qp[i], kp[j])
        g = _grads_tile(
            take(q, i, tq), take(k, j, tk), take(v, j, tk), take(do, i, tq), take(lse, i, tq),
            take(delta, i, tq), *masks,
        )  # fmt: skip
        return (add(dq, g[0], i, tq), add(dk, g[1], j, tk), add(dv, g[2], j, tk)), None

    zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
    return lax.scan(body, zeros, jnp.asarray(pairs, jnp.int32))[0]


def _own_positions(causal: bool, positions: tuple, sc: int, ring: bool):
    """The positions of this device's tokens (None without a causal mask)."""
    if not causal:
        return None
    pos = jnp.asarray(positions, jnp.int32)
    if not ring:
        return pos
    return lax.dynamic_slice_in_dim(pos, lax.axis_index(CONTEXT_AXIS) * sc, sc)


def _ring_steps(step, carry, causal: bool, zigzag: bool, sc: int):
    """Runs ``step(carry, branch)`` for the blocks of the ``C - 1`` earlier-or-later devices, as
    a scan; ``branch`` is a `_branches` pair, and skipped blocks leave the carry alone."""
    n, c = lax.axis_size(CONTEXT_AXIS), lax.axis_index(CONTEXT_AXIS)
    earlier, later = _branches(causal, zigzag, sc)

    def body(carry, t):
        carry = step(carry, None)  # the send: the next device's block arrives
        pick = lambda b: (lambda x: x) if b is None else functools.partial(step, branch=b)
        if earlier == later:
            return pick(earlier)(carry), None
        j = (c - t) % n
        return lax.cond(j < c, pick(earlier), pick(later), carry), None

    return lax.scan(body, carry, jnp.arange(1, n))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _ring_attention(q, k, v, causal: bool, zigzag: bool, positions: tuple, ring: bool, pallas):
    """Blockwise attention with an online softmax: this device's block, then (``ring``) every
    other device's, sent round the ``context`` axis. Without ``ring``, memory-efficient
    attention on one device (scores held a tile of keys at a time). With ``pallas``, each
    block is the splash kernel's (`kernels.fold`, `kernels.grads`; ``ring`` only)."""
    return _ring_forward(q, k, v, causal, zigzag, positions, ring, pallas)[0]


def _ring_forward(q, k, v, causal, zigzag, positions, ring, pallas):
    b, sc, h, d = q.shape
    o = jnp.zeros((b, sc, h, d), jnp.float32)
    m = jnp.full((b, sc, h), _NEG, jnp.float32)
    acc = (o, m, jnp.zeros_like(m))
    if pallas:  # a device's own positions increase: its own block is causal in its order
        acc = kernels.fold(acc, q, k, v, causal=causal)
    else:
        pos = _own_positions(causal, positions, sc, ring)
        pairs = _live_pairs(positions, sc, ring) if causal else None
        acc = _fold(acc, q, k, v, pos, pos, pairs)

    def step(carry, branch=None):
        acc, kv = carry
        if branch is None:
            return acc, collectives.ring_shift(kv, CONTEXT_AXIS)
        qs, ks = branch
        part = tuple(a[:, qs] for a in acc)
        fold = functools.partial(kernels.fold, causal=False) if pallas else _fold
        part = fold(part, q[:, qs], kv[0][:, ks], kv[1][:, ks])
        return tuple(a.at[:, qs].set(p) for a, p in zip(acc, part, strict=True)), kv

    if ring:
        acc, _ = _ring_steps(step, (acc, (k, v)), causal, zigzag, sc)
    o, m, total = acc
    out = (o / total[..., None]).astype(v.dtype)
    return out, (q, k, v, out, m + jnp.log(total))


def _ring_bwd(causal, zigzag, positions, ring, pallas, residuals, do):
    q, k, v, out, lse = residuals
    sc = q.shape[1]
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)
    if pallas:  # the kernel's backward takes (out, lse, do), delta from them
        dq, dk, dv = kernels.grads(q, k, v, out, lse, do, causal=causal)
    else:
        pos = _own_positions(causal, positions, sc, ring)
        pairs = _live_pairs(positions, sc, ring) if causal else None
        dq, dk, dv = _block_grads(q, k, v, do, lse, delta, pos, pos, pairs)

    def step(carry, branch=None):
        dq, kv, dkv = carry
        if branch is None:  # K, V and the gradients gathered for them travel on together
            return dq, *collectives.ring_shift((kv, dkv), CONTEXT_AXIS)
        qs, ks = branch
        blk = (q[:, qs], kv[0][:, ks], kv[1][:, ks])
        if pallas:
            g = kernels.grads(*blk, out[:, qs], lse[:, qs], do[:, qs], causal=False)
        else:
            g = _block_grads(*blk, do[:, qs], lse[:, qs], delta[:, qs])
        dkv = tuple(a.at[:, ks].add(x) for a, x in zip(dkv, g[1:], strict=True))
        return dq.at[:, qs].add(g[0]), kv, dkv

    if ring:
        dq, _, dkv = _ring_steps(step, (dq, (k, v), (dk, dv)), causal, zigzag, sc)
        dk, dv = collectives.ring_shift(dkv, CONTEXT_AXIS)  # home: each block's owner
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring_attention.defvjp(_ring_forward, _ring_bwd)
