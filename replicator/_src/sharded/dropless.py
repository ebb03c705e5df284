"""The dropless mixture of experts (``capacity_factor=None``): each expert computes only the
token-choices routed to it, as MaxText's and megablocks' sparse paths do.

**Sorted rows.** A device's token-choices (``[G, k S]`` in priority order, `routing.Choices`)
are sorted by expert, stably, and their tokens gathered into ``[G k S, D]`` rows; each expert's
rows are then one contiguous run of ``group_sizes[e]`` rows, and its MLP is a grouped matmul
(`grouped_matmul`) over its run only: ``k`` rows a token, the ideal FLOPs. The outputs go back
to priority order and are combined with the gates exactly as the capacity path combines its
slots, in the same order of summation.

**Grouped matmul.** On a TPU, ``jax.lax.ragged_dot`` forward and for ``dx`` (the compiler
runs it as a kernel of 128-row tiles whose grid stops at the last row of the last group), and
megablox's ``tgmm`` for ``dw`` (``ragged_dot``'s own transpose there computes every expert on
every row); with a mesh axis of more than one device left to XLA (which cannot partition a
Pallas kernel), and on a GPU, ``ragged_dot`` alone. On XLA:CPU, ``ragged_dot`` computes every
group on every row (``E`` times the work), so the CPU runs a loop over row tiles instead
(megablox's schedule: each tile once per group it meets, at most ``ceil(R / T) + E - 1``
tile-visits), whose FLOPs the compiled program counts.

**Expert parallelism.** Over an ``expert`` axis of ``N`` devices, a device sends each device the
run of rows of that device's experts (``send_sizes``, counted from the sorted rows), and the
counts go first (an ``all_to_all`` of ``[N, E / N]`` ints). The receive buffer has ``N``
chunks of ``R`` rows, one for each sender: every routed row of every device may choose one
device's experts, so nothing smaller drops nothing (MaxText sizes its buffer the same way). The
received rows are sorted again by local expert, run through the grouped matmul, and sent back.
On a TPU the rows travel by ``jax.lax.ragged_all_to_all``, which sends only the routed rows;
XLA:CPU has no ``ragged-all-to-all`` (``UNIMPLEMENTED``; the jax releases: `compat`), so there
(and elsewhere) each chunk travels whole in an ``all_to_all`` (``N`` times the routed rows' bytes).
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from replicator._src.core import binding as binding_lib
from replicator._src.core import collectives
from replicator._src.core.mesh import EXPERT_AXIS
from replicator._src.sharded.routing import Choices

KERNEL_FLOPS = "replicator_kernel_flops_{}"  # read by report/hlo.py, as splash attention's
MAX_TILE = 128  # the TPU kernel's tile of rows


def _platform() -> str:
    return binding_lib.current_binding().platform or jax.default_backend()


def apply(
    experts: dict, x: jax.Array, choices: Choices, *, num_experts: int, activation, n: int
) -> jax.Array:
    """``[G, S, D]``: each token's token-choices' expert outputs times their gates, summed (the
    capacity path's result when nothing is dropped). ``experts``: this device's ``num_experts /
    n`` experts, ``n`` the devices of ``expert``."""
    g, s, d = x.shape
    expert = choices.expert.reshape(-1)  # [R]: group-major, then priority order
    token = (jnp.arange(g, dtype=jnp.int32)[:, None] * s + choices.token).reshape(-1)
    order = jnp.argsort(expert, stable=True)
    rows = x.reshape(g * s, d)[token[order]]  # [R, D], sorted by expert
    sizes = jnp.zeros((num_experts,), jnp.int32).at[expert].add(1)
    if n == 1:
        out = ffn(experts, rows, sizes, activation)
    else:
        out = _expert_parallel(experts, rows, sizes, activation, n)
    out = out[_inverse(order)].reshape(g, -1, d)  # priority order again
    weight = choices.gate.astype(out.dtype)
    return jnp.sum((out * weight[..., None]).reshape(g, -1, s, d), axis=1)


def _num_experts(experts: dict) -> int:
    return experts["up"].shape[0]


def _inverse(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def ffn(experts: dict, rows: jax.Array, sizes: jax.Array, activation) -> jax.Array:
    """Each expert's MLP on its run of ``rows`` (``[R, D]``, sorted by expert, ``sizes[e]``
    rows of expert ``e``; rows past ``sum(sizes)`` give zeros)."""
    ids = jnp.repeat(
        jnp.arange(sizes.shape[0], dtype=jnp.int32), sizes, total_repeat_length=rows.shape[0]
    )
    past = jnp.arange(rows.shape[0]) >= jnp.sum(sizes)
    bias = lambda name: jnp.where(past[:, None], 0, experts[name][ids]) if name in experts else 0
    h = grouped_matmul(rows, experts["up"], sizes) + bias("up_bias")
    if "gate" in experts:
        h = activation(grouped_matmul(rows, experts["gate"], sizes)) * h
    else:
        h = activation(h)
    return grouped_matmul(h, experts["down"], sizes) + bias("down_bias")


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """``[R, N]``: row ``r`` of ``x`` (``[R, K]``) times ``w[e]`` (``w``: ``[E, K, N]``) for
    the group ``e`` whose run of ``sizes`` holds ``r``; zeros past ``sum(sizes)``.

    Equivalent to: ``concatenate([x[o_e:o_e + sizes[e]] @ w[e] for e in range(E)])``.
    """
    platform = _platform()
    if platform == "tpu" and all(size == 1 for size in _left_to_xla().values()):
        return _tpu(x, w, sizes)
    if platform in ("tpu", "gpu"):  # ragged_dot's dw: dense, every group on every row
        return lax.ragged_dot(x, w, sizes)
    return _tiled(x, w, sizes, tile_rows(x.shape[0], w.shape[0]))


def _left_to_xla() -> dict[str, int]:
    """The trace's mesh axes that XLA partitions, and their sizes: a Pallas kernel runs only
    where they are all of size 1, mapped by hand over them."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return {name: size for name, size in sizes.items() if name not in manual}


