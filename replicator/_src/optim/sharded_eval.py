"""A one-device program evaluated on ZeRO shards, each value in its own shape.

ZeRO keeps every optimizer-state leaf in the shape of the parameter it belongs to, with one axis
split over the replicas (and, for a pipeline's stage block, another over ``stage``). The
optimizer is written for whole arrays. This module runs its one-device program (the jaxpr of
``tx.update`` traced on the whole leaves' shapes) on each device's parts, equation by equation,
and knows for every value which axes are split: its `Split`.

* Element-wise operations act on the parts as they are; a whole operand of a split value's
  shape is cut to this device's part (no communication).
* A reduction over axes that do not include a split axis runs on the parts, and its result
  stays split (Adafactor's column statistics when the rows are split); one over a split axis
  reduces the part and completes it with an all-reduce over the replicas (or the stages): the
  row statistics, global norms, LAMB's trust ratio. Shape-dependent constants (a mean's
  ``1 / size``) are those of the whole leaf, as the program was traced on it.
* ``dot_general`` contracts split axes the same way; transposes, reshapes that keep a split
  axis as the major axis of its group, broadcasts, squeezes, slices, pads and cumulative
  operations along other axes follow the split axes; calls (``jit``, ``custom_jvp``,
  ``custom_vjp``, ``checkpoint``) and ``cond`` recurse.
* Anything else on a split value (a sort or a cumulative sum along a split axis, a loop, an
  indexing ``gather``) gathers its operands over the replicas and stages and runs on whole
  arrays: exact, and `evaluate` notes each such equation, so that ``Zero.plan`` can say which.

Equivalent to (``program`` = the one-device update, ``part`` = this device's part)::

    part(program(*[gather(x) for x in inputs]))
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex

from replicator._src.optim.shards import GROUPS, WHOLE, Comm, Split, local_shape

ELEMENTWISE = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp clz complex conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or polygamma population_count pow real reduce_precision rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub
    tan tanh xor igamma igammac bessel_i0e bessel_i1e
    """.split()
)
_REDUCTIONS = {  # name -> the collective that completes it
    "reduce_sum": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
    "reduce_and": "min",
    "reduce_or": "max",
}
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_CALLS = {"jit": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


@dataclasses.dataclass
class _Val:
    x: Any  # this device's part (a jax array, or a Python scalar for literals)
    split: Split


def evaluate(
    closed: jex.ClosedJaxpr, comm: Comm, args: Sequence[tuple[Any, Split]]
) -> tuple[list[tuple[Any, Split]], list[str]]:
    """Runs ``closed`` (traced on real shapes) on this device's parts.

    Args:
      closed: the one-device program.
      comm: the collectives to use (`Comm`).
      args: ``(part, split)`` for each input of ``closed``.

    Returns:
      ``(outputs, gathered)``: ``(part, split)`` for each output, and a description of each
      equation that gathered a split value to run on whole arrays.
    """
    ev = _Evaluator(comm)
    vals = [_Val(x, s) for x, s in args]
    outs = ev.run(closed.jaxpr, [_Val(c, WHOLE) for c in closed.consts], vals)
    return [(v.x, v.split) for v in outs], ev.gathered


def convert(x: Any, have: Split, want: Split, comm: Comm) -> Any:
    """A device's part ``x`` of a value split as ``have``, as split by ``want`` instead."""
    return _Evaluator(comm).to(_Val(x, have), want).x


def analyze(
    closed: jex.ClosedJaxpr, comm: Comm, splits: Sequence[Split]
) -> tuple[list[Split], list[str]]:
    """The split of each output of ``closed`` given its inputs' ``splits``, and the equations
    that would gather: `evaluate` on shapes only, nothing computed or communicated."""
    comm = dataclasses.replace(comm, abstract=True)
    found: list = []

    def run(*parts):
        outs, gathered = evaluate(closed, comm, list(zip(parts, splits, strict=True)))
        found.append(([s for _, s in outs], gathered))
        return [x for x, _ in outs]

    avals = [
        jax.ShapeDtypeStruct(local_shape(v.aval.shape, s, comm), v.aval.dtype)
        for v, s in zip(closed.jaxpr.invars, splits, strict=True)
    ]
    jax.eval_shape(run, *avals)
    return found[0]


# -- the rules --------------------------------------------------------------------------------


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


class _Evaluator:
    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.gathered: list[str] = []

    def run(self, jaxpr: jex.Jaxpr, consts: list[_Val], args: list[_Val]) -> list[_Val]:
        env: dict = {}

        def read(v) -> _Val:
            return _Val(v.val, WHOLE) if isinstance(v, jex.Literal) else env[v]

        for var, val in zip(jaxpr.constvars, consts, strict=True):
            env[var] = val
        for var, val in zip(jaxpr.invars, args, strict=True):
            env[var] = val
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars])
            for var, val in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jex.DropVar):
                    env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def to(self, v: _Val, want: Split, eqn=None, shape: Sequence[int] = ()) -> _Val:
        """``v`` split as ``want``: gathered along the axes it must not be split along (noted
        against ``eqn``), then cut along the others. An axis of size 1 in ``shape`` (an operand
        that lax broadcasts along it) stays whole."""
        x, now = v.x, {g: v.split.of(g) for g in GROUPS}
        for group in GROUPS:
            if now[group] is not None and now[group] != want.of(group):
                x, now[group] = self.comm.gather(x, now[group], group), None
                if eqn is not None:
                    self.note(eqn, "a value split along another axis")
        for group in GROUPS:
            dim = want.of(group)
            if dim is not None and now[group] is None and not (shape and shape[dim] == 1):
                x, now[group] = self.comm.part(x, dim, group), dim
        return _Val(x, Split(**now))

    def note(self, eqn, what: str) -> None:
        self.gathered.append(describe(eqn, what))

    def whole(self, eqn, ins: list[_Val], what: str) -> list:
        """The operands made whole, for an equation that has no rule on parts."""
        if any(v.split != WHOLE for v in ins):
            self.note(eqn, what)
        return [self.to(v, WHOLE).x for v in ins]

    def eqn(self, eqn, ins: list[_Val]) -> list[_Val]:
        name = eqn.primitive.name
        if all(v.split == WHOLE for v in ins):
            return [_Val(x, WHOLE) for x in _bind(eqn, [v.x for v in ins])]
        if name in _CALLS:
            closed = eqn.params[_CALLS[name]]
            return self.run(closed.jaxpr, [_Val(c, WHOLE) for c in closed.consts], ins)
        if name in ("remat2", "checkpoint"):
            return self.run(eqn.params["jaxpr"], [], ins)
        rule = _RULES.get(name)
        if rule is None and name in ELEMENTWISE:
            rule = _elementwise
        if rule is None and name in _REDUCTIONS:
            rule = _reduction
        if rule is None and name in _CUMULATIVE:
            rule = _along_other_axes(lambda e: (e.params["axis"],))
        if rule is not None:
            out = rule(self, eqn, ins)
            if out is not None:
                return out
        args = self.whole(eqn, ins, f"the operation {name!r}")
        return [_Val(x, WHOLE) for x in _bind(eqn, args)]


