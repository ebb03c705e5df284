"""Reading checkpoints that hold ZeRO's rows of packed stages as each replica's parts.

ZeRO on the packed stages of ``rp.pipeline.sequential`` holds a stage's optimizer state (and
with ZeRO-3 its parameters) as each replica's parts side by side (`stages.split_rows`), a
layout of the replica count. Checkpoints hold the logical rows instead (what `core.logical`
saves); for a while they held the split rows, saved with their last axis split over the data
axes. Such a leaf cannot be read as logical rows: it is read as saved and made logical with
the layout of the state to restore into when that state has as many replicas, and refused
(naming the data size that restores it) when it has not. Equivalent to::

    logical = node.layout.to_logical(saved rows)      # N replicas saved, N in the state
"""

from __future__ import annotations

import math

import jax

from replicator._src.core import logical
from replicator._src.core import mesh as mesh_lib
from replicator._src.training import flat_layout
from replicator._src.training.zero_stages import orbax_name


def nodes_by_name(like) -> dict:
    """``{orbax name: (node, key)}`` of each leaf of ``like`` that a logical node holds."""
    out = {}
    flat = jax.tree_util.tree_flatten_with_path(like, is_leaf=logical.is_node)[0]
    for path, node in flat:
        if logical.is_node(node):
            for key in node:
                out[f"{orbax_name(path)}.{key}"] = (node, key)
    return out


def saved_replicas(meta) -> int:
    """The replicas a saved leaf's last axis was split over (1 if none)."""
    split = flat_layout._last_axis_split(meta)
    return math.prod(n for a, n in split.items() if a in mesh_lib.DATA_AXES)


def refusal(step: int, shown: str, saved: int, node) -> str:
    """A split-rows leaf saved for ``saved`` replicas, restored into ``node``'s count."""
    return (
        f"rp.Checkpoints.restore: leaf {shown} of checkpoint step {step} holds ZeRO's rows of "
        f"pipeline.sequential stages as the parts of {saved} replicas side by side (written "
        f"before checkpoints held the logical rows), and the state to restore into has "
        f"{node.layout.n} replicas. Restore it once with {saved} replicas (mesh data={saved}; "
        f"replicator train: mesh.data={saved} and cpu_devices to match) and save again: that "
        f"checkpoint restores at any data size."
    )


def convert(found: dict, leaves: list, wants: list) -> None:
    """Replaces, in ``leaves``, each node's split rows read as saved by its logical rows.

    ``found``: ``{id(node): (node, {key: leaf index})}``."""
    for node, keys in found.values():
        rows = {k: leaves[i] for k, i in keys.items()}
        shardings = {k: wants[i].sharding for k, i in keys.items()}
        out = jax.jit(node.layout.to_logical, out_shardings=shardings)(rows)
        for k, i in keys.items():
            leaves[i] = out[k]
