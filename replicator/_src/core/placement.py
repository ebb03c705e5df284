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


#: Where `to_host` keeps a leaf (a JAX memory kind): the host's memory, pinned for the DMA.
HOST_MEMORY = "pinned_host"


def to_host(tree: PyTree) -> PyTree:
    """Every placed leaf of ``tree`` moved to its host's memory, keeping its sharding.

    Outside ``step_fn``: parameters or optimizer state kept in host memory between steps and
    brought to the device where a step uses them (`to_device`), as MaxText's
    ``parameter_memory_host_offload`` and ``optimizer_memory_host_offload``. A step's
    ``DistributedOptimizer.step`` and ``update`` put what they were given from host memory back
    there; inside ``step_fn`` ``to_host`` does so for new values a step makes itself.

    >>> import jax, jax.numpy as jnp, replicator as rp
    >>> repl = rp.Replicator(devices=jax.devices()[:2])
    >>> params = rp.to_host(repl.replicate({"w": jnp.ones(4)}))
    >>> params["w"].sharding.memory_kind
    'pinned_host'

    Raises:
      ValueError: for a leaf with no sharding of its own (place it first).
    """

    def move(path, leaf):
        if isinstance(leaf, jax.core.Tracer) and not recording_active():  # inside a step
            return jax.device_put(leaf, jax.memory.Space.Host)
        sharding = sharding_of(leaf)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            raise ValueError(
                f"rp.to_host: the leaf at {jax.tree_util.keystr(path)} has no NamedSharding "
                f"(got {sharding!r}); place the tree on the mesh first (repl.replicate, "
                f"repl.place, opt.init, opt.shard_params), then move it to the host."
            )
        return put(leaf, sharding.with_memory_kind(HOST_MEMORY))

    return jax.tree_util.tree_map_with_path(move, tree)


def in_host_memory(leaf: Any) -> bool:
    """Whether ``leaf`` (an array, or a traced value inside a step) is kept in host memory."""
    if isinstance(leaf, jax.core.Tracer) or not hasattr(leaf, "sharding"):
        space = getattr(jax.typeof(leaf), "memory_space", None) if hasattr(leaf, "dtype") else None
        return space == jax.memory.Space.Host
    return getattr(leaf.sharding, "memory_kind", None) == HOST_MEMORY


def to_device(tree: PyTree) -> PyTree:
    """``tree`` with each leaf kept in host memory (`to_host`) copied to the device.

    Inside ``step_fn``, before a step computes with them (outside it, the same copy); a leaf
    on the device already is left as it is.

    >>> import jax.numpy as jnp
    >>> to_device({"w": jnp.ones(2)})["w"]   # already on the device: unchanged
    Array([1., 1.], dtype=float32)
    """
    return jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x, tree
    )


def like_spaces(tree: PyTree, like: PyTree) -> PyTree:
    """``tree`` with each leaf moved back to host memory where the same leaf of ``like`` was
    kept there: a step's new state where its old state was (a leaf on the device stays)."""
    hosted = [in_host_memory(x) for x in jax.tree.leaves(like)]
    leaves, treedef = jax.tree.flatten(tree)
    if not any(hosted):
        return tree
    if len(leaves) != len(hosted):
        raise ValueError(
            f"like_spaces: {len(leaves)} leaves where the tree they replace had {len(hosted)}."
        )
    moved = [
        jax.device_put(x, jax.memory.Space.Host) if h else x
        for x, h in zip(leaves, hosted, strict=True)
    ]
    return jax.tree.unflatten(treedef, moved)