def _flops_scope(flops: int):
    return jax.named_scope(KERNEL_FLOPS.format(flops))


@jax.custom_vjp
def _tpu(x, w, sizes):
    """The TPU's grouped matmul: the compiler's ``ragged-dot`` kernel forward and for ``dx``,
    megablox's ``tgmm`` (MaxText's kernel) for ``dw``, where ``ragged_dot``'s own transpose
    computes every group on every row. ``dx``'s scope carries ``dw``'s FLOPs too: inside a
    scope, tgmm's index custom calls would be counted as kernels."""
    with _flops_scope(2 * x.shape[0] * x.shape[1] * w.shape[-1]):
        return lax.ragged_dot(x, w, sizes)


def _tpu_fwd(x, w, sizes):
    return _tpu(x, w, sizes), (x, w, sizes)


def _tpu_bwd(res, dy):
    # the kernels' module (the package's name ``gmm`` is the differentiable function)
    megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    x, w, sizes = res
    r, k = x.shape
    with _flops_scope(4 * r * k * w.shape[-1]):  # dx's and dw's
        dx = lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), sizes)
    tm = min(512, r + -r % 128)
    pad = lambda a: jnp.pad(a, ((0, -r % tm), (0, 0)))
    tiling = (tm, min(1024, k), min(1024, w.shape[-1]))
    interpret = _platform() != "tpu"  # off a TPU (the tests): the kernel interpreted
    tgmm = lambda x, dy, sizes: megablox.tgmm(x, dy, sizes, w.dtype, tiling, interpret=interpret)
    if auto := _left_to_xla():  # all of size 1
        replicated = (P(),) * 3
        tgmm = jax.shard_map(tgmm, in_specs=replicated, out_specs=P(), axis_names=set(auto),
                             check_vma=False)  # fmt: skip
    dw = tgmm(pad(x).T, pad(dy), sizes)
    return dx, dw, np.zeros(sizes.shape, jax.dtypes.float0)


_tpu.defvjp(_tpu_fwd, _tpu_bwd)


def tile_rows(rows: int, groups: int) -> int:
    """The tile of the CPU's grouped matmul: a power of two, at most `MAX_TILE`, with the
    ``groups - 1`` tiles that groups may share at most 1/64 of ``rows``.

    >>> tile_rows(1024, 4), tile_rows(2**20, 8), tile_rows(16, 1)
    (4, 128, 16)
    """
    if groups == 1:
        return max(1, min(MAX_TILE, rows))
    room = rows / (64 * (groups - 1))
    return int(min(MAX_TILE, 2 ** max(0, math.floor(math.log2(max(room, 1))))))


def _visits(sizes: jax.Array, rows: int, tile: int):
    """Megablox's schedule: each tile of ``tile`` rows once for each group it holds rows of,
    group by group. ``(group, tile, live)`` of each of the ``ceil(rows / tile) + E - 1`` visits
    (the most there can be); the visits past the last are not live."""
    e = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first, stop = starts // tile, (ends + tile - 1) // tile
    count = jnp.where(sizes > 0, stop - first, 0)
    done = jnp.cumsum(count)
    v = jnp.arange(-(-rows // tile) + e - 1, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(done, v, side="right"), e - 1).astype(jnp.int32)
    live = v < done[-1]
    tile_of = jnp.where(live, first[group] + v - (done - count)[group], 0).astype(jnp.int32)
    return group, tile_of, live, starts, ends


def _tile_loop(x, w, sizes, tile, body_fn, init):
    """Runs ``body_fn(acc, rows_in_group, x_tile, g, t)`` on every live visit (`_visits`),
    skipping the others (``lax.cond``); ``x`` padded to whole tiles."""
    r = x.shape[0]
    pad = -r % tile
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    group, tile_of, live, starts, ends = _visits(sizes, r, tile)

    def step(acc, visit):
        g, t, on = visit
        at = t * tile + jnp.arange(tile)
        mask = (at >= starts[g]) & (at < ends[g])
        x_t = lax.dynamic_slice_in_dim(xp, t * tile, tile)
        run = lambda acc: body_fn(acc, mask, jnp.where(mask[:, None], x_t, 0), g, t)
        return lax.cond(on, run, lambda acc: acc, acc), None

    return lax.scan(step, init, (group, tile_of, live))[0]


def _forward(x, w, sizes, tile):
    r, n = x.shape[0], w.shape[-1]

    def body(out, mask, x_t, g, t):
        y = jnp.dot(x_t, w[g], preferred_element_type=x.dtype)
        cur = lax.dynamic_slice_in_dim(out, t * tile, tile)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mask[:, None], y, cur), t * tile, 0)

    out = jnp.zeros((r + -r % tile, n), x.dtype)
    return _tile_loop(x, w, sizes, tile, body, out)[:r]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x, w, sizes, tile):
    """The CPU's grouped matmul: a loop over row tiles (`_visits`), its backward the same
    loops for ``dx`` and ``dw``."""
    return _forward(x, w, sizes, tile)


