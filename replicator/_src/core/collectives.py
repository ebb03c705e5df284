"""Placeholder collectives: written once in ``step_fn``, bound by the active lowering.

Every function here takes a pytree and means "over all replicas of this program". What that
becomes is decided when ``step_fn`` is traced, by the innermost `Binding`:

* outside any replicator, or under ``lowering="local"``: one replica. ``all_reduce`` and
  ``broadcast`` return their input, ``all_gather`` adds an axis of size 1, ``replica_id()`` is 0
  and ``num_replicas()`` is 1. Code runs eagerly, so ``print`` and ``pdb`` work.
* ``lowering="pmap"`` and ``lowering="shard_map"``: the ``jax.lax`` collective over the replica
  (data) axes. Pipeline (``stage``) and ``model`` axes are never reduced over.

>>> import jax.numpy as jnp, replicator as rp
>>> rp.all_reduce({"loss": jnp.float32(2.0)}, "mean")      # one replica: unchanged
{'loss': Array(2., dtype=float32)}
>>> rp.all_gather(jnp.ones(3)).shape                       # stacked over 1 replica
(1, 3)
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src.core.binding import current_binding
from replicator._src.core.typing import PyTree

_REDUCTIONS = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def all_reduce(x: PyTree, op: str) -> PyTree:
    """Reduces every leaf of ``x`` over all replicas; every replica gets the result.

    Args:
      x: a pytree of arrays.
      op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    Returns:
      A pytree like ``x``. Equivalent to ``op([x on replica r for r in range(num_replicas())])``.

    Raises:
      ValueError: if ``op`` is not one of the four names.
    """
    if op not in _REDUCTIONS:
        raise ValueError(
            f"rp.all_reduce: op={op!r} is not a reduction; use one of "
            f"{', '.join(map(repr, _REDUCTIONS))} (e.g. rp.all_reduce(loss, 'mean'))."
        )
    binding = current_binding()
    if binding.is_local or binding.num_replicas == 1:  # nothing to reduce (and XLA refuses a
        return x  # cross-partition all-reduce over a size-1 axis of values it partitions)
    reduce = _REDUCTIONS[op]
    return jax.tree.map(lambda v: reduce(v, binding.axes), x)


def all_gather(x: PyTree, *, axis: int = 0, tiled: bool = False) -> PyTree:
    """Gathers every leaf of ``x`` from all replicas, in replica order.

    Args:
      x: a pytree of arrays.
      axis: where the replica axis goes (``tiled=False``), or which axis is concatenated
        (``tiled=True``).
      tiled: if False, stack along a new axis of size ``num_replicas()``; if True, concatenate
        along ``axis``.

    Returns:
      Equivalent to ``jnp.stack([x on replica r ...], axis)`` (or ``jnp.concatenate`` if tiled).
    """
    binding = current_binding()
    if binding.is_local:
        return jax.tree.map(lambda v: v if tiled else jnp.expand_dims(v, axis), x)
    return jax.tree.map(lambda v: lax.all_gather(v, binding.axes, axis=axis, tiled=tiled), x)


def reduce_scatter(x: PyTree, *, axis: int = 0, op: str = "sum") -> PyTree:
    """Reduces over replicas, then keeps this replica's slice of ``axis`` (tiled).

    Replica ``r`` gets block ``r`` of the reduced leaf, cut into ``num_replicas()`` equal blocks
    along ``axis``. Together with ``all_gather(tiled=True)`` it makes an all-reduce.

    Args:
      x: a pytree of arrays whose ``axis`` divides by ``num_replicas()``.
      axis: the axis to split.
      op: ``"sum"`` or ``"mean"``.

    Returns:
      Equivalent to ``jnp.split(all_reduce(x, op), num_replicas(), axis)[replica_id()]``.

    Raises:
      ValueError: if ``op`` is not "sum" or "mean", or a leaf's ``axis`` does not divide.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"rp.reduce_scatter: op={op!r}; use 'sum' or 'mean'.")
    binding = current_binding()
    n = binding.num_replicas

    def scatter(path, v):
        if v.ndim == 0 or v.shape[axis] % n:
            raise ValueError(
                f"rp.reduce_scatter: leaf {jax.tree_util.keystr(path) or 'x'} of shape "
                f"{v.shape} cannot be split over {n} replicas along axis {axis}; pad that axis "
                f"to a multiple of {n}."
            )
        if binding.is_local:
            return v
        out = lax.psum_scatter(v, binding.axes, scatter_dimension=axis, tiled=True)
        return out / n if op == "mean" else out

    return jax.tree_util.tree_map_with_path(scatter, x)


