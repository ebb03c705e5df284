"""A `SequentialStages` model as steps: what each pipeline iteration runs on each stage.

A stage is one or more parts in order (`stages_from_layers` chains them): a plain part is one
step, and a `scan_layers` run of L layers is L steps of its layer function, so the schedules step
through a run's layers one per iteration of their scan, as they do for identical stages. The
compiled program then holds each distinct step once, with no loop inside a stage, and is the same
whatever the number of layers per stage; 1F1B and ZeroBubble recompute one layer at a time.

A stage row packs two segments per dtype:
- the shared segment: the plain parts' parameters of that stage (`Packing`, padded to the
  largest stage), which any step of the stage may read; their gradient sums over its steps;
- the layer segment: ``[Lv, n]``, step ``i``'s layer parameters in slot ``i`` (padded to the
  largest layer); Lv is the most steps of any stage, and a stage with fewer ends on steps that
  pass the activation on unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from replicator._src.core.collectives import divergent
from replicator._src.core.packing import Packing, unpack_leaves
from replicator._src.core.typing import PyTree
from replicator._src.pipeline.layer_stack import Program, _ScanLayers


@dataclasses.dataclass(frozen=True)
class Chain:
    """A stage made of runs of layers: ``for fn, p in zip(fns, params): x = fn(p, x)``."""

    fns: tuple[Callable, ...]

    def __call__(self, params: tuple, x: PyTree) -> PyTree:
        for fn, p in zip(self.fns, params, strict=True):
            x = fn(p, x)
        return x


@dataclasses.dataclass(frozen=True)
class _Step:
    fn: Callable  # fn(params, x) -> y: a plain part, or one layer of a scan_layers run
    plain: int  # a plain part: its position among the stage's plain parts; -1 for a layer
    member: int  # a layer: its member of the layer packing; -1 for a plain part
    part: int  # the part of the stage it belongs to
    row: int  # a layer: its row in the run's stacked parameters


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def _parts(fn: Callable, params: PyTree) -> list[tuple[Callable, PyTree, int]]:
    """A stage's parts: ``(fn, params, L)``, with L the layers of a `scan_layers` run whose
    parameters are stacked, else 0."""
    if isinstance(fn, Chain) and isinstance(params, tuple | list) and len(params) == len(fn.fns):
        pairs = list(zip(fn.fns, params, strict=True))
    else:
        pairs = [(fn, params)]
    out = []
    for f, p in pairs:
        leads = {(np.shape(a) or (0,))[0] for a in jax.tree.leaves(p)}
        scanned = isinstance(f, _ScanLayers) and len(leads) == 1 and min(leads) >= 1
        out.append((f, p, min(leads) if scanned else 0))
    return out


class StageLayout:
    """Where each stage's parameters sit in its packed row, and the steps that read them.

    Duck-types the parts of `Packing` that describe a row (``sizes``, ``abstract``,
    ``used_bytes``, ``buffer_bytes``, ``padding_bytes``, ``len``), so that ``explain`` reports
    the padding of the row as it is.
    """

    def __init__(self, fns: Sequence[Callable], params: Sequence[PyTree]) -> None:
        self.fns = tuple(fns)
        self.trees = [_abstract(p) for p in params]
        self.steps: list[list[_Step]] = []
        shared, layer_trees = [], []
        for fn, p in zip(fns, self.trees, strict=True):
            steps, plain = [], []
            for q, (f, part, n) in enumerate(_parts(fn, p)):
                if not n:
                    steps.append(_Step(f, len(plain), -1, q, 0))
                    plain.append(part)
                for r in range(n):
                    steps.append(_Step(f.layer_fn, -1, len(layer_trees), q, r))
                    row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), part)
                    layer_trees.append(row)
            self.steps.append(steps)
            shared.append(tuple(plain))
        self.shared, self.layers = Packing.of(shared), Packing.of(layer_trees)
        self.lv = max(len(s) for s in self.steps)
        keys = sorted(set(self.shared.sizes) | set(self.layers.sizes))
        self.n_shared = {k: self.shared.sizes.get(k, 0) for k in keys}
        self.n_layer = {k: self.layers.sizes.get(k, 0) for k in keys}
        self.sizes = {k: self.n_shared[k] + self.lv * self.n_layer[k] for k in keys}

    def __len__(self) -> int:
        return len(self.trees)

    def abstract(self, j: int) -> PyTree:
        """Stage ``j``'s parameter tree as ``ShapeDtypeStruct``s."""
        return self.trees[j]

    def pack(self, j: int, tree: PyTree) -> dict[str, jax.Array]:
        """Stage ``j``'s parameters as its row ``{dtype: [n]}``, zero-padded."""
        parts = _parts(self.fns[j], tree)
        shared = self.shared.pack(j, tuple(p for _, p, n in parts if not n))
        slots = []
        for i in range(self.lv):
            step = self.steps[j][i] if i < len(self.steps[j]) else None
            if step is None or step.member < 0:
                slots.append({k: jnp.zeros((n,), k) for k, n in self.n_layer.items()})
                continue
            row = jax.tree.map(lambda a, r=step.row: jnp.asarray(a)[r], parts[step.part][1])
            slots.append(self.layers.pack(step.member, row))
        return {
            k: jnp.concatenate(
                [shared.get(k, jnp.zeros((0,), k)), *(s.get(k, jnp.zeros((0,), k)) for s in slots)]
            )
            for k in self.sizes
        }

    def unpack(self, j: int, row: dict[str, jax.Array]) -> PyTree:
        """Stage ``j``'s parameter tree from its row ``{dtype: [n]}``."""
        shared, layers = self.split({k: a[None] for k, a in row.items()})
        plain = self.shared.unpack(j, {k: a[0] for k, a in shared.items()})
        runs: dict[int, list] = {}
        for i, step in enumerate(self.steps[j]):
            if step.member >= 0:
                slot = {k: a[0, i] for k, a in layers.items()}
                runs.setdefault(step.part, []).append(self.layers.unpack(step.member, slot))
        leaves = []
        for step in self.steps[j]:
            if step.member < 0:
                leaves += jax.tree.leaves(plain[step.plain])
            elif step.row == 0:
                stacked = jax.tree.map(lambda *a: jnp.stack(a), *runs[step.part])
                leaves += jax.tree.leaves(stacked)
        return jax.tree.unflatten(jax.tree.structure(self.trees[j]), leaves)

    def split(self, rows: dict[str, jax.Array]) -> tuple[dict, dict]:
        """Rows ``{dtype: [V, n]}`` as (shared ``[V, n_shared]``, layers ``[V, Lv, n_layer]``)."""
        shared = {k: a[:, : self.n_shared[k]] for k, a in rows.items()}
        layers = {
            k: a[:, self.n_shared[k] :].reshape(a.shape[0], self.lv, self.n_layer[k])
            for k, a in rows.items()
        }
        return shared, layers

    def as_rows(self, layers: dict, shared: dict) -> dict[str, jax.Array]:
        """The inverse of `split`, for the gradients of the layers and the shared parameters."""
        return {
            k: jnp.concatenate(
                [shared[k], layers[k].reshape(layers[k].shape[0], self.lv * self.n_layer[k])],
                axis=-1,
            )
            for k in self.sizes
        }

    def used_bytes(self, j: int) -> int:
        """The bytes stage ``j``'s own parameters take in its row."""
        steps = [s for s in self.steps[j] if s.member >= 0]
        return self.shared.used_bytes(j) + sum(self.layers.used_bytes(s.member) for s in steps)

    def buffer_bytes(self) -> int:
        """The bytes of one row."""
        return sum(n * jnp.dtype(k).itemsize for k, n in self.sizes.items())

    def padding_bytes(self) -> int:
        """Over all stages, the bytes of rows that hold padding rather than parameters."""
        return len(self) * self.buffer_bytes() - sum(self.used_bytes(j) for j in range(len(self)))

    # -- the activations between steps, and the program ------------------------------------

    def wire(self, x: PyTree) -> Packing:
        """The layout of the activations at every step boundary, from one micro-batch's input:
        member ``g`` is the input of the ``g``-th step in model order, the last the output."""
        shapes = [_abstract(x)]
        for j, steps in enumerate(self.steps):
            plain = self.shared.abstract(j)
            for step in steps:
                p = plain[step.plain] if step.member < 0 else self.layers.abstract(step.member)
                shapes.append(jax.eval_shape(step.fn, p, shapes[-1]))
        return Packing.of(shapes)

    def program(self, rows: dict[str, jax.Array], wire: Packing) -> Program:
        """What the schedules run: step ``li`` of stage ``j`` is ``lax.switch`` over the
        distinct steps, and a stage past its last step passes the activation on."""
        shared, layers = self.split(rows)
        table, branches = self._branches(wire)

        def layer_fn(lp, sp, x, j, li):
            if len(branches) == 1:
                return branches[0](lp, sp, x)
            with divergent("a pipeline of stages that differ (each device its own branch)"):
                return lax.switch(jnp.asarray(table)[j, li], branches, lp, sp, x)

        last = len(wire) - 1
        return Program(
            layer_fn, layers, self.lv, shared,
            enter=lambda x: wire.pack(0, x),
            leave=lambda w: wire.unpack(last, w),
            enter_t=lambda g: wire.unpack(0, g),
        )  # fmt: skip

    def _branches(self, wire: Packing) -> tuple[np.ndarray, list[Callable]]:
        """The branch each (stage, step) runs, and the branches: one per distinct step (one
        function object on parameters, input and output laid out alike) and one that passes
        the activation on."""
        table = np.zeros((len(self), self.lv), np.int32)
        keys: dict = {("identity",): 0}
        branches: list[Callable] = [lambda lp, sp, x: x]
        g = 0  # the step's input in the wire
        for j, steps in enumerate(self.steps):
            for i, step in enumerate(steps):
                layout = (
                    wire.treedefs[g],
                    wire.leaves[g],
                    wire.treedefs[g + 1],
                    wire.leaves[g + 1],
                )
                if step.member < 0:
                    own = self._plain_part(j, step.plain)
                else:
                    own = (self.layers.treedefs[step.member], self.layers.leaves[step.member])
                key = (id(step.fn), step.member < 0, own, layout)  # read from sp, or lp
                if key not in keys:
                    keys[key] = len(branches)
                    branches.append(self._branch(step, own, wire, g))
                table[j, i] = keys[key]
                g += 1
        return table, branches

    def _plain_part(self, j: int, q: int) -> tuple:
        """The structure and leaves (in the shared buffers) of stage ``j``'s plain part ``q``."""
        parts = jax.tree.structure(self.shared.abstract(j)).children()
        lo = sum(t.num_leaves for t in parts[:q])
        return parts[q], self.shared.leaves[j][lo : lo + parts[q].num_leaves]

    def _branch(self, step: _Step, own: tuple, wire: Packing, g: int) -> Callable:
        def run(lp, sp, x):
            p = unpack_leaves(*own, sp if step.member < 0 else lp)
            return wire.pack(g + 1, step.fn(p, wire.unpack(g, x)))

        return run
