"""ZeRO's state rows of packed stages, and the logical rows a checkpoint holds instead.

With ZeRO on the packed stages of ``rp.pipeline.sequential`` (`zero_parts`), stage ``j``'s row
holds each replica's parts of the stage's state leaves, replica ``r``'s in segment ``r``:
``[K, N x seg]``, a layout of the replica count ``N`` (which axis of a leaf is split, and
whether it is, depends on ``N``). `SplitRows` is that dict of rows with its `RowsLayout`, and
saves as the logical rows: each stage's whole leaves packed as without ZeRO (``[K, n]``, the
rows of ``zero_stage=0``). So a checkpoint restores onto any data size and any ZeRO stage.

Equivalent to (``whole``, ``parts`` the two packings)::

    saved:    whole.pack(j, [concatenate(parts.unpack(j, seg_r) over r, axis=split)])  per stage
    restored: concatenate([parts.pack(j, [x.split(N, axis=split)[r]]) for r in range(N)])
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from replicator._src.core import collectives, placement
from replicator._src.core.packed import PackedStages
from replicator._src.core.packing import Packing
from replicator._src.optim import zero_layout
from replicator._src.optim.shards import Comm, Split, local_shape
from replicator._src.optim.stages.execution import Local


@dataclasses.dataclass(frozen=True)
class RowsLayout:
    """How ZeRO packs each stage's state leaves into a row for ``n`` replicas.

    Attributes:
      n: the replicas.
      lead: the rows' leading axes, ``(K,)`` or ``(V, K)``.
      leaves: for each logical stage, its state leaves: ``(shape, dtype name, split axis)``
        (None: whole on every replica).
    """

    n: int
    lead: tuple
    leaves: tuple

    def whole(self) -> Packing:
        """Each stage's whole leaves (the logical rows' packing)."""
        return Packing.of([tuple(jax.ShapeDtypeStruct(s, d) for s, d, _ in m) for m in self.leaves])

    def parts(self) -> Packing:
        """Each stage's parts on one replica (a segment's packing)."""
        comm = Comm(self.n)
        return Packing.of([
            tuple(jax.ShapeDtypeStruct(local_shape(s, Split(a), comm), d) for s, d, a in m)
            for m in self.leaves
        ])  # fmt: skip

    def stage_whole(self, j: int, row: dict) -> dict:
        """Stage ``j``'s split row ``{dtype: [N x seg]}`` as its logical row ``{dtype: [n]}``."""
        whole, parts, n = self.whole(), self.parts(), self.n
        segs = []
        for r in range(n):
            segs.append(
                parts.unpack(j, {k: row[k][r * m : (r + 1) * m] for k, m in parts.sizes.items()})
            )
        wholes = tuple(
            segs[0][i] if a is None else jnp.concatenate([s[i] for s in segs], axis=a)
            for i, (_, _, a) in enumerate(self.leaves[j])
        )
        return whole.pack(j, wholes)

    def to_logical(self, rows: dict) -> dict:
        """The split rows ``{dtype: [*lead, N x seg]}`` as the logical rows."""
        flat = {k: a.reshape(len(self.leaves), -1) for k, a in rows.items()}
        out = [
            self.stage_whole(j, {k: a[j] for k, a in flat.items()}) for j in range(len(self.leaves))
        ]
        return {
            k: jnp.stack([o[k] for o in out]).reshape((*self.lead, -1)) for k in self.whole().sizes
        }

    def from_logical(self, rows: dict) -> dict:
        """The logical rows as split rows (`to_logical` undone)."""
        whole, parts, n = self.whole(), self.parts(), self.n
        flat = {k: a.reshape(len(self.leaves), -1) for k, a in rows.items()}
        out = []
        for j, members in enumerate(self.leaves):
            wholes = whole.unpack(j, {k: flat[k][j] for k in whole.sizes})
            segs = [
                parts.pack(j, tuple(part(x, a, n, r) for x, (_, _, a) in zip(wholes, members)))
                for r in range(n)
            ]
            out.append({k: jnp.concatenate([s[k] for s in segs]) for k in parts.sizes})
        return {k: jnp.stack([o[k] for o in out]).reshape((*self.lead, -1)) for k in parts.sizes}


def part(x, a, n, r):
    """Replica ``r``'s part of ``x`` along axis ``a`` (None: all of it)."""
    if a is None:
        return x
    size = x.shape[a] // n
    return jax.lax.slice_in_dim(x, r * size, (r + 1) * size, axis=a)


class SplitRows(dict):
    """ZeRO's state rows of packed stages, ``{dtype: [*lead, N x seg]}``, with their
    `RowsLayout` (``layout``). A dict for every purpose but two: as a pytree node it keeps
    ``layout``, and a checkpoint saves it as the logical rows (`core.logical`)."""

    __slots__ = ("layout",)

    def __init__(self, layout: RowsLayout, rows: dict) -> None:
        super().__init__(rows)
        self.layout = layout

    def __repr__(self) -> str:
        return f"SplitRows({dict.__repr__(self)})"

    def __reduce__(self):
        return (SplitRows, (self.layout, dict(self)))

    def _logical_sharding(self, k: str):
        sharding = placement.sharding_of(self[k])  # under Replicator.abstract: as noted
        if not isinstance(sharding, NamedSharding):
            return sharding
        spec = tuple(sharding.spec) + (None,) * (self[k].ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[:-1]))

    def saved_like(self) -> dict:
        """The logical rows' shapes and shardings."""
        sizes = self.layout.whole().sizes
        return {
            k: jax.ShapeDtypeStruct(
                (*self.layout.lead, sizes[k]), self[k].dtype, sharding=self._logical_sharding(k)
            )
            for k in self
        }

    def saved(self) -> dict:
        """The logical rows (global arrays, split over ``stage`` only).

        Converted with each stage's rows whole on its devices (a row's segments are split
        over the data axes, which XLA would gather element by element): for the time of the
        conversion a device holds its stages' whole state, as without ZeRO.
        """
        shardings = {k: a.sharding for k, a in self.saved_like().items()}
        rows = placement.put(dict(self), shardings)
        return placement.put(_jit(self.layout.to_logical, shardings)(rows), shardings)

    def restored(self, rows: dict) -> SplitRows:
        """Logical ``rows`` in this node's layout and shardings."""
        stage_only = {k: a.sharding for k, a in self.saved_like().items()}
        split = _jit(self.layout.from_logical, stage_only)(dict(rows))
        return self.with_rows(
            placement.put(split, {k: placement.sharding_of(a) for k, a in self.items()})
        )

    def with_rows(self, rows: dict) -> SplitRows:
        """A node like this one holding ``rows``."""
        return SplitRows(self.layout, rows)