def broadcast(x: PyTree, *, source: int = 0) -> PyTree:
    """Every replica gets replica ``source``'s value of ``x``.

    Args:
      x: a pytree of arrays.
      source: the index of the replica whose value every replica gets.

    Returns:
      A pytree like ``x``. Equivalent to ``[x on replica source] * num_replicas()``.

    Raises:
      ValueError: if ``source`` is not a replica index.
    """
    binding = current_binding()
    n = binding.num_replicas
    if not isinstance(source, int) or not 0 <= source < n:
        raise ValueError(
            f"rp.broadcast: source={source!r} is not a replica index; use an int in [0, {n})."
        )
    if binding.is_local:
        return x
    me = lax.axis_index(binding.axes)

    def pick(v):
        v = jnp.asarray(v)
        as_int = v.dtype == jnp.bool_
        w = v.astype(jnp.int32) if as_int else v
        out = lax.psum(jnp.where(me == source, w, jnp.zeros_like(w)), binding.axes)
        return out.astype(v.dtype) if as_int else out

    return jax.tree.map(pick, x)


def replica_id() -> jax.Array:
    """This replica's index in ``[0, num_replicas())``, as an int32 scalar (0 when local)."""
    binding = current_binding()
    if binding.is_local:
        return jnp.zeros((), jnp.int32)
    return lax.axis_index(binding.axes)


def num_replicas() -> int:
    """The number of replicas running this program, as a Python int (1 when local)."""
    return current_binding().num_replicas


def sum_over_axes(x: PyTree, axes: tuple) -> PyTree:
    """The sum of ``x`` (a tree: one collective for all its leaves) over the named non-replica
    mesh axes ``axes`` (such as ``"stage"``), for the library's own reductions over values split
    across them; ``x`` when ``axes`` is empty."""
    return lax.psum(x, tuple(axes)) if axes else x


def mean_over_axes(x: PyTree, axes: tuple) -> PyTree:
    """The mean of ``x`` over the named mesh axes ``axes``, for the library's own reductions
    over groups of replicas (hybrid ZeRO's parts across slices, local SGD's moves); ``x``
    when ``axes`` is empty."""
    return lax.pmean(x, tuple(axes)) if axes else x


def max_over_axes(x: jax.Array, axes: tuple) -> jax.Array:
    """The element-wise maximum of ``x`` over the named mesh axes ``axes`` (replica axes or
    others, such as ``"stage"``), for the library's own checks across devices; ``x`` when
    ``axes`` is empty.

    Equivalent to: ``max([x on device d for d along axes])``, element by element.
    """
    return lax.pmax(x, tuple(axes)) if axes else x


def min_over_axes(x: jax.Array, axes: tuple) -> jax.Array:
    """The element-wise minimum of ``x`` over the named mesh axes ``axes``, as `max_over_axes`
    takes the maximum; ``x`` when ``axes`` is empty."""
    return lax.pmin(x, tuple(axes)) if axes else x


# -- the library's own collectives over the replicas along one axis ------------------------------


