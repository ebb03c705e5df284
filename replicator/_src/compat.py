"""The one place that deals with differences between JAX versions."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh


def make_mesh(shape: Sequence[int], names: Sequence[str], devices: Sequence[jax.Device]) -> Mesh:
    """A device mesh whose axes are all of type ``Auto``.

    Since JAX 0.9 ``jax.make_mesh`` makes ``Explicit`` axes by default, and ``shard_map`` then
    refuses inputs whose sharding differs from ``in_specs``. replicator lets ``jit`` reshard inputs
    (for example a NumPy batch) on the way in, which needs ``Auto`` axes.
    """
    return jax.make_mesh(
        tuple(shape), tuple(names), axis_types=(AxisType.Auto,) * len(shape), devices=devices
    )


def backends_initialized() -> bool:
    """Whether JAX has started its backends (after which ``jax.distributed`` cannot join)."""
    from jax._src import xla_bridge  # no public API says this (jax 0.10.2)

    return bool(xla_bridge.backends_are_initialized())
