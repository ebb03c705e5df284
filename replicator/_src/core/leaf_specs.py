"""The ``PartitionSpec`` of each leaf a `Replicator` places, plans or runs on its mesh.

`place` and `abstract` put a tree on the mesh with a spec (``Replicator.place``,
``Replicator.replicate``, ``Replicator.abstract``). `state_specs` and `arg_spec` read back the
spec each leaf of a step's state and arguments is run with (``Replicator.run``): a leaf keeps
its own sharding on this mesh; other state is replicated and other arguments are global batches
split over the replicas. `placement_key` is what the step cache compares instead, cheaply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import errors, placement
from replicator._src.core import mesh as mesh_lib
from replicator._src.core.typing import PyTree


def place(mesh: Mesh, tree: PyTree, spec: PartitionSpec | PyTree) -> PyTree:
    """``Replicator.place``: every leaf of ``tree`` as a global array of its spec on ``mesh``,
    owning its buffers; with several processes, process 0's values. ``spec`` is one
    ``PartitionSpec`` for every leaf, or a tree of them that is a prefix of ``tree``."""
    shardings = leaf_shardings(mesh, tree, spec, api="Replicator.place")
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))
    if jax.process_count() > 1 and not traced:  # traced (`abstract`): shapes and shardings only
        tree = broadcast_one_to_all(tree)
        return jax.tree.map(lambda x, s: _global_copy(np.asarray(x), s), tree, shardings)
    # ``device_put`` reuses a device buffer that already holds the value (even with
    # ``may_alias=False``, on the jax releases compat.py names); ``run`` donates the state,
    # which would delete the caller's array. Copy first, so the placed state owns its buffers.
    # An explicit dtype also drops JAX's weak type (jnp.full(3, 0.1) is weakly typed), which
    # the step's new state would not have: the second step would compile again.
    tree = jax.tree.map(
        lambda x: jnp.array(x, dtype=x.dtype, copy=True) if isinstance(x, jax.Array) else x,
        tree,
    )
    return placement.put(tree, shardings)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def leaf_shardings(mesh: Mesh, tree: PyTree, spec: PartitionSpec | PyTree, *, api: str) -> PyTree:
    """A ``NamedSharding`` for each leaf of ``tree``, from one spec or a prefix tree of specs.

    Raises:
      TypeError: if ``spec`` is neither a ``PartitionSpec`` nor a tree of them.
      ValueError: if ``spec``'s tree is not a prefix of ``tree``, names an axis the mesh
        cannot know, or splits a dimension into parts that do not divide it.
    """
    if _is_spec(spec):
        specs = jax.tree.map(lambda _: spec, tree)
    else:
        if not all(map(_is_spec, jax.tree.leaves(spec, is_leaf=_is_spec))):
            mesh_lib.fit_spec(spec, mesh, api=api)  # raises its TypeError
        try:
            specs = jax.tree.broadcast(spec, tree, is_leaf=_is_spec)
        except ValueError as e:
            raise ValueError(
                f"{api}: the tree of specs must have the structure of the tree placed, or of a "
                f"prefix of it (one spec for a whole subtree); got specs "
                f"{jax.tree.structure(spec, is_leaf=_is_spec)} for a tree "
                f"{jax.tree.structure(tree)}."
            ) from e
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = []
    for (path, leaf), leaf_spec in zip(
        paths, jax.tree.leaves(specs, is_leaf=_is_spec), strict=True
    ):
        fitted = mesh_lib.fit_spec(leaf_spec, mesh, api=api)
        _check_divides(np.shape(leaf), fitted, mesh, api, jax.tree_util.keystr(path))
        # Without trailing Nones, as XLA gives a step's outputs: the next step then sees the
        # same sharding and runs the same program.
        entries = list(fitted)
        while entries and entries[-1] is None:
            entries.pop()
        out.append(NamedSharding(mesh, PartitionSpec(*entries)))
    return jax.tree.unflatten(jax.tree.structure(tree), out)


def _check_divides(shape: tuple, spec: PartitionSpec, mesh: Mesh, api: str, path: str) -> None:
    """Refuses a spec longer than the leaf's rank, or one whose split does not divide."""
    what = f"leaf {path} of shape {list(shape)}" if path else f"a leaf of shape {list(shape)}"
    if len(spec) > len(shape):
        raise ValueError(
            f"{api}: {spec} has {len(spec)} entries but {what} has {len(shape)} dimensions; "
            f"give one entry per dimension at most."
        )
    bad = mesh_lib.indivisible_split(shape, spec, mesh.shape)
    if bad is not None:
        dim, parts, names = bad
        raise ValueError(
            f"{api}: {what} cannot be split by {spec}: dimension {dim} has size "
            f"{shape[dim]}, which does not divide over {parts} devices of "
            f"{', '.join(repr(n) for n in names)}. Use a size that is a multiple of {parts} "
            f"(e.g. {parts * -(-shape[dim] // parts)}), or leave that dimension whole "
            f"(None in the spec)."
        )


def _global_copy(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array of ``sharding`` from a host value that every process holds."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def abstract(mesh: Mesh, init_fn: Callable[[], PyTree]) -> PyTree:
    """``Replicator.abstract``: ``init_fn()``'s state as ``jax.ShapeDtypeStruct`` leaves with
    their ``NamedSharding`` on ``mesh``, traced under ``jax.eval_shape``.

    Raises:
      ValueError: if a leaf was not placed on ``mesh`` (`errors.UNPLACED_SHAPE`).
    """
    recorded = []

    def traced():
        state = init_fn()
        recorded.extend(placement.recorded_sharding(table, x) for x in jax.tree.leaves(state))
        return state

    with placement.recording() as table:
        shapes = jax.eval_shape(traced)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = []
    for (path, x), sharding in zip(flat, recorded, strict=True):
        spec = spec_of(mesh, x) if sharding is None else spec_of_sharding(mesh, sharding)
        if spec is None:
            raise ValueError(errors.UNPLACED_SHAPE.format(path=jax.tree_util.keystr(path), got=x))
        kind = getattr(sharding if sharding is not None else x.sharding, "memory_kind", None)
        placed = NamedSharding(mesh, spec, memory_kind=kind)  # in host memory: `placement.to_host`
        leaves.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed))
    return jax.tree.unflatten(treedef, leaves)


def spec_of(mesh: Mesh, x: Any) -> PartitionSpec | None:
    """The spec of ``x``'s sharding on ``mesh``, or None if it has none there."""
    return spec_of_sharding(mesh, getattr(x, "sharding", None))


def spec_of_sharding(mesh: Mesh, sharding: Any) -> PartitionSpec | None:
    """``sharding``'s spec if it is a ``NamedSharding`` on ``mesh`` (or on its abstract mesh,
    for a shape traced under ``jax.eval_shape``), else None."""
    if isinstance(sharding, NamedSharding) and sharding.mesh in (mesh, mesh.abstract_mesh):
        return sharding.spec
    return None


def state_specs(mesh: Mesh, state_leaves: list, state_def: Any) -> tuple[PartitionSpec, ...]:
    """Each state leaf's spec: its own on this mesh, else replicated. A shape without a
    sharding on this mesh is refused: its placement would be a guess."""
    specs = []
    for i, x in enumerate(state_leaves):
        spec = spec_of(mesh, x)
        if spec is None and isinstance(x, jax.ShapeDtypeStruct):
            state = jax.tree.unflatten(state_def, state_leaves)
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(state)[0][i][0])
            raise ValueError(errors.UNPLACED_SHAPE.format(path=path or "(the state)", got=x))
        specs.append(spec or PartitionSpec())
    return tuple(specs)


def arg_spec(mesh: Mesh, x: Any, index: int, args: tuple) -> PartitionSpec:
    """The spec argument leaf ``index`` of ``args`` runs with: its own on this mesh; whole for
    a scalar; else a global batch split over the replicas along its first axis.

    Raises:
      ValueError: if that first axis does not divide by the number of replicas.
    """
    spec = spec_of(mesh, x)
    if spec is not None:
        return spec
    if np.ndim(x) == 0:
        return PartitionSpec()
    n = mesh_lib.num_replicas(mesh)
    if np.shape(x)[0] % n:
        path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(args)[0][index][0])
        raise ValueError(
            f"Replicator.run: argument leaf args{path} of shape {np.shape(x)} is taken as a "
            f"global batch, but its first axis ({np.shape(x)[0]}) does not split over "
            f"{n} replicas. Use a multiple of {n}, or pass values every replica should see "
            f"whole through repl.replicate(...)."
        )
    return mesh_lib.batch_spec(mesh)


def placement_key(x: Any) -> tuple:
    """What, besides structure, decides how ``run`` places a leaf: its sharding and shape."""
    return getattr(x, "sharding", None), getattr(x, "shape", None) or np.shape(x)