def _bind(eqn, args: list, **params) -> list:
    out = eqn.primitive.bind(*args, **{**eqn.params, **params})
    return list(out) if eqn.primitive.multiple_results else [out]


def _common(ins: list[_Val], big: list[int]) -> Split | None:
    """The split of the first split operand along each group; None if the data and stage
    splits would fall on one axis."""
    dims = {}
    for group in GROUPS:
        found = [ins[i].split.of(group) for i in big if ins[i].split.of(group) is not None]
        dims[group] = found[0] if found else None
    if dims["data"] is not None and dims["data"] == dims["stage"]:
        return None
    return Split(**dims)


def _elementwise(ev: _Evaluator, eqn, ins: list[_Val]):
    """Operands of the output's shape, scalars, or (as lax broadcasts) of its rank with size-1
    axes, which stay whole along a split axis; the others are cut to this part."""
    shapes = [_shape(v) for v in eqn.invars]
    big = [i for i, s in enumerate(shapes) if s != ()]
    want = _common(ins, big)
    if want is None:
        return None
    args = [ev.to(v, want, eqn, shapes[i]).x if i in big else v.x for i, v in enumerate(ins)]
    return [_Val(x, want) for x in _bind(eqn, args)]


def _drop(dim, axes) -> Any:
    """Where axis ``dim`` goes once ``axes`` are reduced away (None if it is one of them)."""
    if dim is None or dim in axes:
        return None
    return dim - sum(a < dim for a in axes)


def _reduction(ev: _Evaluator, eqn, ins: list[_Val]):
    (v,) = ins
    axes = tuple(eqn.params["axes"])
    op = _REDUCTIONS[eqn.primitive.name]
    (out,) = _bind(eqn, [v.x])
    as_int = out.dtype == jnp.bool_
    if as_int:
        out = out.astype(jnp.int32)
    for group in GROUPS:
        if v.split.of(group) in axes:
            out = ev.comm.reduce(out, op, group)
    if as_int:
        out = out.astype(jnp.bool_)
    return [_Val(out, Split(_drop(v.split.data, axes), _drop(v.split.stage, axes)))]


