"""ZeRO on 3-D meshes: pipeline stage blocks, and the parameters ZeRO cannot lay out.

ZeRO-3 stores a stage block of stacked layers ``[K, L/K, ...]`` (with ``repeats``: ``[V, K,
...]``) flat layer by layer, ``[K, L/K, N * c]`` over ``("stage", None, data axes)``: each layer
split over the replicas on its own, so that the layer scan gathers one layer at a time.

A parameter split over ``stage`` (of size K > 1) is, inside a step, one device's block of it:
its dimension ``d`` split into K contiguous parts. ZeRO-1/2 store the state of such a leaf by
blocks, ``[K * N * c]`` sharded over ``("stage", data axes[, "model"])``: block ``s`` (the leaf
with its dimension ``d`` cut to part ``s``) flattened row-major and padded to ``N * c``, replica
``r`` holding ``[r c, (r + 1) c)`` of it. Each device holds 1/(K N) of the leaf, and inside the
step a block is an ordinary leaf of the block's shape, its full reductions completed over the
stages as well (`sharded_eval.Layout.splits`).

Equivalent to (``x`` a state leaf shaped like the parameter, ``pad`` to ``N c`` elements)::

    stored = concatenate([pad(take(x, part s of dimension d).ravel()) for s in range(K)])
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from replicator._src import mesh as mesh_lib
from replicator._src import placement
from replicator._src.sharded_params import ShardedParam, is_sharded_param
from replicator._src.typing import PyTree

ZERO3_STAGES = (
    "{api}: {where} is split over 'stage' (a pipeline's stage blocks) but not stored sharded; "
    "with zero_stage=3 store every parameter with opt.shard_params(params): a stage block's "
    "layers are then stored flat layer by layer over the replicas, and the layer function "
    "gathers each one inside the layer scan: "
    "rp.pipeline.scan_layers(lambda p, h: layer_fn(rp.gather_params(p), h))."
)


def names(*entries) -> tuple:
    """The mesh axis names of ``PartitionSpec`` entries (a name, a tuple of names or None)."""
    return tuple(n for e in entries for n in mesh_lib.entry_axes(e))


def entry(axes: tuple) -> Any:
    """A ``PartitionSpec`` entry over ``axes``, major first: one name, or a tuple of them."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def stage_dim(x: Any, k: int) -> int | None:
    """The dimension of a global parameter split over ``stage`` (of size ``k`` > 1), or None;
    for a `ShardedParam`, that of its stored flat."""
    x = x.flat if isinstance(x, ShardedParam) else x
    spec = getattr(placement.sharding_of(x), "spec", None)
    if k == 1 or spec is None:
        return None
    dims = [d for d, e in enumerate(spec) if mesh_lib.STAGE_AXIS in names(e)]
    return dims[0] if dims else None


def stage_view(params: PyTree, k: int) -> tuple[PyTree, list]:
    """Global parameters as one device of a step holds them: each stage-split leaf's shape
    that of its block, with its split axes (``("stage",)``; ``()`` for the others)."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_sharded_param)
    avals, splits = [], []
    for x in leaves:
        dim = stage_dim(x, k)
        if dim is None:
            avals.append(x)
            splits.append(())
            continue
        node = x if isinstance(x, ShardedParam) else None
        shape = list(jnp.shape(x.flat if node else x))
        shape[dim] //= k
        aval = jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x.flat if node else x))
        avals.append(aval if node is None else ShardedParam(aval, node.shape))
        splits.append((mesh_lib.STAGE_AXIS,))
    return jax.tree.unflatten(treedef, avals), splits


def stage_dims(params: PyTree, k: int, *, api: str) -> dict:
    """Global shape of each stage-split parameter -> its stage dimension.

    Raises:
      ValueError: for a shape that is a stage-split parameter's and a whole one's (their
        optimizer states could not be told apart).
    """
    dims: dict[tuple[int, ...], int | None] = {}
    for path, p in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded_param)[0]:
        if isinstance(p, ShardedParam) or math.prod(jnp.shape(p)) <= 1:
            continue
        dim, shape = stage_dim(p, k), tuple(jnp.shape(p))
        if dims.setdefault(shape, dim) != dim:
            raise ValueError(
                f"{api}: parameter {jax.tree_util.keystr(path)} has the shape {shape} of "
                f"another parameter but is split over 'stage' differently, so their optimizer "
                f"states cannot be told apart; give one of them another shape (e.g. stack the "
                f"stage layers), or use zero_stage=0."
            )
    return {s: d for s, d in dims.items() if d is not None}


def by_blocks(x: jax.Array, dim: int, k: int, padded: int) -> jax.Array:
    """A whole state leaf stored by stage blocks: ``[K * padded]``, block ``s`` (part ``s`` of
    dimension ``dim``) flattened and zero-padded to ``padded`` elements."""
    shape = x.shape
    blocks = x.reshape((*shape[:dim], k, shape[dim] // k, *shape[dim + 1 :]))
    blocks = jnp.moveaxis(blocks, dim, 0).reshape((k, -1))
    return jnp.pad(blocks, ((0, 0), (0, padded - blocks.shape[1]))).reshape(-1)


def check_params(params: PyTree, mesh, *, stage: int) -> None:
    """Refuses parameters ZeRO cannot lay out: with ZeRO-1/2, parameters split over the
    replicas and stage blocks of one element; with ZeRO-3, stage blocks."""
    api = f"wrap_optimizer(zero_stage={stage})"
    k = dict(mesh.shape).get(mesh_lib.STAGE_AXIS, 1)
    for path, p in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded_param)[0]:
        spec = getattr(placement.sharding_of(p), "spec", None)
        where = f"parameter {jax.tree_util.keystr(path)}"
        on_data = set(mesh_lib.replica_axes(mesh)) & set(names(*(spec or ())))
        if stage < 3 and on_data:
            raise ValueError(
                f"{api}: {where} is sharded as {spec}, over the replica axes "
                f"{sorted(on_data)}; ZeRO-1/2 shard the optimizer state of parameters that are "
                f"whole on every replica (split over 'stage' or 'model' is fine). Place it "
                f"without the replica axes (repl.replicate, or repl.place with a spec over "
                f"'stage'/'model' only), or store the parameters sharded over the replicas "
                f"with zero_stage=3 (opt.shard_params)."
            )
        dim = stage_dim(p, k)
        if dim is not None and stage == 3 and not isinstance(p, ShardedParam):
            raise ValueError(ZERO3_STAGES.format(where=where, api=api))
        if dim is not None and stage < 3 and math.prod(jnp.shape(p)) == k:
            raise ValueError(
                f"{api}: {where} of shape {jnp.shape(p)} is split over 'stage' into blocks of "
                f"one element, which ZeRO cannot split over the replicas; keep such "
                f"parameters replicated (repl.replicate), or use zero_stage=0."
            )


def refuse_gathered(stage: int, reason: str | None, splits: tuple) -> None:
    """Refuses an update that cannot run on the slices when some values are stage blocks:
    gathering over the replicas would give one block, not the whole leaf."""
    if reason is None or not splits:
        return
    raise ValueError(
        f"wrap_optimizer(zero_stage={stage}): the optax transformation is not computed on "
        f"shards: {reason}. With parameters split over 'stage' it cannot run on gathered "
        f"arrays either: gathering over the replicas gives one stage's block, not the whole "
        f"parameter. Use an element-wise transformation (SGD, Adam, ...) or full reductions "
        f"(global-norm clipping, LAMB), or zero_stage=0 for this one (its state then split "
        f"over 'stage' like the parameters)."
    )