def gather_replicas(x: jax.Array, dim: int, auto: tuple = ()) -> jax.Array:
    """Every replica's part of ``x`` concatenated along ``dim``, in replica order (ZeRO's
    gathers): ``all_gather(x, axis=dim, tiled=True)``.

    ``auto`` gives the ``PartitionSpec`` entries of ``x``'s last ``len(auto)`` axes over the
    mesh axes XLA partitions inside a step (``model``). A collective over the replica axes is
    otherwise taken by XLA as one over whole values along those axes, which gathers them over
    ``model`` first; here each device gathers its own ``model`` part (a ``shard_map`` over the
    ``model`` axes inside the step), so the weight stays split over ``model`` and the product that
    uses it is computed once.
    """
    binding = current_binding()
    if binding.is_local:
        return x
    axis = dim % x.ndim
    return _over_auto(lambda v: lax.all_gather(v, binding.axes, axis=axis, tiled=True), x, auto)


def scatter_replicas(x: jax.Array, dim: int, auto: tuple = ()) -> jax.Array:
    """The sum of ``x`` over the replicas, of which this replica keeps its part along ``dim``
    (ZeRO's reduce-scatter of gradients); ``auto`` as for `gather_replicas`.

    Equivalent to ``jnp.split(all_reduce(x, "sum"), num_replicas(), dim)[replica_id()]``.
    """
    binding = current_binding()
    if binding.is_local:
        return x
    axis = dim % x.ndim
    scatter = lambda v: lax.psum_scatter(v, binding.axes, scatter_dimension=axis, tiled=True)
    return _over_auto(scatter, x, auto)


def replica_all_to_all(x: jax.Array, *, split: int, concat: int) -> jax.Array:
    """Over the replicas: dimension ``split`` of ``x`` cut in ``num_replicas()`` parts, part
    ``i`` sent to replica ``i``, and the parts received laid side by side along ``concat`` in
    replica order (one ``all-to-all``); ``x`` when local."""
    binding = current_binding()
    if binding.is_local:
        return x
    return lax.all_to_all(x, binding.axes, split % x.ndim, concat % x.ndim, tiled=True)


def replica_part(x: jax.Array, dim: int) -> jax.Array:
    """This replica's part of ``x`` along ``dim`` (of ``num_replicas()`` equal parts): the
    inverse of `gather_replicas`, with no communication."""
    binding = current_binding()
    if binding.is_local:
        return x
    axis = dim % x.ndim
    size = x.shape[axis] // binding.num_replicas
    return lax.dynamic_slice_in_dim(x, lax.axis_index(binding.axes) * size, size, axis)


def gather_over_axes(x: jax.Array, axes: tuple, dim: int) -> jax.Array:
    """Every device's part of ``x`` along the named non-replica axes ``axes`` (a pipeline's
    ``stage``), concatenated along ``dim`` in mesh order: a stage-split leaf made whole."""
    return lax.all_gather(x, tuple(axes), axis=dim % x.ndim, tiled=True) if axes else x


def part_over_axes(x: jax.Array, axes: tuple, dim: int) -> jax.Array:
    """This device's part of ``x`` along ``dim``, cut in as many parts as ``axes`` has devices
    (the inverse of `gather_over_axes`, with no communication)."""
    if not axes:
        return x
    size = x.shape[dim] // lax.axis_size(tuple(axes))
    return lax.dynamic_slice_in_dim(x, lax.axis_index(tuple(axes)) * size, size, dim)


def _over_auto(f, x: jax.Array, auto: tuple) -> jax.Array:
    """``f(x)``, mapped by hand over the axes XLA partitions that ``auto`` (entries of ``x``'s
    last axes) splits ``x`` over, so that ``f`` sees and keeps each device's part."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)) if mesh.axis_names else {}
    manual = set(getattr(mesh, "manual_axes", ()))
    entries = [None] * (x.ndim - len(auto)) + list(auto)[-x.ndim :] if x.ndim else []

    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if isinstance(n, str) and sizes.get(n, 1) > 1)
        kept = tuple(n for n in kept if n not in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    spec = [keep(e) for e in entries]
    axes = {n for e in spec for n in ((e,) if isinstance(e, str) else e or ())}
    if not axes:
        return f(x)
    spec = jax.sharding.PartitionSpec(*spec)
    return jax.shard_map(f, in_specs=spec, out_specs=spec, axis_names=axes, check_vma=False)(x)


# -- the axes XLA partitions inside a step: layers that map over them by hand -------------------


def auto_axis_size(name: str) -> int:
    """The size of mesh axis ``name`` where it is left to XLA in the current trace (``context``,
    ``expert``, ``model`` inside ``Replicator.run``), else 1: outside any mesh, on a mesh
    without it, or where it is already mapped by hand.

    >>> auto_axis_size("context")
    1
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or name not in mesh.axis_names or name in getattr(mesh, "manual_axes", ()):
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[name]


