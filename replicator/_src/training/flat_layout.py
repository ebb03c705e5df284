"""Reading checkpoints written in ZeRO's earlier, flat layout.

Before ZeRO kept each leaf in its own shape, it stored a ZeRO leaf flattened and padded to a
multiple of the replicas: ZeRO-1/2 state as ``[N * c]`` (a pipeline's stage-split leaf as
``[K * N * c]``, block ``s`` of the stage axis flattened and padded on its own), and ZeRO-3
parameters as `ShardedParam` nodes ``[*lead, N * c]`` (their leaf named ``<path>.0``).
`Checkpoints.restore` recognises such a leaf and converts it, once, to the leaf's own shape;
the next save writes the logical array. Nothing else in the library knows this layout.

Equivalent to (``x`` the saved leaf, ``shape`` the leaf's own)::

    x[..., :prod(shape[lead:])].reshape(shape)                      # whole leaves, ZeRO-3
    concatenate([b[:block].reshape(block_shape) for b in split(x, K)], stage_axis)  # blocks
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from replicator._src.core import mesh as mesh_lib

LEGACY_SUFFIX = ".0"  # a ZeRO-3 ShardedParam's leaf, as the flat layout's checkpoints name it


def renamed(saved: dict, wanted: set) -> dict:
    """``saved`` (orbax name -> entry) with each legacy ZeRO-3 name ``<path>.0`` whose
    ``<path>`` is wanted (and not saved itself) renamed to ``<path>``."""
    out = {}
    for name, entry in saved.items():
        base = name[: -len(LEGACY_SUFFIX)]
        if name.endswith(LEGACY_SUFFIX) and base in wanted and base not in saved:
            out[base] = (*entry, name)
        else:
            out[name] = (*entry, name)
    return out


def _last_axis_split(meta: Any) -> dict[str, int]:
    """The mesh axes (and sizes) a saved leaf's last axis was split over, from its metadata."""
    sharding = getattr(meta, "sharding", None)
    spec = tuple(_or_empty(getattr(sharding, "partition_spec", None)))
    names = tuple(_or_empty(getattr(sharding, "axis_names", None)))
    sizes = dict(zip(names, _or_empty(getattr(sharding, "shape", None)), strict=False))
    shape = tuple(_or_empty(getattr(meta, "shape", None)))
    entry = spec[len(shape) - 1] if 0 < len(shape) <= len(spec) else None
    entry = tuple(entry) if isinstance(entry, list) else entry  # orbax keeps tuples as lists
    return {a: int(sizes.get(a, 1)) for a in mesh_lib.entry_axes(entry)}


def _or_empty(x: Any) -> tuple:
    return () if x is None else tuple(x)


def stage_blocks(meta: Any) -> int:
    """How many ``stage`` blocks a saved flat leaf holds: the size of ``stage`` in the mesh it
    was saved from, if its last axis is split over ``stage``; else 1."""
    return _last_axis_split(meta).get(mesh_lib.STAGE_AXIS, 1)


def convertible(meta: Any, want_shape: tuple) -> bool:
    """Whether a saved leaf is the flat layout of a leaf of ``want_shape``: its last axis split
    over the data axes (and ``stage`` for blocks), its leading axes ``want_shape``'s, and its
    length the flattened rest padded by less than one element per part."""
    saved = tuple(meta.shape)
    split = _last_axis_split(meta)
    if not set(split) & set(mesh_lib.DATA_AXES):
        return False
    lead = len(saved) - 1
    if lead < 0 or lead >= len(want_shape) or saved[:lead] != tuple(want_shape[:lead]):
        return False
    blocks = split.get(mesh_lib.STAGE_AXIS, 1)
    parts = math.prod(n for a, n in split.items() if a != mesh_lib.STAGE_AXIS)
    size = math.prod(want_shape[lead:])
    if saved[-1] % blocks or size % blocks:
        return False
    length, block = saved[-1] // blocks, size // blocks
    return length - parts < block <= length


def convert(x: jax.Array, want: jax.ShapeDtypeStruct, blocks: int, stage_axis: int | None):
    """The saved flat ``x`` as an array of ``want``'s shape, placed with its sharding.

    Raises:
      ValueError: for stage blocks whose stage axis the target does not say (its spec has no
        ``stage`` entry and no axis has ``blocks`` elements).
    """
    shape = tuple(want.shape)
    lead = x.ndim - 1
    if blocks == 1:

        def whole(a):
            return a[..., : math.prod(shape[lead:])].reshape(shape)

        return jax.jit(whole, out_shardings=want.sharding)(x)
    if stage_axis is None:
        fits = [d for d, n in enumerate(shape) if n == blocks]
        if not fits:
            raise ValueError(
                f"rp.Checkpoints.restore: a leaf saved in ZeRO's flat layout by {blocks} "
                f"pipeline stages cannot be matched to shape {list(shape)}: no axis has "
                f"{blocks} elements. Restore it onto a mesh with a 'stage' axis of that size."
            )
        stage_axis = fits[0]
    block = list(shape)
    block[stage_axis] //= blocks

    def by_blocks(a):
        parts = a.reshape(blocks, -1)[:, : math.prod(block)].reshape((blocks, *block))
        return jnp.concatenate(list(parts), axis=stage_axis)

    return jax.jit(by_blocks, out_shardings=want.sharding)(x)


def stage_axis_of(want: jax.ShapeDtypeStruct) -> int | None:
    spec = tuple(getattr(getattr(want, "sharding", None), "spec", ()) or ())
    dims = [d for d, e in enumerate(spec) if mesh_lib.STAGE_AXIS in mesh_lib.entry_axes(e)]
    return dims[0] if dims else None
