"""State held in a layout of one mesh, saved as the logical arrays it stands for.

Most state is its logical arrays already: a ZeRO leaf keeps its own shape, only its sharding
depends on the mesh. A few nodes cannot: ZeRO's packed stages (`stages.zero_parts.SplitRows`)
hold each replica's parts of a stage's leaves side by side, a layout of the replica count.
Such a node has three methods, and a checkpoint calls them (`saved`, `saved_like`,
`restored`), so that what it writes is the same for every mesh:

* ``saved()``: the logical arrays (global arrays, placed without the mesh-only split);
* ``saved_like()``: their ``jax.ShapeDtypeStruct`` values (the node's leaves may be abstract);
* ``restored(tree)``: a node of this one's layout (and shardings) holding ``tree``'s arrays.

Equivalent to: ``restored(saved(x)) == x`` for every such node ``x``, on any mesh.
"""

from __future__ import annotations

from typing import Any

import jax

from replicator._src.core.typing import PyTree


def is_node(x: Any) -> bool:
    """Whether ``x`` is held in a layout of its mesh (it has the three methods)."""
    return all(hasattr(type(x), m) for m in ("saved", "saved_like", "restored"))


def saved(tree: PyTree) -> PyTree:
    """``tree`` with each such node replaced by its logical arrays."""
    return jax.tree.map(lambda x: x.saved() if is_node(x) else x, tree, is_leaf=is_node)


def saved_like(tree: PyTree) -> PyTree:
    """``tree`` with each such node replaced by its logical arrays' shapes and shardings."""
    return jax.tree.map(lambda x: x.saved_like() if is_node(x) else x, tree, is_leaf=is_node)


def restored(like: PyTree, tree: PyTree) -> PyTree:
    """``tree`` (``saved_like(like)``'s structure) in ``like``'s layout again."""
    return jax.tree.map(
        lambda node, x: node.restored(x) if is_node(node) else x, like, tree, is_leaf=is_node
    )
