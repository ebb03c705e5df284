"""A one-device program evaluated on ZeRO shards, its full reductions completed by collectives.

ZeRO keeps each optimizer-state leaf split over the replicas: a leaf of shape ``(*lead, *rest)``
is stored as ``(*lead, N * c)``, the row-major flattening of ``rest`` padded to ``N * c``
elements, and replica ``r`` holds elements ``[r c, (r + 1) c)``. The optimizer itself is written
for whole arrays. This module runs its one-device program (the jaxpr of ``tx.update`` traced on
the real shapes) on those slices, equation by equation:

* element-wise primitives act on the slices as they are;
* a reduction over *all* axes of a sharded value (``sum``, ``max``, ``min``, ``and``, ``or``, and
  a ``dot_general`` that contracts every axis) reduces the replica's slice, with the padding
  masked out, and completes it with an all-reduce: the global norms of clipping, the per-leaf
  trust ratios of LAMB and the block RMS of Adafactor come out as on one device;
* values of one element (scalars, and keep-dims results such as ``f32[1, 1]``) are held whole on
  every replica and computed as on one device;
* calls (``jit``, ``custom_jvp``, ``custom_vjp``) and ``cond`` on a whole predicate recurse.

Anything else on a sharded value (a reduction over some axes only, a transpose, a slice, random
numbers, ...) has no exact meaning on slices. `unsupported` finds the first such equation before
a step runs, and the caller then evaluates the program on whole arrays instead.

Equivalent to (``program`` = the one-device update, ``to_local`` = this replica's slice)::

    to_local(program(*[gather(x) for x in local_inputs]))
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex

from replicator._src import collectives

ELEMENTWISE = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp clz complex conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or population_count pow real reduce_precision rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub
    tan tanh xor
    """.split()
)
_REDUCTIONS = {
    "reduce_sum": ("sum", jnp.sum, 0),
    "reduce_max": ("max", jnp.max, None),
    "reduce_min": ("min", jnp.min, None),
    "reduce_and": ("min", jnp.all, True),
    "reduce_or": ("max", jnp.any, False),
}
UNKNOWN = "?"  # a split of a value the caller cannot tell: a full reduction of it is refused
_OVER_AXES = {
    "sum": collectives.sum_over_axes,
    "max": collectives.max_over_axes,
    "min": collectives.min_over_axes,
}
_UNKNOWN_SPLIT = (
    "a full reduction of a gradient that may be a pipeline stage block (pass the parameters "
    "as step_fn received them: opt.update(grads, state['opt'], state['params']))"
)
_RESHAPES = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim"})
_CALLS = {"jit": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


def chunk(size: int, n: int, multiple: int = 1) -> int:
    """Elements per replica of a leaf of ``size`` elements split over ``n``, a multiple of
    ``multiple`` (the devices each replica's slice is split over further, such as ``model``)."""
    return multiple * max(1, math.ceil(size / (n * multiple)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How values of each real shape are held on a replica.

    A shape of one element is held whole. Any other shape ``s`` is sharded with
    ``leads.get(s, 0)`` leading axes kept (ZeRO-3's stacked layers) and the rest flattened,
    padded and split over ``n`` replicas, ``multiple`` dividing each slice. A shape in
    ``splits`` is one device's block of a value split over other manual mesh axes as well
    (a pipeline's stage blocks): a full reduction of it is completed over those axes too.
    """

    n: int
    leads: tuple[tuple[tuple[int, ...], int], ...] = ()
    multiple: int = 1
    splits: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...] = ()

    def lead(self, shape: Sequence[int]) -> int:
        return dict(self.leads).get(tuple(shape), 0)

    def split(self, shape: Sequence[int]) -> tuple[str, ...]:
        """The mesh axes, besides the replicas, that values of ``shape`` are split over."""
        return dict(self.splits).get(tuple(shape), ())

    @staticmethod
    def whole(shape: Sequence[int]) -> bool:
        return math.prod(shape) == 1

    def chunk(self, shape: Sequence[int]) -> int:
        return chunk(math.prod(shape[self.lead(shape) :]), self.n, self.multiple)

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        if self.whole(shape):
            return tuple(shape)
        return (*shape[: self.lead(shape)], self.chunk(shape))

    def global_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The stored (padded, flattened) shape of a sharded leaf of real ``shape``."""
        return (*shape[: self.lead(shape)], self.n * self.chunk(shape))

    def flat_padded(self, x: jax.Array) -> jax.Array:
        """A whole array of real shape in its stored layout (padded with zeros)."""
        lead = self.lead(x.shape)
        flat = jnp.reshape(x, (*x.shape[:lead], -1))
        pad = self.n * self.chunk(x.shape) - flat.shape[-1]
        return jnp.pad(flat, [(0, 0)] * lead + [(0, pad)])

    def to_local(self, x: jax.Array) -> jax.Array:
        """This replica's slice of a whole array (which every replica holds)."""
        if self.whole(x.shape):
            return x
        c = self.chunk(x.shape)
        flat = self.flat_padded(x)
        # [..., N, c] indexed by replica: no offset r * c, which overflows int32 past 2**31.
        blocks = flat.reshape((*flat.shape[:-1], self.n, c))
        return lax.dynamic_index_in_dim(blocks, collectives.replica_id(), flat.ndim - 1, False)

    def to_real(self, local: jax.Array, shape: Sequence[int]) -> jax.Array:
        """The whole array of real ``shape`` from every replica's slice (an all-gather)."""
        shape = tuple(shape)
        if self.whole(shape) and local.shape == shape:
            return local
        if self.whole(shape):  # a one-element leaf stored sharded: replica 0 holds it
            first = jnp.where(collectives.replica_id() == 0, local, jnp.zeros_like(local))
            return collectives.all_reduce(jnp.reshape(first, (-1,))[:1], "sum").reshape(shape)
        full = collectives.all_gather(local, axis=local.ndim - 1, tiled=True)
        lead = self.lead(shape)
        return full[..., : math.prod(shape[lead:])].reshape(shape)

    def mask(self, shape: Sequence[int]) -> jax.Array:
        """True where this replica's slice of a value of real ``shape`` holds real elements."""
        c = self.chunk(shape)
        size = math.prod(shape[self.lead(shape) :])
        # Real elements per replica, from Python ints: r * c overflows int32 past 2**31.
        counts = np.clip(size - np.arange(self.n, dtype=np.int64) * c, 0, c).astype(np.int32)
        return jnp.arange(c) < jnp.asarray(counts)[collectives.replica_id()]


def stored_local(layout: Layout, real_shape: Sequence[int], stored: jax.Array) -> jax.Array:
    """A replica's stored slice as the evaluator holds it: one-element leaves become whole."""
    if layout.whole(real_shape) and tuple(stored.shape) != tuple(real_shape):
        return layout.to_real(stored, real_shape)
    return stored


def as_stored(layout: Layout, value: jax.Array, stored_shape: Sequence[int]) -> jax.Array:
    """A value the evaluator holds, in the stored slice shape (a whole one-element value is
    copied into every replica's slot; only replica 0's counts)."""
    if tuple(value.shape) == tuple(stored_shape):
        return value
    return jnp.broadcast_to(jnp.reshape(value, ()), stored_shape).astype(value.dtype)


def unsupported(closed: jex.ClosedJaxpr, layout: Layout) -> str | None:
    """Why ``closed`` cannot be evaluated on shards, or None if it can."""
    return _check_jaxpr(closed.jaxpr, layout)


def evaluate(closed: jex.ClosedJaxpr, layout: Layout, *local_args: jax.Array) -> list[jax.Array]:
    """Runs ``closed`` (traced on real shapes) on this replica's slices ``local_args``.

    Each argument is held as `Layout` says for its real shape. Call `unsupported` first.
    """
    consts = [_const_local(layout, c) for c in closed.consts]
    return _eval_jaxpr(closed.jaxpr, layout, consts, list(local_args))


# -- the rules --------------------------------------------------------------------------------


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _check_jaxpr(jaxpr: jex.Jaxpr, layout: Layout) -> str | None:
    for eqn in jaxpr.eqns:
        reason = _check_eqn(eqn, layout)
        if reason:
            return reason
    return None


def _check_eqn(eqn, layout: Layout) -> str | None:
    name = eqn.primitive.name
    ins = [_shape(v) for v in eqn.invars]
    outs = [_shape(v) for v in eqn.outvars]
    if all(layout.whole(s) for s in ins + outs):
        return None  # whole values only: computed as on one device
    if name in _CALLS:
        return _check_jaxpr(eqn.params[_CALLS[name]].jaxpr, layout)
    if name == "cond":
        if not layout.whole(ins[0]):
            return _describe(eqn, "a condition on a sharded value")
        for branch in eqn.params["branches"]:
            reason = _check_jaxpr(branch.jaxpr, layout)
            if reason:
                return reason
        return None
    if name in ELEMENTWISE:
        sharded = {s for s in ins + outs if not layout.whole(s)}
        if len(sharded) == 1 and all(s == () or s in sharded for s in ins + outs):
            return None
        return _describe(eqn, "an element-wise operation between different shapes")
    if name in _REDUCTIONS or name == "dot_general":
        if UNKNOWN in layout.split(ins[0]):
            return _describe(eqn, _UNKNOWN_SPLIT)
    if name in _REDUCTIONS:
        (shape,) = ins
        if tuple(eqn.params["axes"]) == tuple(range(len(shape))):
            return None
        return _describe(eqn, f"a reduction over axes {tuple(eqn.params['axes'])} only")
    if name == "dot_general":
        (contract, batch) = eqn.params["dimension_numbers"]
        full = tuple(range(len(ins[0])))
        if ins[0] == ins[1] and tuple(contract[0]) == full == tuple(contract[1]) and not batch[0]:
            return None
        return _describe(eqn, "a dot product that does not contract every axis")
    if name in _RESHAPES:
        (src, *_), (dst,) = ins, outs
        if layout.whole(src) and name == "broadcast_in_dim":
            return None  # a whole value broadcast to a sharded shape
        same = math.prod(src) == math.prod(dst) and layout.lead(src) == layout.lead(dst) == 0
        if same and not layout.whole(dst) and layout.split(src) == layout.split(dst):
            return None  # the same row-major elements: the same slices
        return _describe(eqn, f"a change of shape from {src} to {dst}")
    return _describe(eqn, f"the operation {name!r}")


def _describe(eqn, what: str) -> str:
    shapes = ", ".join(f"{v.aval.str_short()}" for v in eqn.invars if hasattr(v, "aval"))
    where = _user_frame(eqn)
    return f"{what} ({eqn.primitive.name} of {shapes}{', at ' + where if where else ''})"


def _user_frame(eqn) -> str:
    """The innermost frame of the traceback outside JAX itself, e.g. ``.../factorized.py:120``."""
    try:
        frames = eqn.source_info.traceback.frames
    except AttributeError:
        return ""
    jax_dir = os.path.dirname(jax.__file__)
    for frame in frames:
        if not frame.file_name.startswith(jax_dir):
            parts = frame.file_name.split(os.sep)
            return f"{os.sep.join(parts[-3:])}:{frame.line_num} ({frame.function_name})"
    return ""


def _const_local(layout: Layout, c: Any) -> Any:
    shape = tuple(jnp.shape(c))
    return c if layout.whole(shape) else layout.to_local(jnp.asarray(c))


def _eval_jaxpr(jaxpr: jex.Jaxpr, layout: Layout, consts: list, args: list) -> list:
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        outs = _eval_eqn(eqn, layout, [read(v) for v in eqn.invars])
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jex.DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _eval_closed(closed, layout: Layout, args: list) -> list:
    consts = [_const_local(layout, c) for c in closed.consts]
    return _eval_jaxpr(closed.jaxpr, layout, consts, args)


def _bind(eqn, args: list) -> list:
    out = eqn.primitive.bind(*args, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _eval_eqn(eqn, layout: Layout, args: list) -> list:
    name = eqn.primitive.name
    ins = [_shape(v) for v in eqn.invars]
    outs = [_shape(v) for v in eqn.outvars]
    if name in _CALLS:
        return _eval_closed(eqn.params[_CALLS[name]], layout, args)
    if name == "cond":
        index, *operands = args
        branches = [
            (lambda *ops, b=b: _eval_closed(b, layout, list(ops))) for b in eqn.params["branches"]
        ]
        return list(lax.switch(jnp.reshape(index, ()), branches, *operands))
    if all(layout.whole(s) for s in ins + outs):
        return _bind(eqn, args)
    if name in ELEMENTWISE:
        return _bind(eqn, args)
    if name in _REDUCTIONS:
        return [_reduce(name, layout, ins[0], args[0], eqn.outvars[0].aval.dtype)]
    if name == "dot_general":
        (a, b), dtype = args, eqn.outvars[0].aval.dtype
        return [_reduce("reduce_sum", layout, ins[0], a.astype(dtype) * b.astype(dtype), dtype)]
    if name in _RESHAPES:
        (x, *_), (dst,) = args, outs
        if layout.whole(ins[0]):
            return [jnp.broadcast_to(jnp.reshape(x, ()), layout.local_shape(dst))]
        return [x]
    raise AssertionError(f"sharded_eval: {name} should have been refused by unsupported()")


def _reduce(name: str, layout: Layout, shape, x: jax.Array, dtype) -> jax.Array:
    op, local_reduce, identity = _REDUCTIONS[name]
    if identity is None:  # max/min: the padding must not win
        info = jnp.finfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.iinfo(x.dtype)
        identity = info.min if name == "reduce_max" else info.max
    kept = jnp.where(layout.mask(shape), x, jnp.asarray(identity, x.dtype))
    partial = local_reduce(kept).astype(dtype)
    as_int = jnp.dtype(dtype) == jnp.bool_
    out = collectives.all_reduce(partial.astype(jnp.int32) if as_int else partial, op)
    out = _OVER_AXES[op](out, layout.split(shape))  # a stage block: the other blocks too
    return out.astype(jnp.bool_) if as_int else out