def map_over(f, *, in_specs, out_specs, axes: tuple[str, ...]):
    """``f`` mapped by hand (``jax.shard_map``) over ``axes``, axes that XLA partitions
    elsewhere in the step, so that ``f`` sees each device's part and may call `ring_shift` and
    `all_to_all` over them; the other axes stay as they were (manual or left to XLA).

    ``axes`` of size 1 (or absent) are dropped from the specs; with none left, ``f`` runs as it
    is, on whole values: the same program on one device."""
    axes = tuple(a for a in axes if auto_axis_size(a) > 1)
    if not axes:
        return f

    def keep(spec):
        def entry(e):
            names = tuple(n for n in (e if isinstance(e, tuple) else (e,)) if n in axes)
            return None if not names else names[0] if len(names) == 1 else names

        return jax.sharding.PartitionSpec(*(entry(e) for e in spec))

    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)
    return jax.shard_map(
        f,
        in_specs=jax.tree.map(keep, in_specs, is_leaf=is_spec),
        out_specs=jax.tree.map(keep, out_specs, is_leaf=is_spec),
        axis_names=set(axes),
        check_vma=False,
    )


_DIVERGENT = threading.local()


@contextlib.contextmanager
def divergent(what: str):
    """While tracing code that devices run or skip on their own (a pipeline schedule's work
    under a per-stage ``lax.cond``): `ring_shift` refuses there, with ``what`` in its error. A
    ``collective-permute`` that only some devices reach waits for all of them (XLA:CPU's
    rendezvous names every device of the program), or pairs the wrong sends."""
    stack = _DIVERGENT.__dict__.setdefault("stack", [])
    stack.append(what)
    try:
        yield
    finally:
        stack.pop()


def ring_shift(x: PyTree, axis: str, offset: int = 1) -> PyTree:
    """Inside `map_over` ``axis``: every device sends ``x`` to the device ``offset`` places on
    along ``axis`` (cyclically), and gets its own from ``offset`` places back (one
    ``collective-permute``). Identity when ``axis`` has one device."""
    n = lax.axis_size(axis)
    if n == 1:
        return x
    stack = getattr(_DIVERGENT, "stack", [])
    if stack:
        raise ValueError(
            f"replicator: a ring over {axis!r} (ring attention's key/value blocks) cannot run "
            f"inside {stack[-1]}, whose work each stage runs or skips on its own: a "
            f"collective-permute must be reached by every device. Use attention "
            f"impl='all_to_all' (GPTConfig(attention='all_to_all'), model.attention: "
            f"all_to_all), or the 'gpipe' or 'circular' schedule."
        )
    perm = [(i, (i + offset) % n) for i in range(n)]
    return jax.tree.map(lambda v: lax.ppermute(v, axis, perm), x)


def all_to_all(x: jax.Array, axis: str, *, split: int, concat: int) -> jax.Array:
    """Inside `map_over` ``axis``: dimension ``split`` of ``x`` is cut in as many parts as
    ``axis`` has devices, part ``i`` goes to device ``i``, and the parts received are laid side
    by side along ``concat``, in device order (one ``all-to-all``)."""
    if lax.axis_size(axis) == 1:
        return x
    return lax.all_to_all(x, axis, split, concat, tiled=True)
