"""Building the device mesh from a ``mesh_shape`` dict, and the facts derived from it."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import compat

STAGE_AXIS = "stage"
"""The pipeline axis: stage ``s`` of a pipeline lives on index ``s`` of it."""

MODEL_AXIS = "model"
"""The tensor-parallel axis. Inside a step it is left to XLA's sharding propagation (GSPMD):
``step_fn`` sees whole parameters however they are split over ``model``."""

CONTEXT_AXIS = "context"
"""The context (sequence) axis: activations are split along their sequence dimension over it,
and attention is exact across the split (`replicator.attention`). Like ``model``, XLA partitions
it inside a step: ``step_fn`` sees whole sequences."""

EXPERT_AXIS = "expert"
"""The expert axis: mixture-of-experts weights are split over it by expert, and tokens travel to
their experts by ``all_to_all`` (`replicator.moe`); elsewhere it splits the tokens of each data
replica like a data axis. XLA partitions it inside a step, as ``model``."""

DCN_AXIS = "dcn_data"
"""The one axis laid out across slices (over the data-centre network) on multi-slice devices."""

KNOWN_AXES: tuple[str, ...] = (DCN_AXIS, "data", STAGE_AXIS, EXPERT_AXIS, CONTEXT_AXIS, MODEL_AXIS)
"""Mesh axes replicator knows, in the order they are laid out (outermost first)."""

DATA_AXES: tuple[str, ...] = (DCN_AXIS, "data")
"""Axes over which replicas are laid out; collectives in ``step_fn`` reduce over these only."""

AUTO_AXES: tuple[str, ...] = (EXPERT_AXIS, CONTEXT_AXIS, MODEL_AXIS)
"""The axes XLA partitions inside a step (GSPMD), so that ``step_fn`` sees whole values along
them; layers map over them by hand where they need to (ring attention, expert all-to-all)."""


def build_mesh(
    mesh_shape: Mapping[str, int], *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """Builds a mesh with named axes from ``{"axis": size}``; one size may be -1 (fill).

    Axes are ordered as in `KNOWN_AXES` whatever the order of the dict, so that ``model`` (the
    most communication-hungry axis) is innermost. Axes of size 1 are kept: a program written for
    ``{"data": 4, "stage": 1}`` sees a ``stage`` axis.

    Devices of several slices (distinct ``slice_index`` values, as on multi-slice TPU) get a
    hybrid mesh: one axis crosses slices, and every other axis stays inside a slice, on its fast
    interconnect (ICI). That axis is ``dcn_data``; on a mesh without one, a ``stage`` axis that
    is a multiple of the slices (a pipeline across slices: only the stage sends cross). It must
    be a multiple ``k * S`` of the number of slices ``S``: slices are taken in ``slice_index``
    order, and slice ``j`` holds the ``k`` consecutive indices ``j * k, ..., j * k + k - 1`` of
    it. Inside a slice, the layout is the one ``jax.make_mesh`` gives that slice alone. Devices
    of one slice, or without ``slice_index`` (CPU), get ``jax.make_mesh``'s mesh.

    >>> import jax
    >>> dict(build_mesh({"stage": 1, "data": -1}, devices=jax.devices()[:2]).shape)
    {'data': 2, 'stage': 1}

    Raises:
      ValueError: for an unknown axis, a non-positive size, more than one -1, or sizes whose
        product is not the number of devices; when the mesh needs more devices than there are,
        the error says how to get them (on CPU: set ``jax_num_cpu_devices`` before JAX starts).
        On devices of several slices: when ``dcn_data`` is missing or not a multiple of the
        number of slices, or the slices have different numbers of devices.
    """
    if not isinstance(mesh_shape, Mapping) or not mesh_shape:
        raise TypeError(
            f"Replicator: mesh_shape must be a non-empty dict of axis name to size, such as "
            f'{{"data": -1}}; got {mesh_shape!r}.'
        )
    for name, size in mesh_shape.items():
        if name not in KNOWN_AXES:
            raise ValueError(
                f"Replicator: unknown mesh axis {name!r} in mesh_shape={dict(mesh_shape)}. "
                f"Known axes are {', '.join(map(repr, KNOWN_AXES))}; for data parallelism over "
                f'every device use mesh_shape={{"data": -1}}.'
            )
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(
                f"Replicator: mesh_shape[{name!r}] must be a positive int or -1 (fill with the "
                f"remaining devices); got {size!r}."
            )
    fills = [name for name, size in mesh_shape.items() if size == -1]
    if len(fills) > 1:
        raise ValueError(
            f"Replicator: only one mesh axis may be -1, but {fills} are in "
            f"mesh_shape={dict(mesh_shape)}; give all but one an explicit size."
        )
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    fixed = math.prod(size for size in mesh_shape.values() if size != -1)
    shape = dict(mesh_shape)
    if fills:
        if fixed > n:
            raise MeshSizeError(
                f"Replicator: mesh_shape={dict(mesh_shape)} cannot fill axis {fills[0]!r}: the "
                f"other axes use {fixed} devices, more than the {n} available. "
                f"{_more_devices(devices, fixed)}",
                fixed,
                n,
            )
        if n % fixed:
            raise MeshSizeError(
                f"Replicator: mesh_shape={dict(mesh_shape)} cannot fill axis {fills[0]!r}: the "
                f"other axes use {fixed} devices, which does not divide the {n} devices "
                f"available. Choose sizes whose product divides {n}.",
                fixed,
                n,
            )
        shape[fills[0]] = n // fixed
    need = math.prod(shape.values())
    if need > n:
        raise MeshSizeError(
            f"Replicator: mesh_shape={dict(mesh_shape)} needs {need} devices but {n} are "
            f"available. {_more_devices(devices, need)}",
            need,
            n,
        )
    if need != n:
        raise MeshSizeError(
            f"Replicator: mesh_shape={dict(mesh_shape)} needs {need} devices but {n} are "
            f"available. Make the sizes multiply to {n}, put -1 on one axis to fill it (e.g. "
            f"{{**mesh_shape, 'data': -1}}), or pass devices=jax.devices()[:{need}].",
            need,
            n,
        )
    names = [name for name in KNOWN_AXES if name in shape]
    slices = _slice_sizes(devices)
    if len(slices) > 1:
        return _multi_slice_mesh(mesh_shape, shape, names, devices, slices)
    return compat.make_mesh([shape[name] for name in names], names, devices)


class MeshSizeError(ValueError):
    """A mesh that does not fit the devices: its fixed axes need ``devices_needed`` devices (a
    multiple of it when an axis is -1), and ``devices_available`` are given. The message
    speaks to the API (``devices=...``); a command line reads the two numbers instead."""

    def __init__(self, message: str, devices_needed: int, devices_available: int) -> None:
        super().__init__(message)
        self.devices_needed, self.devices_available = devices_needed, devices_available


def _slice_sizes(devices: Sequence[jax.Device]) -> dict[int, int]:
    """``{slice_index: number of devices}``, in slice order; empty for devices without one."""
    if not all(hasattr(d, "slice_index") for d in devices):
        return {}
    sizes: dict[int, int] = {}
    for d in sorted(devices, key=lambda d: d.slice_index):
        sizes[d.slice_index] = sizes.get(d.slice_index, 0) + 1
    return sizes


def _multi_slice_mesh(
    mesh_shape: Mapping[str, int],
    shape: Mapping[str, int],
    names: Sequence[str],
    devices: Sequence[jax.Device],
    slices: Mapping[int, int],
) -> Mesh:
    """`build_mesh` on devices of several slices: ``dcn_data`` across them, the rest inside."""
    count = len(slices)
    if len(set(slices.values())) > 1:
        sizes = [f"slice {s}: {n}" for s, n in slices.items()]
        sizes[0] += " devices"
        raise ValueError(
            f"Replicator: the devices span {count} slices of different sizes "
            f"({', '.join(sizes)}); a multi-slice mesh is laid out slice by slice, so pass every "
            f"device of each slice (e.g. devices=jax.devices())."
        )
    across = DCN_AXIS
    stages = shape.get(STAGE_AXIS, 1)
    if DCN_AXIS not in mesh_shape and stages >= count and stages % count == 0:
        across = STAGE_AXIS  # a pipeline across slices: only the stage sends cross them
    dcn = shape.get(DCN_AXIS, 1)
    if across == DCN_AXIS and dcn % count:
        fix = {DCN_AXIS: count, **{k: v for k, v in mesh_shape.items() if k != DCN_AXIS}}
        if -1 not in fix.values():
            fix["data"] = -1
        fix = {name: fix[name] for name in KNOWN_AXES if name in fix}
        has = f"gives {DCN_AXIS!r} {dcn}" if DCN_AXIS in mesh_shape else f"has no {DCN_AXIS!r} axis"
        raise ValueError(
            f"Replicator: the devices span {count} slices, and {DCN_AXIS!r} is the mesh axis "
            f"laid out across slices (or, without it, {STAGE_AXIS!r}: a pipeline's stages), but "
            f"mesh_shape={dict(mesh_shape)} {has}. Give {DCN_AXIS!r} a multiple of {count} (the "
            f"slice count): mesh_shape={fix}."
        )
    ici = [shape[name] // count if name == across else shape[name] for name in names]
    dcn_shape = [count if name == across else 1 for name in names]
    return compat.make_hybrid_mesh(ici, dcn_shape, names, devices)


def _more_devices(devices: Sequence[jax.Device], need: int) -> str:
    """How to get ``need`` devices when ``devices`` are fewer: the end of `build_mesh`'s error."""
    platform = devices[0].platform if devices else jax.default_backend()
    have = len(jax.devices(platform))
    if have >= need:
        return f"This process has {have} {platform} devices: pass devices=jax.devices()[:{need}]."
    if platform != "cpu":
        return (
            f"This job has {have} {platform} devices; use a mesh of at most {have} (e.g. "
            f'{{"data": -1}}), or run on more hosts (rp.distributed.initialize).'
        )
    return (
        f"On CPU, JAX emulates as many devices as it is told, but only if told before JAX "
        f"initialises its backend (the first jax.devices() or array creation), so set the count "
        f"at the top of the script (in a notebook, restart the kernel first): "
        f'jax.config.update("jax_num_cpu_devices", {need}), or '
        f"XLA_FLAGS=--xla_force_host_platform_device_count={need} in the environment; with "
        f"`replicator train`, the config's cpu_devices (replicator train CONFIG "
        f"cpu_devices={need}). Or use a smaller mesh, e.g. "
        f'{{"data": -1}}.'
    )


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names of one ``PartitionSpec`` entry: a name, a tuple of names, or none
    (``None``, ``P.UNCONSTRAINED``).

    >>> entry_axes(("stage", "model")), entry_axes("data"), entry_axes(None)
    (('stage', 'model'), ('data',), ())
    """
    return tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if isinstance(n, str))


def spec_axes(spec: PartitionSpec) -> frozenset[str]:
    """The mesh axes a ``PartitionSpec`` names."""
    return frozenset(n for entry in spec for n in entry_axes(entry))


def manual_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes a step is mapped over by hand (``shard_map``): all but `AUTO_AXES` (``model``,
    ``context``, ``expert``), which XLA partitions by itself (GSPMD), so ``step_fn`` sees whole
    values along them.

    >>> manual_axes(build_mesh({"data": 2, "model": 2}, devices=jax.devices()[:4]))
    ('data',)
    """
    return tuple(a for a in mesh.axis_names if a not in AUTO_AXES)


