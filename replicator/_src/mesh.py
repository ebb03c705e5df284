"""Building the device mesh from a ``mesh_shape`` dict, and the facts derived from it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src import compat

KNOWN_AXES: tuple[str, ...] = ("dcn_data", "data", "stage", "model")
"""Mesh axes replicator knows, in the order they are laid out (outermost first)."""

DATA_AXES: tuple[str, ...] = ("dcn_data", "data")
"""Axes over which replicas are laid out; collectives in ``step_fn`` reduce over these only."""


def build_mesh(
    mesh_shape: Mapping[str, int], *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """Builds a mesh with named axes from ``{"axis": size}``; one size may be -1 (fill).

    Axes are ordered as in `KNOWN_AXES` whatever the order of the dict, so that ``model`` (the
    most communication-hungry axis) is innermost. Axes of size 1 are kept: a program written for
    ``{"data": 4, "stage": 1}`` sees a ``stage`` axis.

    >>> import jax
    >>> dict(build_mesh({"stage": 1, "data": -1}, devices=jax.devices()[:2]).shape)
    {'data': 2, 'stage': 1}

    Raises:
      ValueError: for an unknown axis, a non-positive size, more than one -1, or sizes whose
        product is not the number of devices.
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
        if n % fixed:
            raise ValueError(
                f"Replicator: mesh_shape={dict(mesh_shape)} cannot fill axis {fills[0]!r}: the "
                f"other axes use {fixed} devices, which does not divide the {n} devices "
                f"available. Choose sizes whose product divides {n}."
            )
        shape[fills[0]] = n // fixed
    if math.prod(shape.values()) != n:
        raise ValueError(
            f"Replicator: mesh_shape={dict(mesh_shape)} needs {math.prod(shape.values())} devices "
            f"but {n} are available. Make the sizes multiply to {n}, put -1 on one axis to fill "
            f"it (e.g. {{**mesh_shape, 'data': -1}}), or pass "
            f"devices=jax.devices()[:{math.prod(shape.values())}]."
        )
    names = [name for name in KNOWN_AXES if name in shape]
    return compat.make_mesh([shape[name] for name in names], names, devices)


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


def spec_uses_replica_axes(spec: PartitionSpec, mesh: Mesh) -> bool:
    """Whether an array with this spec is split (not replicated) over some replica axis."""
    axes = set(replica_axes(mesh))
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        if axes.intersection(n for n in names if n is not None):
            return True
    return False
