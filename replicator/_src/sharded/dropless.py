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

**Expert parallelism.** Over an ``expert`` axis of ``N`` devices, each device's sorted rows
go to the devices holding their experts and back in rounds of bounded receive buffers
(`replicator._src.sharded.exchange`): round 0 receives ``receive_factor`` times a device's
routed rows, and what overflows follows in rounds of ``R / 32`` rows until none is left, so
no row is ever dropped and the program's buffers are not sized for every device sending one
device every row. On a TPU the rows travel by ``jax.lax.ragged_all_to_all``; XLA:CPU has no
``ragged-all-to-all``, so there each chunk travels whole in an ``all_to_all``.

**A ``model`` axis.** The experts' hidden units split over ``model`` are mapped by hand
(`_over_model`, Megatron's MLP: one sum over ``model`` after ``down``), so that the grouped
matmuls stay kernels, ``tgmm`` for ``dw`` included.
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
from replicator._src.core.mesh import MODEL_AXIS
from replicator._src.sharded import exchange
from replicator._src.sharded.routing import Choices

KERNEL_FLOPS = "replicator_kernel_flops_{}"  # read by report/hlo.py, as splash attention's
MAX_TILE = 128  # the TPU kernel's tile of rows


def _platform() -> str:
    return binding_lib.current_binding().platform or jax.default_backend()


def apply(
    experts: dict,
    x: jax.Array,
    choices: Choices,
    *,
    num_experts: int,
    activation,
    n: int,
    receive_factor: float = 1.05,
) -> jax.Array:
    """``[G, S, D]``: each token's token-choices' expert outputs times their gates, summed (the
    capacity path's result when nothing is dropped). ``experts``: this device's ``num_experts /
    n`` experts, ``n`` the devices of ``expert``, over which round 0 of the rows' exchange
    receives ``receive_factor`` times a device's routed rows (`exchange`)."""
    g, s, d = x.shape
    expert = choices.expert.reshape(-1)  # [R]: group-major, then priority order
    token = (jnp.arange(g, dtype=jnp.int32)[:, None] * s + choices.token).reshape(-1)
    order = jnp.argsort(expert, stable=True)
    rows = x.reshape(g * s, d)[token[order]]  # [R, D], sorted by expert
    sizes = jnp.zeros((num_experts,), jnp.int32).at[expert].add(1)
    if n == 1:
        out = ffn(experts, rows, sizes, activation)
    else:
        b, b2 = exchange.buffers(rows.shape[0], n, receive_factor)
        mlp = functools.partial(ffn, activation=activation)
        out = exchange.exchange(mlp, experts, rows, sizes, n=n, b=b, b2=b2)
    out = out[_inverse(order)].reshape(g, -1, d)  # priority order again
    weight = choices.gate.astype(out.dtype)
    return jnp.sum((out * weight[..., None]).reshape(g, -1, s, d), axis=1)


def _num_experts(experts: dict) -> int:
    return experts["up"].shape[0]


def _inverse(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def ffn(experts: dict, rows: jax.Array, sizes: jax.Array, activation) -> jax.Array:
    """Each expert's MLP on its run of ``rows`` (``[R, D]``, sorted by expert, ``sizes[e]``
    rows of expert ``e``; rows past ``sum(sizes)`` give zeros). With a ``model`` axis left to
    XLA that divides the hidden units, mapped by hand over it (`_over_model`)."""
    inner = {k: v for k, v in experts.items() if k != "down_bias"}
    m = _left_to_xla().get(MODEL_AXIS, 1)
    if m > 1 and experts["up"].shape[-1] % m == 0:
        out = _over_model(inner, rows, sizes, activation)
    else:
        out = _mlp(inner, rows, sizes, activation)
    return out + _bias(experts, "down_bias", sizes, rows.shape[0])


def _bias(experts: dict, name: str, sizes: jax.Array, r: int):
    """``[R, N]``: each row's expert's bias ``name`` (zeros past ``sum(sizes)``), or 0."""
    if name not in experts:
        return 0
    ids = jnp.repeat(jnp.arange(sizes.shape[0], dtype=jnp.int32), sizes, total_repeat_length=r)
    return jnp.where((jnp.arange(r) >= jnp.sum(sizes))[:, None], 0, experts[name][ids])


def _mlp(experts: dict, rows: jax.Array, sizes: jax.Array, activation) -> jax.Array:
    """`ffn` less its ``down_bias``."""
    h = grouped_matmul(rows, experts["up"], sizes) + _bias(experts, "up_bias", sizes, len(rows))
    if "gate" in experts:
        h = activation(grouped_matmul(rows, experts["gate"], sizes)) * h
    else:
        h = activation(h)
    return grouped_matmul(h, experts["down"], sizes)


_BY_HIDDEN = {"gate": P(None, None, MODEL_AXIS), "up": P(None, None, MODEL_AXIS),
              "up_bias": P(None, MODEL_AXIS), "down": P(None, MODEL_AXIS, None)}  # fmt: skip


def _over_model(experts: dict, rows: jax.Array, sizes: jax.Array, activation) -> jax.Array:
    """`_mlp` with each expert's hidden units split over ``model`` (Megatron's MLP): each
    device its part of ``up`` and ``gate``'s columns and ``down``'s rows; their partial
    outputs summed over ``model`` (by XLA, outside the map). Mapped by hand, so that the
    grouped matmuls stay kernels (XLA cannot partition a Pallas kernel: ``ragged_dot``'s own
    ``dw`` computes every expert densely)."""
    local = lambda experts, rows, sizes: _mlp(experts, rows, sizes, activation)[None]
    specs = ({k: _BY_HIDDEN[k] for k in experts}, P(), P())
    parts = jax.shard_map(local, in_specs=specs, out_specs=P(MODEL_AXIS), axis_names={MODEL_AXIS},
                          check_vma=False)(experts, rows, sizes)  # fmt: skip
    return jnp.sum(parts, axis=0)


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
    with _flops_scope(2 * r * k * w.shape[-1]):  # dx's (dw's below: each kernel its own)
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
    with _flops_scope(2 * r * k * w.shape[-1]):
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