def _arg_reduction(ev: _Evaluator, eqn, ins: list[_Val]):  # argmax, argmin
    (v,) = ins
    axes = tuple(eqn.params["axes"])
    if v.split.data in axes or v.split.stage in axes:
        return None
    (out,) = _bind(eqn, [v.x])
    return [_Val(out, Split(_drop(v.split.data, axes), _drop(v.split.stage, axes)))]


def _dot_general(ev: _Evaluator, eqn, ins: list[_Val]):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    lhs, rhs = ins
    nl, nr = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    l_free = [i for i in range(nl) if i not in lc and i not in lb]
    r_free = [i for i in range(nr) if i not in rc and i not in rb]

    def out_pos(side: str, dim: int) -> int:
        if side == "l":
            return lb.index(dim) if dim in lb else len(lb) + l_free.index(dim)
        return rb.index(dim) if dim in rb else len(lb) + len(l_free) + r_free.index(dim)

    def partner(side: str, dim: int) -> int:
        pairs = ((lc, rc), (lb, rb)) if side == "l" else ((rc, lc), (rb, lb))
        for a, b in pairs:
            if dim in a:
                return b[a.index(dim)]
        raise AssertionError

    def pair(group: str):
        """(lhs split, rhs split, reduced over the group, output split) along ``group``:
        paired axes split alike, at most one free axis split."""
        dl, dr = lhs.split.of(group), rhs.split.of(group)
        if dl is not None and dl not in l_free:
            return dl, partner("l", dl), dl in lc, None if dl in lc else out_pos("l", dl)
        if dr is not None and dr not in r_free:
            return partner("r", dr), dr, dr in rc, None if dr in rc else out_pos("r", dr)
        if dl is not None:
            return dl, None, False, out_pos("l", dl)
        if dr is not None:
            return None, dr, False, out_pos("r", dr)
        return None, None, False, None

    (ld, rd, red_d, out_d), (ls, rs, red_s, out_s) = pair("data"), pair("stage")
    if (ld is not None and ld == ls) or (rd is not None and rd == rs):
        return None
    if out_d is not None and out_d == out_s:
        return None
    lx = ev.to(lhs, Split(ld, ls), eqn).x
    rx = ev.to(rhs, Split(rd, rs), eqn).x
    (out,) = _bind(eqn, [lx, rx])
    if red_d:
        out = ev.comm.reduce(out, "sum", "data")
    if red_s:
        out = ev.comm.reduce(out, "sum", "stage")
    return [_Val(out, Split(out_d, out_s))]


def _moved(split: Split, move) -> Split:
    return Split(*(None if d is None else move(d) for d in (split.data, split.stage)))


def _transpose(ev: _Evaluator, eqn, ins: list[_Val]):
    (v,) = ins
    perm = tuple(eqn.params["permutation"])
    (out,) = _bind(eqn, [v.x])
    return [_Val(out, _moved(v.split, perm.index))]


def _regroup(src: Sequence[int], dst: Sequence[int], dim: int) -> int | None:
    """The axis of ``dst`` that axis ``dim`` of ``src`` becomes in a row-major reshape, when
    it is the major axis of its group (the axes of ``src`` and ``dst``, size-1 axes aside, whose
    sizes multiply to the same number); None when it is not, or has size 1."""
    a = [i for i, n in enumerate(src) if n != 1]
    b = [j for j, n in enumerate(dst) if n != 1]
    if dim not in a:
        return None
    i = j = 0
    while i < len(a) and j < len(b):
        head_i, head_j = a[i], b[j]
        ps, pd = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd and i < len(a):
                ps, i = ps * src[a[i]], i + 1
            elif pd < ps and j < len(b):
                pd, j = pd * dst[b[j]], j + 1
            else:
                return None
        if head_i == dim:
            return head_j
        if dim in a[:i]:
            return None  # inside a group, not its major axis
    return None


def _reshape(ev: _Evaluator, eqn, ins: list[_Val]):
    v = ins[0]
    if eqn.params.get("dimensions") is not None or len(ins) > 1:
        return None
    src, dst = _shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    dims = {}
    for group in GROUPS:
        d = v.split.of(group)
        out = None if d is None else _regroup(src, dst, d)
        if d is not None and (out is None or dst[out] % ev.comm.size(group)):
            return None
        dims[group] = out
    split = Split(**dims)
    (out,) = _bind(eqn, [v.x], new_sizes=local_shape(dst, split, ev.comm))
    return [_Val(out, split)]