def manual_spec(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` without the axes `manual_axes` leaves out: what ``shard_map`` is told, while the
    array itself keeps its whole sharding.

    >>> manual_spec(PartitionSpec("data", ("stage", "model"), "model"))
    P('data', 'stage', None)
    """

    def keep(entry):
        kept = tuple(n for n in entry_axes(entry) if n not in AUTO_AXES)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(keep(e) for e in spec))


def indivisible_split(
    shape: Sequence[int], spec: PartitionSpec, axis_sizes: Mapping[str, int]
) -> tuple[int, int, tuple[str, ...]] | None:
    """The first dimension ``spec`` splits into parts that do not divide it, as ``(dimension,
    parts, axis names)``, or None when every split divides (entries past the rank are ignored).

    >>> indivisible_split((12, 30), PartitionSpec(None, "model"), {"data": 2, "model": 4})
    (1, 4, ('model',))
    """
    for dim, entry in enumerate(tuple(spec)[: len(shape)]):
        names = entry_axes(entry)
        parts = math.prod(axis_sizes[n] for n in names)
        if shape[dim] % parts:
            return dim, parts, names
    return None


def replica_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data axes of ``mesh``, outermost first: what collectives in ``step_fn`` reduce over."""
    return tuple(name for name in mesh.axis_names if name in DATA_AXES)


def num_replicas(mesh: Mesh) -> int:
    return math.prod(mesh.shape[name] for name in replica_axes(mesh))


def batch_spec(mesh: Mesh) -> PartitionSpec:
    """The spec of a batch: leading axis split over the replicas, replicated over other axes."""
    axes = replica_axes(mesh)
    return PartitionSpec(axes if len(axes) != 1 else axes[0])


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """``NamedSharding(mesh, P())``: every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def num_local_replicas(mesh: Mesh) -> int:
    """How many replicas have a device in this process (each process feeds its own replicas)."""
    axes = replica_axes(mesh)
    positions = [mesh.axis_names.index(name) for name in axes]
    local = set()
    for index, device in np.ndenumerate(mesh.devices):
        if device.process_index == jax.process_index():
            local.add(tuple(index[p] for p in positions))
    return len(local)


def fit_spec(spec: PartitionSpec, mesh: Mesh, *, api: str) -> PartitionSpec:
    """``spec`` for ``mesh``: the axes replicator knows but ``mesh`` lacks are dropped.

    Every axis in `KNOWN_AXES` that a mesh lacks means the same as that axis with size 1: the
    pipeline engine then runs the sequential model (``stage``), and the replicas are laid out
    over the other data axes (``dcn_data``). Sharding over an axis of size 1 is replication, so
    dropping the axis from ``spec`` is exact: a step sees the same values either way. A stacked
    pipeline placed with ``P("stage")`` is therefore replicated on a mesh without ``stage``, such
    as the local lowering's one device, where the engine wants every stage.

    >>> import jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = build_mesh({"data": 2}, devices=jax.devices()[:2])
    >>> fit_spec(P("stage"), mesh, api="Replicator.place"), fit_spec(P("data"), mesh, api="")
    (P(), P('data',))

    Args:
      spec: a ``PartitionSpec`` over mesh axis names.
      mesh: the mesh it is for.
      api: the function to name in errors, e.g. ``"Replicator.place"``.

    Returns:
      ``spec`` itself when ``mesh`` has all its axes; else a spec without the missing ones
      (and without the trailing ``None`` entries that leaves).

    Raises:
      TypeError: if ``spec`` is not a ``PartitionSpec``.
      ValueError: if ``spec`` names an axis that is neither in ``mesh`` nor in `KNOWN_AXES`
        (a typo such as ``"stag"``).
    """
    if not isinstance(spec, PartitionSpec):
        raise TypeError(
            f"{api}: spec must be a PartitionSpec, such as P('stage') or P() "
            f"(from jax.sharding import PartitionSpec as P); got {type(spec).__name__} {spec!r}."
        )
    present = set(mesh.axis_names)
    entries, dropped = [], False
    for entry in spec:
        if entry is None or not isinstance(entry, str | tuple):  # None, P.UNCONSTRAINED
            entries.append(entry)
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        for name in names:
            if name not in present and name not in KNOWN_AXES:
                close = difflib.get_close_matches(str(name), [*present, *KNOWN_AXES], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"{api}: spec {spec} names axis {name!r}, which is not an axis of this mesh "
                    f"({dict(mesh.shape)}; axes {', '.join(map(repr, mesh.axis_names))}) nor "
                    f"one replicator knows ({', '.join(map(repr, KNOWN_AXES))}){hint}. Name "
                    f"mesh axes in the spec, e.g. rp.pipeline.stage_spec() for stacked stages."
                )
        kept = tuple(name for name in names if name in present)
        dropped |= len(kept) != len(names)
        if isinstance(entry, str) or len(kept) == len(names):
            entries.append(entry if kept else None)
        else:
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    if not dropped:
        return spec
    while entries and entries[-1] is None:
        entries.pop()
    return spec.update(partitions=tuple(entries))


def spec_uses_replica_axes(spec: PartitionSpec, mesh: Mesh) -> bool:
    """Whether an array with this spec is split (not replicated) over some replica axis."""
    return bool(spec_axes(spec) & set(replica_axes(mesh)))
