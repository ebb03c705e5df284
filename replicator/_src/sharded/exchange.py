"""Dropless rows over the ``expert`` axis, in rounds of bounded receive buffers.

Device ``i`` of the ``N`` devices of ``expert`` holds ``R`` routed rows sorted by expert, of
which ``M[i, j]`` go to device ``j`` (the holder of their experts). Device ``j`` takes its rows
as one *stream*: device 0's, then device 1's, and so on, ``T_j = sum_i M[i, j]`` rows in all;
the balanced share is ``R``, the most ``N R`` (every row of every device for ``j``'s experts).
Every device gathers the counts of every device's rows of each expert (``[N, E]`` ints, one
``all_gather``), so each knows the whole matrix ``M`` and where its rows fall in each stream.

**Round 0** carries the first ``B = ceil(receive_factor R)`` rows of every stream (`buffers`)
into a buffer of ``B`` rows on the receiver, which sorts them by its local expert, runs its
grouped matmuls on them and sends each row's output back to its sender's place. JAX
differentiates it as any layer, its activations saved (or recomputed under remat).

**Overflow rounds** carry the rest of the streams, ``B2 = ceil(R / 32)`` rows of each a round,
until every stream is done: ``K = max_j ceil(max(0, T_j - B) / B2)`` rounds, the same number on
every device of ``expert`` (they all read the same ``M``). With the load within ``B`` rows a
device, ``K = 0``: no round runs. Its backward (a custom VJP) runs
the same rounds: each sends the rows and their outputs' cotangents, recomputes the experts'
MLP there (``jax.vjp``), adds up the experts' gradients and sends the rows' cotangents back.
The rounds are a scan over the most there can be, each under a ``lax.cond`` that skips it
once every stream is done (`_each_round`).

Equivalent to: ``out[r] = expert_mlp[e(r)](rows[r])`` for every row ``r``, whatever the rounds
(each row goes through its expert once, in exactly one round): the one-device values, on any
routing, including every row of every device choosing one expert (``K = ceil((N R - B) /
B2)`` rounds).

**What the program counts.** Round 0's kernels count ``B`` rows, and the overflow rounds one
round of ``B2`` (how many run is known only at run time; `_each_round`): forward ``B + B2``
rows against ``R`` routed (1.08x at ``receive_factor=1.05``), where a buffer for every
stream's worst case counts ``N R``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from replicator._src.core import binding as binding_lib
from replicator._src.core import collectives, tracing
from replicator._src.core.mesh import EXPERT_AXIS

OVERFLOW_SHARE = 32  # an overflow round carries about R / 32 rows of each stream
ALIGN = 8  # buffers whole sublanes: the TPU compiler runs ragged-dot on others as dense dots


def buffers(rows: int, n: int, receive_factor: float) -> tuple[int, int]:
    """``(B, B2)``: the rows of round 0's receive buffer and of each overflow round's, for
    ``rows`` routed rows a device on ``n`` devices of ``expert``, in multiples of `ALIGN`.
    ``B2`` is 0 where round 0 takes every stream whole (``B >= n rows``).

    >>> buffers(65536, 4, 1.05), buffers(100, 2, 2.0)
    ((68816, 2048), (200, 0))
    """
    align = lambda r: r + -r % ALIGN
    b = align(math.ceil(round(receive_factor * rows, 9)))
    if b >= n * rows:
        return n * rows, 0
    return b, align(-(-rows // OVERFLOW_SHARE))


def exchange(
    ffn: Callable, experts: dict, rows: jax.Array, sizes: jax.Array, *, n: int, b: int, b2: int
) -> jax.Array:
    """``[R, D]``: each of this device's ``rows`` (sorted by expert, ``sizes[e]`` rows of
    expert ``e`` of all ``E``) through its expert's MLP on the device of ``expert`` holding it
    (``ffn(experts, rows, group_sizes)``: this device's ``E / n`` experts on rows sorted by
    them), back in place. Round 0 of ``b`` rows a receiver, then rounds of ``b2`` (module
    docstring)."""
    every = collectives.gather_over_axes(sizes[None], (EXPERT_AXIS,), 0)  # [N, E]
    out = _round(ffn, experts, rows, every, n=n, start=0, cap=b)
    if b2:
        out = out + _overflow(ffn, (n, b, b2), experts, rows, every)
    return out


# -- one round ------------------------------------------------------------------------------------


def _window(every, n, start, cap):
    """``(count, src, dst)``, each ``[N senders, N receivers]``, of the round that carries
    positions ``[start, start + cap)`` of every stream: the rows sender ``i`` sends ``j``, where
    they start among ``i``'s sorted rows, and where they land in ``j``'s buffer."""
    m = jnp.sum(every.reshape(n, n, -1), axis=-1)  # M[i, j]
    at = jnp.cumsum(m, axis=0) - m  # where i's rows start in j's stream
    lo = jnp.clip(at, start, start + cap)
    hi = jnp.clip(at + m, start, start + cap)
    first = jnp.cumsum(m, axis=1) - m  # where i's rows for j start among i's rows
    return hi - lo, first + lo - at, lo - start


def _received(every, me, n, start, cap):
    """``(local, sizes)`` of this device's buffer of the round at ``start``: the local expert
    of each of its ``cap`` rows (``E / n`` past the stream's end) and the rows of each."""
    e_local = every.shape[1] // n
    got = lax.dynamic_slice_in_dim(every, me * e_local, e_local, axis=1)  # [N, E / N]
    ends = jnp.cumsum(jnp.sum(got, axis=1))
    p = start + jnp.arange(cap, dtype=jnp.int32)
    sender = jnp.minimum(jnp.searchsorted(ends, p, side="right"), n - 1)
    q = p - (ends - jnp.sum(got, axis=1))[sender]  # its place among the sender's rows for me
    local = jnp.sum(q[:, None] >= jnp.cumsum(got, axis=1)[sender], axis=1, dtype=jnp.int32)
    local = jnp.where(p < ends[-1], local, e_local)
    return local, jnp.zeros((e_local,), jnp.int32).at[local].add(1, mode="drop")


def _there(rows, win, me, cap, pack):
    """This device's buffer of the round (``[cap, D]``): the rows every sender sends it. With
    ``pack``, a sender first packs its rows for the round together (its operand then ``n cap``
    rows at most, not ``R``)."""
    count, src, dst = (a[me] for a in win)
    if pack and rows.shape[0] > count.shape[0] * cap:
        rows, src = _pack(rows, count, src, count.shape[0] * cap), jnp.cumsum(count) - count
    output = jnp.zeros((cap, rows.shape[1]), rows.dtype)
    return _ragged_all_to_all(rows, output, src, count, dst, win[0][:, me])


def _pack(rows, count, src, length):
    ends = jnp.cumsum(count)
    t = jnp.arange(length, dtype=jnp.int32)
    j = jnp.minimum(jnp.searchsorted(ends, t, side="right"), count.shape[0] - 1)
    at = jnp.clip(src[j] + t - (ends - count)[j], 0, rows.shape[0] - 1)
    return jnp.where((t < ends[-1])[:, None], rows[at], 0)


def _back(out, acc, win, me):
    """``acc`` (``[R, D]``, this device's rows) with the outputs of its rows of the round
    written in place: the inverse of `_there`."""
    count, src, dst = win
    return _ragged_all_to_all(out, acc, dst[:, me], count[:, me], src[:, me], count[me])


def _order(local):
    """The order that sorts a buffer by local expert (stably), and its inverse."""
    order = jnp.argsort(local, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return order, inverse


def _round(ffn, experts, rows, every, *, n, start, cap, pack=False, acc=None):
    """Round 0 (or any one round): ``acc`` (``[R, D]``, zeros by default) with the outputs of
    this device's rows the round carries written in place."""
    me = lax.axis_index(EXPERT_AXIS)
    win = _window(every, n, start, cap)
    local, sizes = _received(every, me, n, start, cap)
    order, inverse = _order(local)
    out = ffn(experts, _there(rows, win, me, cap, pack)[order], sizes)
    return _back(out[inverse], acc if acc is not None else jnp.zeros_like(rows), win, me)


# -- the overflow rounds ------------------------------------------------------------------------


def _each_round(body, init, every, shape, rows):
    """``state = body(start, state)`` for each overflow round, ``start`` its first position in
    the streams: a ``lax.scan`` over the most rounds there can be (``(n R - B) / B2``), each
    under a ``lax.cond`` that runs only while a stream is left (``K`` rounds, the longest
    stream's; the same on every device of ``expert``). The HLO reader counts the conditional
    once (`tracing.runs`): one overflow round, where the balanced load runs none."""
    n, b, b2 = shape
    most = -(-(n * rows - b) // b2)
    over = jnp.maximum(jnp.sum(every.reshape(n, n, -1), axis=(0, 2)) - b, 0)  # each stream's
    k = jnp.max((over + b2 - 1) // b2)

    def step(state, r):
        with tracing.runs(1, most):
            return lax.cond(r < k, lambda s: body(b + r * b2, s), lambda s: s, state), None

    return lax.scan(step, init, jnp.arange(most, dtype=jnp.int32))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _overflow(ffn, shape, experts, rows, every):
    """``[R, D]``: the outputs of this device's rows past round 0, zeros elsewhere."""
    n, _, b2 = shape

    def body(start, acc):
        return _round(ffn, experts, rows, every, n=n, start=start, cap=b2, pack=True, acc=acc)

    return _each_round(body, jnp.zeros_like(rows), every, shape, rows.shape[0])


def _overflow_fwd(ffn, shape, experts, rows, every):
    return _overflow(ffn, shape, experts, rows, every), (experts, rows, every)


def _overflow_bwd(ffn, shape, res, d_out):
    """The rounds again: rows and their cotangents there, the MLP's VJP, cotangents back."""
    n, _, b2 = shape
    experts, rows, every = res
    me = lax.axis_index(EXPERT_AXIS)
    d = rows.shape[1]

    def vjp(both, sizes):
        _, pullback = jax.vjp(lambda w, x: ffn(w, x, sizes), experts, both[:, :d])
        return pullback(both[:, d:])

    def body(start, state):
        d_experts, d_rows = state
        win = _window(every, n, start, b2)
        local, sizes = _received(every, me, n, start, b2)
        both = _there(jnp.concatenate([rows, d_out], axis=1), win, me, b2, pack=True)
        order, inverse = _order(local)
        dw, dx = vjp(both[order], sizes)
        return jax.tree.map(jnp.add, d_experts, dw), _back(dx[inverse], d_rows, win, me)

    init = (jax.tree.map(jnp.zeros_like, experts), jnp.zeros_like(rows))
    d_experts, d_rows = _each_round(body, init, every, shape, rows.shape[0])
    return d_experts, d_rows, np.zeros(every.shape, jax.dtypes.float0)


_overflow.defvjp(_overflow_fwd, _overflow_bwd)


# -- the ragged all-to-all ------------------------------------------------------------------------


def _ragged() -> bool:
    """Whether rows travel by ``jax.lax.ragged_all_to_all``: on a TPU (the one compiled for).
    XLA:CPU has none (``UNIMPLEMENTED``, jax 0.10.2 and 0.12), so there each chunk travels
    whole in an ``all_to_all``."""
    return (binding_lib.current_binding().platform or jax.default_backend()) == "tpu"


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """``jax.lax.ragged_all_to_all`` over ``expert``: ``output`` with, for each device ``i``,
    the ``recv_sizes[i]`` rows it sent here written where it said (its ``output_offsets``);
    this device sends device ``j`` ``operand[input_offsets[j]:][:send_sizes[j]]``. Off a TPU,
    chunks of ``min(len(operand), len(output))`` rows travel whole."""
    if _ragged():
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=EXPERT_AXIS)  # fmt: skip
    c = min(operand.shape[0], output.shape[0])
    t = jnp.arange(c, dtype=jnp.int32)
    at = jnp.clip(input_offsets[:, None] + t, 0, operand.shape[0] - 1)
    chunks = jnp.where((t < send_sizes[:, None])[..., None], operand[at], 0)  # [N, c, D]
    got = collectives.all_to_all(chunks, EXPERT_AXIS, split=0, concat=0)
    where = collectives.all_to_all(output_offsets[:, None], EXPERT_AXIS, split=0, concat=0)
    dest = jnp.where(t < recv_sizes[:, None], where + t, output.shape[0])  # past the end: none
    return output.at[dest.reshape(-1)].set(got.reshape(c * dest.shape[0], -1), mode="drop")