def _tiled_fwd(x, w, sizes, tile):
    return _forward(x, w, sizes, tile), (x, w, sizes)


def _tiled_bwd(tile, res, dy):
    x, w, sizes = res
    dx = _forward(dy, jnp.swapaxes(w, 1, 2), sizes, tile)
    dyp = jnp.pad(dy, ((0, -dy.shape[0] % tile), (0, 0)))

    def body(dw, mask, x_t, g, t):
        dy_t = lax.dynamic_slice_in_dim(dyp, t * tile, tile)
        add = jnp.dot(x_t.T, dy_t, preferred_element_type=dw.dtype)
        return dw.at[g].add(add)

    dw = _tile_loop(x, w, sizes, tile, body, jnp.zeros_like(w))
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)
    return dx, dw, zero(sizes)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


# -- over the `expert` axis ----------------------------------------------------------------------


def _expert_parallel(experts, rows, sizes, activation, n):
    """This device's sorted ``rows`` (``[R, D]``, ``sizes`` of each of the E experts) through
    the experts of every device of ``expert`` and back, in the same order."""
    r = rows.shape[0]
    e_local = _num_experts(experts)  # this device's experts
    counts = sizes.reshape(n, e_local)
    send = jnp.sum(counts, axis=1)  # rows for each device
    offsets = jnp.cumsum(send) - send
    got = collectives.all_to_all(counts, EXPERT_AXIS, split=0, concat=0)  # [N senders, E/N]
    recv = jnp.sum(got, axis=1)
    buffer = _send(rows, offsets, send, recv, r, n)  # [N * R, D]: chunk i from device i
    # each chunk holds its sender's rows sorted by expert: the local expert of every row
    ends = jnp.cumsum(got, axis=1)
    at = jnp.arange(r, dtype=jnp.int32)
    local = jax.vmap(lambda e: jnp.searchsorted(e, at, side="right"))(ends).reshape(-1)
    order = jnp.argsort(local, stable=True)  # by local expert, the unused rows last
    out = ffn(experts, buffer[order], jnp.sum(got, axis=0), activation)
    out = out[_inverse(order)]
    back = collectives.all_to_all(offsets[:, None], EXPERT_AXIS, split=0, concat=0)[:, 0]
    return _send_back(out, back, recv, send, r, n)


def _ragged() -> bool:
    """Whether the rows travel by ``ragged_all_to_all``: on a TPU (the one compiled here)."""
    return _platform() == "tpu"


def _send(rows, offsets, send, recv, r, n):
    """``[N * R, D]``: chunk ``i`` holds the ``recv[i]`` rows device ``i`` sent here, then
    zeros; device ``j`` was sent ``rows[offsets[j]:offsets[j] + send[j]]``."""
    me = lax.axis_index(EXPERT_AXIS)
    if _ragged():
        out = jnp.zeros((n * r, rows.shape[1]), rows.dtype)
        where = jnp.full((n,), me * r, jnp.int32)
        return lax.ragged_all_to_all(rows, out, offsets, send, where, recv, axis_name=EXPERT_AXIS)
    at = jnp.arange(r)
    index = offsets[:, None] + at  # [N, R]
    packed = jnp.where((at < send[:, None])[..., None], rows[jnp.minimum(index, r - 1)], 0)
    return collectives.all_to_all(packed, EXPERT_AXIS, split=0, concat=0).reshape(n * r, -1)


def _send_back(out, back, recv, send, r, n):
    """The inverse of `_send`: ``[R, D]``, the rows of ``out``'s chunks returned to their
    senders, in the senders' order (``back[i]``: where device ``i``'s rows for this device
    began among its sorted rows)."""
    if _ragged():
        dest = jnp.zeros((r, out.shape[1]), out.dtype)
        starts = jnp.arange(n, dtype=jnp.int32) * r
        return lax.ragged_all_to_all(out, dest, starts, recv, back, send, axis_name=EXPERT_AXIS)
    chunks = collectives.all_to_all(out.reshape(n, r, -1), EXPERT_AXIS, split=0, concat=0)
    offsets = jnp.cumsum(send) - send
    at = jnp.arange(r)
    device = jnp.searchsorted(jnp.cumsum(send), at, side="right")
    device = jnp.minimum(device, n - 1)
    return chunks[device, at - offsets[device]]
