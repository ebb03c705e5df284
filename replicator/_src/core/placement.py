"""Placement on the mesh that `Replicator.abstract` can see.

``jax.eval_shape`` keeps a ``device_put``'s sharding in the shapes only on meshes with explicit
axes. Every placement the library makes goes through `put`, which, while `recording` is active,
also notes the sharding of each placed (traced) leaf, so that an abstract state gets the same
shardings as the real one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from replicator._src.core import scoped
from replicator._src.core.typing import PyTree

_TABLES: scoped.Stack[dict[int, tuple[Any, Any]]] = scoped.Stack()


def put(tree: PyTree, shardings: Any) -> PyTree:
    """``jax.device_put(tree, shardings)``, noted for `recording` (one sharding or a tree)."""
    out = jax.device_put(tree, shardings)
    if _TABLES:
        leaves = jax.tree.leaves(out)
        if isinstance(shardings, jax.sharding.Sharding):
            per_leaf = [shardings] * len(leaves)
        else:
            per_leaf = jax.tree.leaves(
                shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
            )
        for leaf, sharding in zip(leaves, per_leaf, strict=True):
            _TABLES.top()[id(leaf)] = (leaf, sharding)  # the leaf kept alive: ids stay unique
    return out


@contextlib.contextmanager
def recording() -> Iterator[dict[int, tuple[Any, Any]]]:
    """Notes, by leaf identity, the sharding of every leaf `put` places within the block."""
    with _TABLES.push({}) as table:
        yield table


def recorded_sharding(table: dict[int, tuple[Any, Any]], leaf: Any) -> Any:
    """The sharding `put` gave ``leaf`` while ``table`` was recording, or None."""
    entry = table.get(id(leaf))
    return entry[1] if entry is not None and entry[0] is leaf else None


def recording_active() -> bool:
    """Whether a `recording` block is open (a state is being built from shapes)."""
    return bool(_TABLES)


def sharding_of(leaf: Any) -> Any:
    """``leaf``'s sharding: its own if concrete, else the one `put` recorded for it, or None."""
    if not isinstance(leaf, jax.core.Tracer):
        return getattr(leaf, "sharding", None)
    return recorded_sharding(_TABLES.top(), leaf) if _TABLES else None
