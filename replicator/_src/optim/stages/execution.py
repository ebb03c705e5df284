"""One update of packed stages: the placed program run in rounds (see `transform`).

`StageRun` runs a `program.StageProgram` inside a step: each device unpacks the rows of
the stages it holds, computes their values under a ``lax.switch`` on its stage index, exports
what the glue reads (gathered over ``stage``), runs the glue everywhere, and in a last pass packs
each stage's updates and state back into rows. Values are held as the evaluator holds them:
plain arrays here; ZeRO's parts in `zero_parts.ZeroStageRun`, which overrides the hooks
(``stage_inputs``, ``run``, ``whole``, ``state_value``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src.core import collectives
from replicator._src.core.binding import current_binding
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.packed import (
    PackedStages,
    is_packed,
    is_stage_rows,
    packed_nodes,
    stage_row_nodes,
)
from replicator._src.core.packing import Packing
from replicator._src.core.typing import PyTree
from replicator._src.optim.stages import program as sp
from replicator._src.optim.stages.program import EVERYWHERE

API = "wrap_optimizer"


def stage_count(model) -> int:
    return model.num_stages * model.repeats


class Local:
    """This device's rows of the packed trees: ``[V, K_l, n]`` with ``K_l`` the stages it holds
    (1 on a 'stage' axis of K, K without one), and the logical stage of each."""

    def __init__(self, model) -> None:
        binding = current_binding()
        k_axis = binding.axis_size(STAGE_AXIS) if binding.kind == "shard_map" else 1
        if k_axis not in (1, model.num_stages):
            raise ValueError(
                f"{API}: the packed stages are {model.num_stages} per repeat, but the mesh's "
                f"'stage' axis has {k_axis} devices; use the mesh the model runs on."
            )
        self.model, self.k_axis = model, k_axis
        self.v, self.kl = model.repeats, model.num_stages // k_axis

    def rows(self, node: dict) -> dict:
        return {k: jnp.reshape(a, (self.v, self.kl, a.shape[-1])) for k, a in node.items()}

    def stages(self, si: int) -> list[tuple[int, int, int]]:
        """``(r, s, j)``: row ``[r, s]`` of device ``si`` holds logical stage ``j``."""
        k = self.model.num_stages
        return [(r, s, r * k + si * self.kl + s) for r in range(self.v) for s in range(self.kl)]

    def switch(self, branch):
        """``branch(si)`` on each device for its stage index ``si``."""
        if self.k_axis == 1:
            return branch(0)
        with collectives.divergent("an optimizer update of stages that differ"):
            return lax.switch(
                lax.axis_index(STAGE_AXIS), [lambda si=si: branch(si) for si in range(self.k_axis)]
            )

    def owner(self, j: int) -> int:
        """The stage index of the device that holds logical stage ``j``."""
        return (j % self.model.num_stages) // self.kl

    def stack(self, rows: list[dict]) -> dict:
        """Rows ``{dtype: [n]}``, one per stage this device holds, as ``[V, K_l, n]``."""
        return {k: jnp.stack([r[k] for r in rows]).reshape((self.v, self.kl, -1)) for k in rows[0]}


class StageRun:
    """One update of ``lay`` (a `stagewise` layout) on this device's rows."""

    def __init__(self, lay, model, grads: PyTree, state, params: PyTree) -> None:
        self.lay, self.model, self.prog = lay, model, lay.prog
        self.loc = Local(model)
        self.grads, self.state, self.params = grads, state, params
        self.g_rows = self.loc.rows(packed_nodes(grads)[0])
        self.p_rows = None if params is None else self.loc.rows(stage_row_nodes(params)[0])
        self.s_rows = self.loc.rows(state.rows)
        self.everywhere: dict = {}
        for ref, v in zip(self.prog.ins, self.flat_inputs(), strict=True):
            if v is not None:
                self.everywhere[ref] = v

    # -- hooks: how values are held ---------------------------------------------------------

    def whole(self, v):
        """A held value as a plain (whole) array."""
        return v

    def run(self, nodes, env: dict) -> None:
        """Runs a stage's ``nodes`` on ``env`` (and on the values known everywhere, plain)."""
        sp.run_nodes(nodes, env, self.everywhere)

    def stage_inputs(self, r: int, s: int, j: int) -> dict:
        """Stage ``j``'s inputs of the program (refs -> values), from rows ``[r, s]``."""
        lay, env = self.lay, {}
        ins_g, ins_s, ins_p = self.input_refs()
        self.fill(env, ins_g, self.model.unpack_row(j, _row(self.g_rows, r, s)), j)
        if ins_p:
            self.fill(env, ins_p, self.model.unpack_row(j, _row(self.p_rows, r, s)), j)
        mine = [ref for ref, w in zip(ins_s, lay.s_where, strict=True) if w == j]
        state = lay.s_pack.unpack(j, _row(self.s_rows, r, s))
        for ref, v in zip(mine, state, strict=True):
            env[ref] = v
        return env

    def state_value(self, v, j: int, i: int):
        """New state leaf ``i`` of stage ``j`` as it is stored."""
        return self.whole(v)

    def state_pack(self, j: int):
        return self.lay.s_pack.leaves[j], self.lay.s_pack

    # -- the rounds -------------------------------------------------------------------------

    def fill(self, env: dict, refs, tree: PyTree, j: int) -> None:
        staged = [x for x, w in zip(refs, self.lay.g_where, strict=True) if w == j]
        for ref, v in zip(staged, jax.tree.leaves(tree), strict=True):
            env[ref] = v

    def input_refs(self):
        n_g, n_s = self.lay.n_g, len(self.lay.s_avals)
        ins = self.prog.ins
        return ins[:n_g], ins[n_g : n_g + n_s], ins[n_g + n_s :]

    def value(self, env: dict, x):
        if isinstance(x, sp.Const):
            return x.value
        return self.whole(env[x]) if x in env else self.everywhere[x]

    def staged_pass(self, targets_of) -> dict:
        """Each device computes ``targets_of(j)`` for its stages ``j``; every stage's targets,
        gathered from their devices (whole, known everywhere)."""
        loc = self.loc
        every = [(j, t) for j in range(stage_count(self.model)) for t in targets_of(j)]
        pack = Packing.of([tuple(_aval(self.prog, t) for _, t in every)])

        def branch(si):
            values = {}
            for r, s, j in loc.stages(si):
                env = self.stage_inputs(r, s, j)
                self.run(self.prog.staged(targets_of(j)), env)
                for t in targets_of(j):
                    values[(j, id(t))] = self.value(env, t)
            flat = [values.get((j, id(t)), jnp.zeros(a.shape, a.dtype))
                    for (j, t), a in zip(every, pack.leaves[0], strict=True)]  # fmt: skip
            return pack.pack(0, tuple(flat))

        buf = loc.switch(branch)
        axes = (STAGE_AXIS,) if loc.k_axis > 1 else ()
        buf = {k: collectives.gather_over_axes(a[None], axes, 0) for k, a in buf.items()}
        out = {}
        for i, (j, t) in enumerate(every):
            out[t] = pack.unpack(0, {k: a[loc.owner(j)] for k, a in buf.items()})[i]
        return out

    def __call__(self) -> tuple[PyTree, Any]:
        prog = self.prog
        for p in range(prog.rounds + 1):
            if p:
                exports = prog.exports(p)
                found = self.staged_pass(lambda j, e=exports: [t for t in e if prog.where[t] == j])
                self.everywhere.update(found)
            sp.run_nodes(prog.everywhere(p), self.everywhere)
        return self.outputs()

    def outputs(self) -> tuple[PyTree, Any]:
        """The last pass: each stage's updates and state, packed into its rows; the rest."""
        lay, prog, loc = self.lay, self.prog, self.loc
        n_u, outs = len(lay.g_where), prog.outs

        def branch(si):
            u_rows, st_rows = [], []
            for r, s, j in loc.stages(si):
                u_idx = [i for i in range(n_u) if lay.g_where[i] == j]
                s_idx = [i for i, w in enumerate(lay.s_where) if w == j]
                env = self.stage_inputs(r, s, j)
                self.run(prog.staged([outs[i] for i in u_idx + [n_u + i for i in s_idx]]), env)
                u_rows.append(self.update_row(j, env, u_idx))
                avals, pack = self.state_pack(j)
                st = tuple(jnp.asarray(self.state_value(_held(env, outs[n_u + i]), j, i)).astype(a.dtype)
                           for i, a in zip(s_idx, avals, strict=True))  # fmt: skip
                st_rows.append(pack.pack(j, st))
            return loc.stack(u_rows), loc.stack(st_rows) if st_rows[0] else {}

        u_rows, new_rows = loc.switch(branch)
        return self.updates(u_rows), self.new_state(new_rows)

    def update_row(self, j: int, env: dict, u_idx: list) -> dict:
        """Stage ``j``'s updates (outputs ``u_idx``), packed as its parameter row."""
        model, outs = self.model, self.prog.outs
        like = jax.tree.leaves(model.abstract_stage(j))
        u = [jnp.asarray(self.value(env, outs[i])).astype(a.dtype)
             for i, a in zip(u_idx, like, strict=True)]  # fmt: skip
        return model.pack_row(j, jax.tree.unflatten(jax.tree.structure(model.abstract_stage(j)), u))

    def updates(self, u_rows: dict) -> PyTree:
        """The updates, in the structure of the gradients."""
        model, lay, outs = self.model, self.lay, self.prog.outs
        node = packed_nodes(self.grads)[0]
        u_node = PackedStages(
            model, {k: u_rows[k].reshape(node[k].shape).astype(node[k].dtype) for k in node}
        )
        flat_u = iter(
            self.value({}, outs[i]) if w == EVERYWHERE else None for i, w in enumerate(lay.g_where)
        )
        leaves = []
        for x in jax.tree.leaves(self.grads, is_leaf=is_packed):
            if is_packed(x):
                for _ in range(_num_stage_leaves(model)):
                    next(flat_u)
                leaves.append(u_node)
            else:
                leaves.append(jnp.asarray(next(flat_u)).astype(jnp.result_type(x)))
        return jax.tree.unflatten(jax.tree.structure(self.grads, is_leaf=is_packed), leaves)

    def new_state(self, new_rows: dict):
        lay, outs, n_u = self.lay, self.prog.outs, len(self.lay.g_where)
        rows = {k: new_rows[k].reshape(self.state.rows[k].shape) for k in self.state.rows}
        shared_idx = [i for i, w in enumerate(lay.s_where) if w == EVERYWHERE]
        shared = tuple(
            jnp.asarray(self.value({}, outs[n_u + i])).astype(old.dtype)
            for i, old in zip(shared_idx, self.state.shared, strict=True)
        )
        return type(self.state)(rows, shared)

    def flat_inputs(self) -> list:
        """The program's inputs known everywhere (None for a stage's own)."""

        def outside(tree):
            out = []
            for x in jax.tree.leaves(tree, is_leaf=is_stage_rows):
                out += [None] * _num_stage_leaves(x.model) if is_stage_rows(x) else [x]
            return out

        shared = iter(self.state.shared)
        s_in = [next(shared) if w == EVERYWHERE else None for w in self.lay.s_where]
        params = [] if self.params is None else outside(self.params)
        return [*outside(self.grads), *s_in, *params]


def _row(rows: dict, r: int, s: int) -> dict:
    return {k: a[r, s] for k, a in rows.items()}


def _held(env: dict, x):
    """A stage's own value as the evaluator holds it (a new state leaf is computed on its
    stage, or passed through from its input there)."""
    return x.value if isinstance(x, sp.Const) else env[x]


def _num_stage_leaves(model) -> int:
    return sum(len(jax.tree.leaves(model.abstract_stage(j))) for j in range(stage_count(model)))


def _aval(prog: sp.StageProgram, ref) -> jax.ShapeDtypeStruct:
    node = prog.producer.get(ref)
    aval = (
        node.eqn.outvars[node.outs.index(ref)].aval if node else prog.in_avals[prog.ins.index(ref)]
    )
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
