"""ZeRO's layout: which axis of each leaf is split over the replicas.

Every parameter, gradient and optimizer-state leaf keeps its own shape. One of its axes is split
over the data axes, on top of whatever split it has over ``stage`` (a pipeline's stage blocks)
or ``model`` (tensor parallelism): MaxText's ``P("fsdp", "tensor")``, FSDP2's sharded dimension.
`split_dim` chooses the axis:

* the first (outermost) axis that divides by the number of replicas N and is not split over
  another mesh axis already, as FSDP2 splits dim 0: each replica's part is then contiguous, so
  gathering it and scattering into it need no transposes;
* with ZeRO-3, not one of a stacked leaf's leading layer axes (a layer scan slices those, and
  gathers one layer at a time), nor a stage block's stage and layer axes;
* None when no axis divides by N (or N is 1): the leaf is kept whole on every replica, still
  split over ``stage`` and ``model`` as placed. Its gradient is all-reduced, and its optimizer
  state and update are computed whole on each replica. ``Zero.plan`` and ``repl.explain`` count
  these leaves and their bytes. No leaf is padded, so every array, and every checkpoint, has the
  shape of the one-device program on every mesh.

Equivalent to::

    dim = next(a for a in free_axes(leaf) if leaf.shape[a] % N == 0)
    spec = leaf_spec with spec[dim] = data_axes
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from replicator._src.core import mesh as mesh_lib
from replicator._src.core import placement
from replicator._src.core.sharded_params import ShardedParam, is_sharded_param
from replicator._src.core.typing import PyTree


def split_dim(
    shape: Sequence[int], spec: Any, n: int, *, lead: int = 0, prefer: int | None = None
) -> int | None:
    """The axis of a leaf of ``shape`` and ``spec`` (a ``PartitionSpec``, or None when not
    known) that ZeRO splits over ``n`` replicas, or None to keep it whole.

    Args:
      shape: the leaf's shape (global, or one device's block of a stage split: the same choice).
      spec: its ``PartitionSpec`` over ``stage``/``model``; its split axes are not chosen.
      n: the number of replicas.
      lead: leading axes never chosen (ZeRO-3's stacked layer axes).
      prefer: an axis (negative: from the end) chosen before the others when it can be
        (``shard_params``' ``split``): the embedding table's width, so that each replica looks
        up its own columns.

    >>> split_dim((512, 1536), PartitionSpec(None, "model"), 8)  # columns over model: rows
    0
    >>> split_dim((512, 1536), PartitionSpec("model"), 8)  # rows over model: columns
    1
    >>> split_dim((3, 7, 7), None, 8) is None                     # nothing divides by 8
    True
    >>> split_dim((32000, 4096), None, 8, prefer=-1)                # columns, when asked
    1
    """
    if n <= 1:
        return None
    taken = {d for d, e in enumerate(tuple(spec or ())[: len(shape)]) if mesh_lib.entry_axes(e)}
    free = [d for d in range(lead, len(shape)) if d not in taken and shape[d] % n == 0]
    if not free:
        return None
    if prefer is not None and prefer % len(shape) in free:
        return prefer % len(shape)
    return free[0]


def data_entry(mesh: Mesh) -> Any:
    """The ``PartitionSpec`` entry of the data axes: ``"data"``, or a tuple of them."""
    axes = mesh_lib.replica_axes(mesh)
    return axes[0] if len(axes) == 1 else tuple(axes)


def with_data(
    spec: Any, dim: int | None, ndim: int, mesh: Mesh, *, entry: Any = None
) -> PartitionSpec:
    """``spec`` (or replicated) with axis ``dim`` split over the data axes (or ``entry``'s:
    hybrid ZeRO's ``"data"``), trailing Nones dropped (as XLA gives a step's outputs, so that
    the next step sees the same sharding)."""
    entries = list(tuple(spec or ()))[:ndim]
    entries += [None] * (ndim - len(entries))
    if dim is not None:
        entries[dim] = data_entry(mesh) if entry is None else entry
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def auto_entries(spec: Any, ndim: int, *, keep: int | None = None) -> tuple:
    """The entries of ``spec`` over the axes XLA partitions inside a step (``model``), for the
    last ``keep`` axes (default: all ``ndim``), as `ShardedParam.auto` keeps them."""
    entries = list(tuple(spec or ()))[:ndim]
    entries += [None] * (ndim - len(entries))

    def auto(entry):
        names = tuple(a for a in mesh_lib.entry_axes(entry) if a in mesh_lib.AUTO_AXES)
        return None if not names else names[0] if len(names) == 1 else names

    out = tuple(auto(e) for e in entries)
    out = out[ndim - (ndim if keep is None else keep) :]
    return out if any(out) else ()


def spec_of(x: Any) -> PartitionSpec | None:
    """The ``PartitionSpec`` of a global leaf (or a `ShardedParam`'s value), or None."""
    x = x.value if isinstance(x, ShardedParam) else x
    return getattr(placement.sharding_of(x), "spec", None)


def stage_dim(spec: Any) -> int | None:
    """The axis a spec splits over ``stage``, or None."""
    dims = [
        d for d, e in enumerate(tuple(spec or ())) if mesh_lib.STAGE_AXIS in mesh_lib.entry_axes(e)
    ]
    return dims[0] if dims else None


def stage_view(shape: Sequence[int], spec: Any, k: int) -> tuple[int, ...]:
    """The shape one device of a step holds of a global leaf: its stage axis (if any) 1/k."""
    shape = list(shape)
    dim = stage_dim(spec)
    if dim is not None and k > 1:
        shape[dim] //= k
    return tuple(shape)


ZERO3_STAGES = (
    "{api}: {where} is split over 'stage' (a pipeline's stage blocks) but not stored sharded; "
    "with zero_stage=3 store every parameter with opt.shard_params(params): a stage block's "
    "layers are then split over the replicas layer by layer, and the layer function gathers "
    "each one inside the layer scan: "
    "rp.pipeline.scan_layers(lambda p, h: layer_fn(rp.gather_params(p), h))."
)


def check_params(params: PyTree, mesh: Mesh, *, stage: int) -> None:
    """Refuses parameters ZeRO cannot lay out: with ZeRO-1/2, parameters split over the
    replicas; with ZeRO-3, stage blocks not stored through ``opt.shard_params``."""
    api = f"wrap_optimizer(zero_stage={stage})"
    data = set(mesh_lib.replica_axes(mesh))
    for path, p in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded_param)[0]:
        spec = spec_of(p)
        where = f"parameter {jax.tree_util.keystr(path)}"
        on_data = data & set(mesh_lib.spec_axes(spec or PartitionSpec()))
        if stage < 3 and on_data:
            raise ValueError(
                f"{api}: {where} is sharded as {spec}, over the replica axes "
                f"{sorted(on_data)}; ZeRO-1/2 shard the optimizer state of parameters that are "
                f"whole on every replica (split over 'stage' or 'model' is fine). Place it "
                f"without the replica axes (repl.replicate, or repl.place with a spec over "
                f"'stage'/'model' only), or store the parameters sharded over the replicas "
                f"with zero_stage=3 (opt.shard_params)."
            )
        if stage == 3 and not isinstance(p, ShardedParam) and stage_dim(spec) is not None:
            raise ValueError(ZERO3_STAGES.format(where=where, api=api))


def leaf_bytes(shape: Sequence[int], dtype: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * jnp.dtype(dtype).itemsize


def stacked_leads(stacked: Any, params: PyTree) -> dict[str, int]:
    """``shard_params``' ``stacked`` as top-level key -> number of leading layer axes (a list
    of keys: 1 each), checked against ``params``."""
    leads = dict(stacked) if isinstance(stacked, Mapping) else dict.fromkeys(stacked, 1)
    if leads and not isinstance(params, dict):
        raise ValueError("shard_params: stacked names top-level keys; params must be a dict.")
    missing = set(leads) - set(params) if leads else set()
    if missing:
        raise ValueError(f"shard_params: stacked keys {sorted(missing)} are not in params.")
    for key, lead in leads.items():
        if not isinstance(lead, int) or isinstance(lead, bool) or lead < 0:
            raise ValueError(
                f"shard_params: stacked[{key!r}] must be the number of leading layer axes "
                f"(an int >= 0, e.g. 2 for a pipeline's [K, L/K, ...] stages); got {lead!r}."
            )
    return leads
