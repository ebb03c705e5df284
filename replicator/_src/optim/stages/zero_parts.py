"""ZeRO-1/2 on the packed stages of ``rp.pipeline.sequential``: each stage's leaves split over
the replicas, updated on their parts as one device updates the stage's tree.

ZeRO keeps every leaf in its own shape with one axis split over the replicas
(`zero_layout.split_dim`). For packed stages the leaves are the stages' own: on the devices of
stage ``j``, each gradient leaf of stage ``j`` is reduce-scattered along its split axis (a leaf
with none is all-reduced), the stage's part of the placed program (`program`) runs on the
parts with ZeRO's evaluator (`sharded_eval`: reductions over a split axis completed over the
replicas: LAMB's trust ratio, a global norm), and each update is all-gathered along the same
axis: the bytes of an all-reduce, and 1/N of the stage's optimizer state on each device. The
state of stage ``j`` on replica ``r`` is its parts of the stage's state leaves, packed into a
segment of the stage's row (`StageState.rows`: ``[K, N x seg]`` over ``stage`` and the data
axes).

Equivalent to `stagewise` with ``zero_stage=0``, which is equivalent to optax on one device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import collectives, placement
from replicator._src.core import mesh as mesh_lib
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.packed import is_packed, is_stage_rows, packed_nodes, stage_row_nodes
from replicator._src.core.packing import Packing
from replicator._src.optim import replica_mean, sharded_eval, zero_layout
from replicator._src.optim.shards import WHOLE, Comm, Split, local_shape
from replicator._src.optim.stages import program as sp
from replicator._src.optim.stages import split_rows
from replicator._src.optim.stages.execution import StageRun, stage_count
from replicator._src.optim.stages.program import EVERYWHERE
from replicator._src.optim.stages.split_rows import SplitRows


@dataclasses.dataclass(frozen=True)
class ZeroSplits:
    """Where ZeRO splits each leaf of the placed program's inputs.

    Attributes:
      n: the replicas.
      g: each gradient (and parameter) leaf's split axis, or None (whole, all-reduced).
      s: each state leaf's split axis.
      g_pack: each stage's gradient parts (member ``j``), as this replica holds them.
      s_pack: each stage's state parts.
    """

    n: int
    g: tuple
    s: tuple
    g_pack: Packing
    s_pack: Packing


def _parts(avals, splits, n):
    return tuple(
        jax.ShapeDtypeStruct(local_shape(a.shape, Split(d), Comm(n)), a.dtype)
        for a, d in zip(avals, splits, strict=True)
    )


def splits(lay, model, n: int) -> ZeroSplits:
    """Each leaf's split: a gradient's by `zero_layout.split_dim`, a state leaf's as the update
    computes it from the split gradients, iterated until the state it returns is split as
    the state it takes."""
    prog = lay.prog
    g_avals = prog.in_avals[: lay.n_g]
    g = tuple(zero_layout.split_dim(a.shape, None, n) if w != EVERYWHERE else None
              for a, w in zip(g_avals, lay.g_where, strict=True))  # fmt: skip
    s = tuple([None] * len(lay.s_avals))
    for _ in range(5):
        new = _state_splits(lay, g, s, n)
        if new == s:
            break
        s = new
    members_g, members_s = [], []
    for j in range(stage_count(model)):
        gi = [i for i, w in enumerate(lay.g_where) if w == j]
        si = [i for i, w in enumerate(lay.s_where) if w == j]
        members_g.append(_parts([g_avals[i] for i in gi], [g[i] for i in gi], n))
        members_s.append(_parts([lay.s_avals[i] for i in si], [s[i] for i in si], n))
    return ZeroSplits(n, g, s, Packing.of(members_g), Packing.of(members_s))


def _state_splits(lay, g, s, n) -> tuple:
    """The split of each new state leaf, given the gradients' and the state's (abstract)."""
    prog, comm = lay.prog, Comm(n, abstract=True)
    n_g, n_s = lay.n_g, len(lay.s_avals)
    found = []

    def run(*xs):
        ev = sharded_eval._Evaluator(comm)
        env = {}
        for i, (ref, x) in enumerate(zip(prog.ins, xs, strict=True)):
            split = g[i] if i < n_g else s[i - n_g] if i < n_g + n_s else None
            env[ref] = sharded_eval._Val(x, Split(split))
        for node in prog.nodes:
            ins = [_read(env, x) for x in node.ins]
            if node.where == EVERYWHERE:
                ins = [ev.to(v, WHOLE) for v in ins]
            for ref, v in zip(node.outs, ev.eqn(node.eqn, ins), strict=True):
                env[ref] = v
        outs = [_read(env, prog.outs[n_g + i]) for i in range(n_s)]
        found.append(tuple(v.split.data for v in outs))
        return [v.x for v in outs]

    avals = []
    for i, a in enumerate(prog.in_avals):
        split = g[i] if i < n_g else s[i - n_g] if i < n_g + n_s else None
        avals.append(jax.ShapeDtypeStruct(local_shape(a.shape, Split(split), comm), a.dtype))
    jax.eval_shape(run, *avals)
    return tuple(
        d if d is not None and a.shape[d] % n == 0 else None
        for d, a in zip(found[0], lay.s_avals, strict=True)
    )


def _read(env, x):
    if isinstance(x, sp.Const):
        return sharded_eval._Val(x.value, WHOLE)
    return env[x]


def row_spec(model, mesh: Mesh) -> PartitionSpec:
    data = zero_layout.data_entry(mesh)
    staged = dict(mesh.shape).get(STAGE_AXIS, 1) > 1
    lead = [None] * (model.repeats > 1) + [STAGE_AXIS if staged else None]
    return PartitionSpec(*lead, data)


def init_rows(lay, model, zs: ZeroSplits, leaves: list, mesh: Mesh) -> dict:
    """The stages' state rows ``[K, N x seg]``: replica ``r``'s parts in segment ``r``
    (`split_rows.SplitRows`, which a checkpoint saves as the logical rows)."""
    lead = (model.num_stages,) if model.repeats == 1 else (model.repeats, model.num_stages)

    def build(leaves):
        rows = []
        for j in range(stage_count(model)):
            idx = [i for i, w in enumerate(lay.s_where) if w == j]
            segments = []
            for r in range(zs.n):
                parts = tuple(split_rows.part(leaves[i], zs.s[i], zs.n, r) for i in idx)
                segments.append(zs.s_pack.pack(j, parts))
            rows.append({k: jnp.concatenate([seg[k] for seg in segments]) for k in zs.s_pack.sizes})
        return {k: jnp.stack([r[k] for r in rows]).reshape((*lead, -1)) for k in zs.s_pack.sizes}

    stacked = jax.jit(build)([jnp.asarray(x) for x in leaves])  # one program, not op by op
    placed = placement.put(stacked, NamedSharding(mesh, row_spec(model, mesh)))
    return SplitRows(split_rows.layout_of(lay, zs, lead), placed)


class ZeroStageRun(StageRun):
    """`StageRun` with each stage's leaves on their ZeRO parts (see the module)."""

    def __init__(self, lay, model, grads, state, params, zs: ZeroSplits, grad_dtype) -> None:
        super().__init__(lay, model, grads, state, params)
        self.zs, self.comm = zs, Comm(zs.n)
        replica_mean.refuse_narrow_on_xla_cpu(grad_dtype)
        # ZeRO-3: the parameters are stored split (`SplitStages`), and so are the updates
        self.p_node = next((x for x in stage_row_nodes(params) if not is_packed(x)), None)
        self.g_parts = self.loc.switch(lambda si: self._reduce(si, grad_dtype))

    def _reduce(self, si: int, dtype) -> dict:
        """This device's stages' gradient leaves, reduce-scattered along their split axes."""
        rows = []
        for r, s, j in self.loc.stages(si):
            tree = self.model.unpack_row(j, {k: a[r, s] for k, a in self.g_rows.items()})
            idx = [i for i, w in enumerate(self.lay.g_where) if w == j]
            parts = []
            for i, g in zip(idx, jax.tree.leaves(tree), strict=True):
                sent = g if dtype is None else g.astype(dtype)
                d = self.zs.g[i]
                if d is None:
                    part = collectives.all_reduce(sent, "mean")
                else:
                    part = collectives.scatter_replicas(sent, d) / self.zs.n
                parts.append(part.astype(g.dtype))
            rows.append(self.zs.g_pack.pack(j, tuple(parts)))
        return self.loc.stack(rows)

    def stage_inputs(self, r: int, s: int, j: int) -> dict:
        lay, zs, env = self.lay, self.zs, {}
        ins_g, ins_s, ins_p = self.input_refs()
        val = sharded_eval._Val
        idx = [i for i, w in enumerate(lay.g_where) if w == j]
        g_parts = zs.g_pack.unpack(j, {k: a[r, s] for k, a in self.g_parts.items()})
        for i, x in zip(idx, g_parts, strict=True):
            env[ins_g[i]] = val(x, Split(zs.g[i]))
        if ins_p and self.p_node is not None:  # this replica's parts, as the gradients'
            p_parts = zs.g_pack.unpack(j, {k: a[r, s] for k, a in self.p_rows.items()})
            for i, x in zip(idx, p_parts, strict=True):
                env[ins_p[i]] = val(x, Split(zs.g[i]))
        elif ins_p:
            tree = self.model.unpack_row(j, {k: a[r, s] for k, a in self.p_rows.items()})
            for i, x in zip(idx, jax.tree.leaves(tree), strict=True):
                env[ins_p[i]] = val(x, WHOLE)
        s_idx = [i for i, w in enumerate(lay.s_where) if w == j]
        state = zs.s_pack.unpack(j, {k: a[r, s] for k, a in self.s_rows.items()})
        for i, x in zip(s_idx, state, strict=True):
            env[ins_s[i]] = val(x, Split(zs.s[i]))
        return env

    def run(self, nodes, env: dict) -> None:
        ev = sharded_eval._Evaluator(self.comm)
        for node in nodes:
            ins = [
                _read({}, x) if isinstance(x, sp.Const) else env[x] if x in env
                else sharded_eval._Val(self.everywhere[x], WHOLE)
                for x in node.ins
            ]  # fmt: skip
            for ref, v in zip(node.outs, ev.eqn(node.eqn, ins), strict=True):
                env[ref] = v

    def whole(self, v):
        if isinstance(v, sharded_eval._Val):
            return sharded_eval.convert(v.x, v.split, WHOLE, self.comm)
        return v

    def state_value(self, v, j: int, i: int | None, want: Split | None = None):
        want = Split(self.zs.s[i]) if want is None else want
        if not isinstance(v, sharded_eval._Val):
            v = sharded_eval._Val(v, WHOLE)
        return sharded_eval.convert(v.x, v.split, want, self.comm)

    def state_pack(self, j: int):
        return self.zs.s_pack.leaves[j], self.zs.s_pack

    def update_row(self, j: int, env: dict, u_idx: list) -> dict:
        """ZeRO-3: stage ``j``'s updates as this replica's parts, packed as its segment."""
        if self.p_node is None:
            return super().update_row(j, env, u_idx)
        like = jax.tree.leaves(self.model.abstract_stage(j))
        parts = []
        for i, a in zip(u_idx, like, strict=True):
            x = self.prog.outs[i]
            v = env[x] if x in env else self.value(env, x)  # a constant, or known everywhere
            parts.append(self.state_value(v, j, None, Split(self.zs.g[i])).astype(a.dtype))
        return self.zs.g_pack.pack(j, tuple(parts))

    def updates(self, u_rows: dict):
        if self.p_node is None:
            return super().updates(u_rows)
        node = self.p_node
        new = node.with_rows(
            {k: u_rows[k].reshape(a.shape).astype(a.dtype) for k, a in node.items()}
        )
        return jax.tree.map(lambda x: new if x is node else x, self.params, is_leaf=is_stage_rows)

    def new_state(self, new_rows: dict):
        state = super().new_state(new_rows)
        if not isinstance(self.state.rows, SplitRows):
            return state
        return type(state)(SplitRows(self.state.rows.layout, state.rows), state.shared)


def check_mesh(mesh: Mesh) -> None:
    """ZeRO's data axes are the mesh's replica axes."""
    if not mesh_lib.replica_axes(mesh):
        raise ValueError("wrap_optimizer: ZeRO needs a mesh with data axes.")


def shard_packed(params, mesh: Mesh, n: int):
    """ZeRO-3: the packed stages of ``params`` stored split over ``n`` replicas
    (`split_rows.SplitStages`)."""
    spec = row_spec(packed_nodes(params)[0].model, mesh)
    return jax.tree.map(
        lambda x: split_rows.split_stages(x, mesh, n, spec) if is_packed(x) else x,
        params,
        is_leaf=is_packed,
    )


def refuse_whole_rows(stage: int, params) -> None:
    """Refuses the packed stages of ``rp.pipeline.sequential`` stored whole under ZeRO-3: they
    must be stored split first (`shard_packed`)."""
    if params is not None and packed_nodes(params):
        raise ValueError(
            f"wrap_optimizer(zero_stage={stage}): the parameters hold the packed stages of a "
            f"pipeline.sequential model stored whole; store them split first: "
            f"params = opt.shard_params(params), and pass rp.gather_params(params) to the "
            f"pipeline in step_fn (or use zero_stage=1 or 2)."
        )