class SplitStages(SplitRows):
    """ZeRO-3's packed stage parameters: each stage's leaves split over the replicas, replica
    ``r``'s parts in segment ``r`` of the stage's row (``{dtype: [*lead, N x seg]}``), with the
    model (``model``). Inside a step `gathered` makes them the model's `PackedStages` (what
    ``rp.gather_params`` calls); a checkpoint saves those rows, the parameters of ZeRO-0/1/2."""

    __slots__ = ("model",)
    holds_stage_rows = True  # `core.packed.is_stage_rows`

    def __init__(self, layout: RowsLayout, model, rows: dict) -> None:
        super().__init__(layout, rows)
        self.model = model

    def __repr__(self) -> str:
        return f"SplitStages({dict.__repr__(self)})"

    def __reduce__(self):
        return (SplitStages, (self.layout, self.model, dict(self)))

    def with_rows(self, rows: dict) -> SplitStages:
        return SplitStages(self.layout, self.model, rows)

    def packed(self) -> PackedStages:
        """Outside a step: the whole parameters, as the model packs them (global arrays)."""
        return PackedStages(self.model, self.saved())

    def gathered(self) -> PackedStages:
        """Inside a step: this device's stages' whole rows, gathered over the replicas (each
        replica's segment), as the model packs them. Outside one, the global rows."""
        loc = Local(self.model)
        full = loc.rows({k: collectives.gather_replicas(a, a.ndim - 1) for k, a in self.items()})

        def branch(si):
            rows = [self.layout.stage_whole(j, {k: a[r, s] for k, a in full.items()})
                    for r, s, j in loc.stages(si)]  # fmt: skip
            return loc.stack(rows)

        rows = loc.switch(branch)
        return PackedStages(
            self.model, {k: a.reshape((*self[k].shape[:-1], -1)) for k, a in rows.items()}
        )


def split_stages(node: PackedStages, mesh, n: int, spec) -> SplitStages:
    """ZeRO-3's `SplitStages` of the packed parameters ``node`` for ``n`` replicas, placed with
    ``spec`` (over ``stage`` and the data axes): each leaf split along `zero_layout.split_dim`."""
    model = node.model
    lead = tuple(next(iter(node.values())).shape[:-1])
    leaves = []
    for j in range(math.prod(lead)):
        stage = jax.tree.leaves(model.abstract_stage(j))
        leaves.append(tuple(
            (tuple(a.shape), jnp.dtype(a.dtype).name, zero_layout.split_dim(a.shape, None, n))
            for a in stage
        ))  # fmt: skip
    layout = RowsLayout(n, lead, tuple(leaves))
    like = SplitStages(layout, model, {k: jax.ShapeDtypeStruct(
        (*lead, layout.parts().sizes[k] * n), a.dtype, sharding=NamedSharding(mesh, spec))
        for k, a in node.items()})  # fmt: skip
    return like.restored(dict(node))


def _jit(f, shardings: dict):
    """``f`` jitted with ``shardings`` for its outputs when they are all known."""
    known = all(isinstance(x, jax.sharding.Sharding) for x in shardings.values())
    return jax.jit(f, out_shardings=shardings) if known else jax.jit(f)


def _aux(p: SplitRows):
    return (tuple(sorted(p)), p.layout, getattr(p, "model", None))


def _flatten_with_keys(p: SplitRows):
    aux = _aux(p)
    return [(jax.tree_util.DictKey(k), p[k]) for k in aux[0]], aux


def _flatten(p: SplitRows):
    aux = _aux(p)
    return [p[k] for k in aux[0]], aux


def _unflatten(aux, children) -> SplitRows:
    keys, layout, model = aux
    rows = dict(zip(keys, children, strict=True))
    return SplitRows(layout, rows) if model is None else SplitStages(layout, model, rows)


for _cls in (SplitRows, SplitStages):
    jax.tree_util.register_pytree_with_keys(_cls, _flatten_with_keys, _unflatten, _flatten)


def layout_of(lay, zs, lead: tuple) -> RowsLayout:
    """The `RowsLayout` of a `stagewise` layout ``lay`` split as ``zs`` (`zero_parts`)."""
    leaves = []
    for j in range(math.prod(lead)):
        idx = [i for i, w in enumerate(lay.s_where) if w == j]
        leaves.append(tuple(
            (tuple(lay.s_avals[i].shape), jnp.dtype(lay.s_avals[i].dtype).name, zs.s[i])
            for i in idx
        ))  # fmt: skip
    return RowsLayout(zs.n, tuple(lead), tuple(leaves))


def whole_params(params):
    """``params`` with each `SplitStages` node as the model's whole `PackedStages` (outside a
    step: global arrays)."""
    split = lambda x: isinstance(x, SplitStages)
    return jax.tree.map(lambda x: x.packed() if split(x) else x, params, is_leaf=split)