def _broadcast_in_dim(ev: _Evaluator, eqn, ins: list[_Val]):
    v = ins[0]
    if len(ins) > 1:
        return None
    dst, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
    split = _moved(v.split, lambda d: dims[d])
    (out,) = _bind(eqn, [v.x], shape=local_shape(dst, split, ev.comm))
    return [_Val(out, split)]


def _squeeze(ev: _Evaluator, eqn, ins: list[_Val]):
    (v,) = ins
    dims = tuple(d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
    (out,) = _bind(eqn, [v.x])
    return [_Val(out, Split(_drop(v.split.data, dims), _drop(v.split.stage, dims)))]


def _along_other_axes(axes_of):
    """A rule for an operation along some axes (``axes_of(eqn)``) whose operands and outputs
    have one rank: it acts on the parts when no split axis is among them."""

    def rule(ev: _Evaluator, eqn, ins: list[_Val]):
        axes = axes_of(eqn)
        shapes = [_shape(v) for v in eqn.invars]
        big = [i for i, s in enumerate(shapes) if s != ()]
        want = _common(ins, big)
        if want is None or want.data in axes or want.stage in axes:
            return None
        if any(len(_shape(o)) != len(shapes[big[0]]) for o in eqn.outvars):
            return None
        args = [ev.to(v, want, eqn).x if i in big else v.x for i, v in enumerate(ins)]
        return [_Val(x, want) for x in _bind(eqn, args)]

    return rule


def _slice(ev: _Evaluator, eqn, ins: list[_Val]):
    (v,) = ins
    shape = _shape(eqn.invars[0])
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"] or (1,) * len(shape)
    whole = lambda a: a is None or (start[a] == 0 and limit[a] == shape[a] and strides[a] == 1)
    if not (whole(v.split.data) and whole(v.split.stage)):
        return None
    (out,) = _bind(eqn, [v.x], limit_indices=local_shape(limit, v.split, ev.comm))
    return [_Val(out, v.split)]


def _pad(ev: _Evaluator, eqn, ins: list[_Val]):
    v, pad_value = ins
    config = eqn.params["padding_config"]
    untouched = lambda a: a is None or tuple(config[a]) == (0, 0, 0)
    if pad_value.split != WHOLE or not (untouched(v.split.data) and untouched(v.split.stage)):
        return None
    (out,) = _bind(eqn, [v.x, pad_value.x])
    return [_Val(out, v.split)]


def _cond(ev: _Evaluator, eqn, ins: list[_Val]):
    index, *ops = ins
    if index.split != WHOLE:
        return None
    branches = eqn.params["branches"]
    in_splits = [v.split for v in ops]
    # each branch's output splits, found on shapes; where they differ the outputs are whole
    found = [analyze(b, ev.comm, in_splits) for b in branches]
    outs = []
    for k in range(len(eqn.outvars)):
        splits = {f[0][k] for f in found}
        outs.append(splits.pop() if len(splits) == 1 else WHOLE)
    for f in found:
        ev.gathered.extend(f[1])

    def branch(b):
        def run(*xs):
            inner = _Evaluator(ev.comm)
            vals = [_Val(x, s) for x, s in zip(xs, in_splits, strict=True)]
            res = inner.run(b.jaxpr, [_Val(c, WHOLE) for c in b.consts], vals)
            return [jnp.asarray(inner.to(r, o).x) for r, o in zip(res, outs, strict=True)]

        return run

    results = lax.switch(
        jnp.reshape(index.x, ()), [branch(b) for b in branches], *[v.x for v in ops]
    )
    return [_Val(x, s) for x, s in zip(results, outs, strict=True)]


_RULES = {
    "argmax": _arg_reduction,
    "argmin": _arg_reduction,
    "dot_general": _dot_general,
    "transpose": _transpose,
    "reshape": _reshape,
    "broadcast_in_dim": _broadcast_in_dim,
    "squeeze": _squeeze,
    "slice": _slice,
    "pad": _pad,
    "rev": _along_other_axes(lambda e: tuple(e.params["dimensions"])),
    "sort": _along_other_axes(lambda e: (e.params["dimension"],)),
    "concatenate": _along_other_axes(lambda e: (e.params["dimension"],)),
    "cond": _cond,
}


def describe(eqn, what: str) -> str:
    """``what``, with the equation's operands and the user's line that made it."""
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


def whole_bytes(shape: Sequence[int], dtype: Any) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize
