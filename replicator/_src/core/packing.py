"""Trees of different shapes packed into one flat buffer per dtype, padded to the largest.

A pipeline whose stages differ still runs as one SPMD program: every device holds its stage's
parameters in buffers of one shape, and every stage passes its activation on in buffers of one
shape. A `Packing` is that layout for a list of trees (the stages' parameters, or the activations
at the stage boundaries): member ``j``'s leaves sit one after another in the buffer of their
dtype, and each buffer is as long as the largest member's share of it. The rest is padding,
zeros that no computation reads; its size is `padding_bytes`.

Integer and boolean leaves (token ids, masks) travel in an ``int32`` buffer and come back in
their own dtype; they are never differentiated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.core.typing import PyTree

_INT = "int32"


def buffer_key(dtype) -> str:
    """The buffer a leaf of ``dtype`` travels in: its own for floats, ``int32`` otherwise."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype.name
    if dtype == jnp.bool_ or (jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 32):
        return _INT
    if dtype == jnp.int32:
        return _INT
    raise TypeError(
        f"rp.pipeline.sequential: a stage's input or output has a leaf of dtype {dtype.name}, "
        f"which the packed activations cannot carry exactly; use floating dtypes, bool, or "
        f"integers of at most 32 bits (int32 for ids)."
    )


@dataclasses.dataclass(frozen=True)
class _Leaf:
    key: str  # the buffer
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Packing:
    """The layout of a list of trees in flat buffers, one per dtype (see the module docstring).

    Attributes:
      treedefs: each member's tree structure.
      leaves: each member's leaves: buffer, offset, shape and dtype.
      sizes: the length of each buffer, ``{dtype name: n}``: the largest member's share.
    """

    treedefs: tuple
    leaves: tuple[tuple[_Leaf, ...], ...]
    sizes: dict[str, int]

    @classmethod
    def of(cls, trees: Sequence[PyTree]) -> Packing:
        """The layout of ``trees`` (arrays or ``ShapeDtypeStruct``s; only shapes matter)."""
        treedefs, members, sizes = [], [], {}
        for tree in trees:
            flat, treedef = jax.tree.flatten(tree)
            used: dict[str, int] = {}
            leaves = []
            for a in flat:
                key = buffer_key(jnp.result_type(a))
                shape = tuple(int(d) for d in np.shape(a))
                leaves.append(_Leaf(key, used.get(key, 0), shape, jnp.dtype(jnp.result_type(a))))
                used[key] = used.get(key, 0) + math.prod(shape)
            for key, n in used.items():
                sizes[key] = max(sizes.get(key, 0), n)
            treedefs.append(treedef)
            members.append(tuple(leaves))
        return cls(tuple(treedefs), tuple(members), dict(sorted(sizes.items())))

    def __len__(self) -> int:
        return len(self.treedefs)

    def abstract(self, j: int) -> PyTree:
        """Member ``j``'s tree as ``ShapeDtypeStruct``s (nothing is allocated)."""
        flat = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.leaves[j]]
        return jax.tree.unflatten(self.treedefs[j], flat)

    def zeros(self, lead: tuple[int, ...] = ()) -> dict[str, jax.Array]:
        """Empty buffers ``{dtype: [*lead, n]}``."""
        return {k: jnp.zeros((*lead, n), k) for k, n in self.sizes.items()}

    def pack(self, j: int, tree: PyTree) -> dict[str, jax.Array]:
        """Member ``j``'s tree as buffers ``{dtype: [n]}``, zero-padded."""
        flat = jax.tree.leaves(tree)
        parts: dict[str, list] = {k: [] for k in self.sizes}
        for leaf, a in zip(self.leaves[j], flat, strict=True):
            parts[leaf.key].append(jnp.ravel(jnp.asarray(a).astype(leaf.key)))
        out = {}
        for key, n in self.sizes.items():
            used = sum(p.size for p in parts[key])
            parts[key].append(jnp.zeros((n - used,), key))
            out[key] = jnp.concatenate(parts[key])
        return out

    def unpack(self, j: int, buffers: dict[str, jax.Array]) -> PyTree:
        """Member ``j``'s tree from buffers ``{dtype: [*lead, n]}``, each leaf ``[*lead, ...]``."""
        return unpack_leaves(self.treedefs[j], self.leaves[j], buffers)

    def used_bytes(self, j: int) -> int:
        """The bytes member ``j``'s own leaves take in the buffers."""
        return sum(leaf.size * jnp.dtype(leaf.key).itemsize for leaf in self.leaves[j])

    def buffer_bytes(self) -> int:
        """The bytes of one set of buffers."""
        return sum(n * jnp.dtype(k).itemsize for k, n in self.sizes.items())

    def padding_bytes(self) -> int:
        """Over all members, the bytes of buffer that hold padding rather than leaves."""
        return len(self) * self.buffer_bytes() - sum(self.used_bytes(j) for j in range(len(self)))


def unpack_leaves(treedef, leaves: Sequence[_Leaf], buffers: dict[str, jax.Array]) -> PyTree:
    """A tree of structure ``treedef`` from ``leaves`` laid out in ``buffers``."""
    flat = []
    for leaf in leaves:
        buf = buffers[leaf.key]
        part = buf[..., leaf.offset : leaf.offset + leaf.size]
        flat.append(part.reshape((*buf.shape[:-1], *leaf.shape)).astype(leaf.dtype))
    return jax.tree.unflatten(treedef, flat)
