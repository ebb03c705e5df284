"""Any optax transformation on a pipeline of stages that differ, exactly as on one device.

``rp.pipeline.sequential`` packs each stage's parameters into one flat row per dtype
(`PackedStages`). An optimizer given the rows would see one buffer per stage: element-wise ones
(SGD, Adam) would not mind, but anything that looks at a leaf as a whole would compute something
else: a weight-decay mask by leaf name or rank, LAMB's per-leaf trust ratio, Adafactor's
factored moments, ``multi_transform`` by name, per-leaf clipping.

`stagewise` runs the transformation on the tree it has on one device, in which the rows are
replaced by the list of the stages' own trees. Its program (``tx.update`` traced on that tree)
is placed stage by stage (`stage_program.StageProgram`): each device unpacks its stage's row
into the stage's tree, runs that stage's part under a ``lax.switch`` on its stage index, and
packs the updates back into a row. What mixes stages (a global norm) runs on every device from
the values each stage exports (a scalar per leaf for a norm), gathered over ``stage``.

The optimizer state is the one-device state, each leaf kept by the stage that computes it,
packed into a row per stage (`StageState.rows`, sharded over ``stage`` like the parameters), and
the leaves every device computes (a step count) kept whole (`StageState.shared`).

Equivalent to (``trees`` = the stages' trees, ``pack`` = the model's packing)::

    updates, state = tx.update(unpack(grads), state, unpack(params))
    return pack(updates), state
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import collectives, placement
from replicator._src.core.binding import current_binding
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.packed import PackedStages, is_packed, packed_nodes
from replicator._src.core.packing import Packing
from replicator._src.core.typing import PyTree
from replicator._src.optim import stage_program as sp
from replicator._src.optim.stage_program import EVERYWHERE

_API = "wrap_optimizer"


class StageState(NamedTuple):
    """The optimizer state of a `stagewise` transformation on packed stages.

    ``rows``: ``{dtype: [K, n]}`` (``[V, K, n]``): each stage's state leaves packed into its
    row, sharded over ``stage`` like the parameters. ``shared``: the state leaves every device
    computes (a step count), whole.
    """

    rows: dict
    shared: tuple


# -- the one-device tree ---------------------------------------------------------------------


def _model(params: PyTree, grads: PyTree = None) -> Any:
    """The one `PackedStages` model of ``params`` (or ``grads``), or None; refuses two."""
    nodes = packed_nodes(params if params is not None else grads)
    models = {id(n.model): n.model for n in nodes}
    if len(models) > 1:
        raise ValueError(
            f"{_API}: the parameters hold the packed stages of {len(models)} different "
            f"pipeline.sequential models; one optimizer updates the stages of one model. Put "
            f"the stages into one model, or use one optimizer per model."
        )
    return next(iter(models.values()), None)


def _stage_count(model) -> int:
    return model.num_stages * model.repeats


def _one_device(tree: PyTree, stage_trees) -> tuple[PyTree, list[int]]:
    """``tree`` with its packed rows replaced by the list of the stages' trees
    (``stage_trees(node) -> list``), and each leaf's stage (`EVERYWHERE` outside them)."""
    swapped = jax.tree.map(lambda x: stage_trees(x) if is_packed(x) else x, tree, is_leaf=is_packed)

    def owners(x):
        if not is_packed(x):
            return EVERYWHERE
        return [jax.tree.map(lambda _, j=j: j, t) for j, t in enumerate(stage_trees(x))]

    where = jax.tree.leaves(jax.tree.map(owners, tree, is_leaf=is_packed))
    return swapped, where


def _abstract_stages(model):
    return lambda _: [model.abstract_stage(j) for j in range(_stage_count(model))]


def _unpacked_stages(model):
    """The stages' trees from the global rows ``{dtype: [K, n]}`` or ``[V, K, n]``."""

    def trees(node):
        s = _stage_count(model)
        flat = {k: jnp.reshape(a, (s, a.shape[-1])) for k, a in node.items()}
        return [model.unpack_row(j, {k: a[j] for k, a in flat.items()}) for j in range(s)]

    return trees


# -- the placed program -----------------------------------------------------------------------


class _Layout(NamedTuple):
    prog: sp.StageProgram
    n_g: int  # inputs: grads, state, params (each flat)
    s_avals: list  # the one-device state's leaves
    s_def: Any
    s_where: list[int]  # each state leaf's stage, or EVERYWHERE
    s_pack: Any  # the packing of each stage's state leaves: member j = stage j's
    u_def: Any  # the updates' tree structure (the one-device tree's)
    g_where: list[int]


def _layout(inner, model, grads: PyTree, params: PyTree, extra_args: dict) -> _Layout:
    """``inner.update`` traced on the one-device tree and placed stage by stage; the state's
    leaves placed where their new values are computed (iterated until they agree)."""
    abstract = _abstract_stages(model)
    g_tree, g_where = _one_device(_shapes(grads), abstract)
    p_tree = None if params is None else _one_device(_shapes(params), abstract)[0]
    s_avals, s_def = jax.tree.flatten(
        jax.eval_shape(inner.init, p_tree if params is not None else g_tree)
    )
    g_avals, g_def = jax.tree.flatten(g_tree)
    p_avals = [] if p_tree is None else jax.tree.leaves(p_tree)

    def update(g, s, p):
        tree = None if p_tree is None else jax.tree.unflatten(g_def, p)
        u, new = inner.update(
            jax.tree.unflatten(g_def, g), jax.tree.unflatten(s_def, s), tree, **extra_args
        )
        return jax.tree.leaves(u), jax.tree.leaves(new)

    closed = sp.trace(update, g_avals, s_avals, p_avals)
    n_g, n_s = len(g_avals), len(s_avals)
    s_where = [EVERYWHERE] * n_s
    prog = sp.StageProgram(closed, [*g_where, *s_where, *g_where[: len(p_avals)]])
    for _ in range(8):
        new = [prog.where_out(n_g + i) for i in range(n_s)]
        if new == s_where:
            break
        s_where = new
        prog.locate([*g_where, *s_where, *g_where[: len(p_avals)]])
    else:
        raise ValueError(
            f"{_API}: the optimizer state's placement over the stages does not settle."
        )
    members = [
        tuple(a for a, w in zip(s_avals, s_where, strict=True) if w == j)
        for j in range(_stage_count(model))
    ]
    return _Layout(prog, n_g, s_avals, s_def, s_where, Packing.of(members), g_def, g_where)


def _shapes(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


# -- init -------------------------------------------------------------------------------------


def _row_lead(model) -> tuple[int, ...]:
    return (model.num_stages,) if model.repeats == 1 else (model.repeats, model.num_stages)


def _row_spec(model, mesh: Mesh | None) -> PartitionSpec:
    if mesh is None or dict(mesh.shape).get(STAGE_AXIS, 1) == 1:
        return PartitionSpec()
    return PartitionSpec(STAGE_AXIS) if model.repeats == 1 else PartitionSpec(None, STAGE_AXIS)


def init(inner, params: PyTree, mesh: Mesh | None) -> StageState:
    """``inner.init`` of the one-device tree, each state leaf with the stage that updates it."""
    model = _model(params)
    lay = _layout(inner, model, params, params, {})
    trees, _ = _one_device(params, _unpacked_stages(model))
    leaves = jax.tree.leaves(inner.init(trees))
    s = _stage_count(model)
    rows = [
        lay.s_pack.pack(j, tuple(x for x, w in zip(leaves, lay.s_where, strict=True) if w == j))
        for j in range(s)
    ]
    lead = _row_lead(model)
    stacked = {k: jnp.stack([r[k] for r in rows]).reshape((*lead, -1)) for k in lay.s_pack.sizes}
    shared = tuple(x for x, w in zip(leaves, lay.s_where, strict=True) if w == EVERYWHERE)
    if mesh is not None:
        stacked = placement.put(stacked, NamedSharding(mesh, _row_spec(model, mesh)))
        shared = placement.put(shared, NamedSharding(mesh, PartitionSpec()))
    return StageState(stacked, shared)


# -- update -----------------------------------------------------------------------------------


class _Local:
    """This device's rows of the packed trees: ``[V, K_l, n]`` with ``K_l`` the stages it holds
    (1 on a 'stage' axis of K, K without one), and the logical stage of each."""

    def __init__(self, model) -> None:
        binding = current_binding()
        k_axis = binding.axis_size(STAGE_AXIS) if binding.kind == "shard_map" else 1
        if k_axis not in (1, model.num_stages):
            raise ValueError(
                f"{_API}: the packed stages are {model.num_stages} per repeat, but the mesh's "
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


def _stage_inputs(lay: _Layout, loc: _Local, r: int, s: int, j: int, g_rows, s_rows, p_rows):
    """Stage ``j``'s inputs of the program (refs -> values), from rows ``[r, s]``."""
    prog, env = lay.prog, {}
    ins_g = prog.ins[: lay.n_g]
    ins_s = prog.ins[lay.n_g : lay.n_g + len(lay.s_avals)]
    ins_p = prog.ins[lay.n_g + len(lay.s_avals) :]

    def fill(refs, rows):
        tree = loc.model.unpack_row(j, {k: a[r, s] for k, a in rows.items()})
        staged = [x for x, w in zip(refs, lay.g_where, strict=True) if w == j]
        for ref, v in zip(staged, jax.tree.leaves(tree), strict=True):
            env[ref] = v

    fill(ins_g, g_rows)
    if ins_p:
        fill(ins_p, p_rows)
    mine = [ref for ref, w in zip(ins_s, lay.s_where, strict=True) if w == j]
    state = lay.s_pack.unpack(j, {k: a[r, s] for k, a in s_rows.items()})
    for ref, v in zip(mine, state, strict=True):
        env[ref] = v
    return env


def update(inner, grads, state: StageState, params, extra_args) -> tuple[PyTree, StageState]:
    """The updates and new state of ``inner`` on the one-device tree (see the module)."""
    model = _model(params, grads)
    lay = _layout(inner, model, grads, params, extra_args)
    _check_state(lay, state)
    loc, prog = _Local(model), lay.prog
    g_rows = loc.rows(packed_nodes(grads)[0])
    p_rows = None if params is None else loc.rows(packed_nodes(params)[0])
    s_rows = loc.rows(state.rows)
    # values known everywhere: unpacked leaves outside the rows, shared state
    everywhere: dict = {}
    flat_in = _flat_inputs(lay, grads, state, params)
    for ref, v in zip(prog.ins, flat_in, strict=True):
        if v is not None:
            everywhere[ref] = v

    def staged_pass(targets_of):
        """Each device computes, for its stages ``j``, ``targets_of(j)``; returns the values
        of every stage's targets, gathered from their devices."""
        every = [(j, t) for j in range(_stage_count(model)) for t in targets_of(j)]
        pack = Packing.of([tuple(_aval(lay, t) for _, t in every)])

        def branch(si):
            values = {}
            for r, s, j in loc.stages(si):
                env = _stage_inputs(lay, loc, r, s, j, g_rows, s_rows, p_rows)
                sp.run_nodes(prog.staged(targets_of(j)), env, everywhere)
                for t in targets_of(j):
                    values[(j, id(t))] = env[t] if t in env else everywhere[t]
            flat = [values.get((j, id(t)), jnp.zeros(a.shape, a.dtype))
                    for (j, t), a in zip(every, pack.leaves[0], strict=True)]  # fmt: skip
            return pack.pack(0, tuple(flat))

        buf = loc.switch(branch)
        if loc.k_axis > 1:
            buf = {
                k: collectives.gather_over_axes(a[None], (STAGE_AXIS,), 0) for k, a in buf.items()
            }
        else:
            buf = {k: a[None] for k, a in buf.items()}
        out = {}
        for i, (j, t) in enumerate(every):
            row = pack.unpack(0, {k: a[loc.owner(j)] for k, a in buf.items()})
            out[t] = row[i]
        return out

    for p in range(prog.rounds + 1):
        if p:
            exports = prog.exports(p)
            everywhere.update(
                staged_pass(lambda j, e=exports: [t for t in e if prog.where[t] == j])
            )
        sp.run_nodes(prog.everywhere(p), everywhere)
    return _outputs(lay, loc, model, grads, state, g_rows, s_rows, p_rows, everywhere)


def _aval(lay: _Layout, ref) -> jax.ShapeDtypeStruct:
    node = lay.prog.producer.get(ref)
    if node is not None:
        aval = node.eqn.outvars[node.outs.index(ref)].aval
    else:
        aval = lay.prog.in_avals[lay.prog.ins.index(ref)]
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _flat_inputs(lay: _Layout, grads, state: StageState, params) -> list:
    """The program's inputs known everywhere (None for a stage's own)."""

    def outside(tree):
        out = []
        for x in jax.tree.leaves(tree, is_leaf=is_packed):
            if is_packed(x):
                model = x.model
                out += [None] * sum(
                    len(jax.tree.leaves(model.abstract_stage(j)))
                    for j in range(_stage_count(model))
                )
            else:
                out.append(x)
        return out

    shared = iter(state.shared)
    s_in = [next(shared) if w == EVERYWHERE else None for w in lay.s_where]
    return [*outside(grads), *s_in, *([] if params is None else outside(params))]


def _check_state(lay: _Layout, state: Any) -> None:
    if not isinstance(state, StageState) or len(state.shared) != lay.s_where.count(EVERYWHERE):
        raise ValueError(
            f"{_API}: the optimizer state does not belong to these packed stages; make it with "
            f"opt.init(params) on the packed parameters (model.pack(params)) that update gets."
        )


def _outputs(lay, loc, model, grads, state, g_rows, s_rows, p_rows, everywhere):
    """The last pass: each stage's updates and state, packed into its rows; the rest."""
    prog = lay.prog
    n_u = len(lay.g_where)
    outs = prog.outs

    def value(env, x):
        if isinstance(x, sp.Const):
            return x.value
        return env[x] if x in env else everywhere[x]

    def branch(si):
        u_rows, st_rows = [], []
        for r, s, j in loc.stages(si):
            u_idx = [i for i in range(n_u) if lay.g_where[i] == j]
            s_idx = [i for i in range(len(lay.s_where)) if lay.s_where[i] == j]
            targets = [outs[i] for i in u_idx] + [outs[n_u + i] for i in s_idx]
            env = _stage_inputs(lay, loc, r, s, j, g_rows, s_rows, p_rows)
            sp.run_nodes(prog.staged(targets), env, everywhere)
            like = model.abstract_stage(j)
            u_tree = jax.tree.unflatten(
                jax.tree.structure(like),
                [jnp.asarray(value(env, outs[i])).astype(a.dtype)
                 for i, a in zip(u_idx, jax.tree.leaves(like), strict=True)],
            )  # fmt: skip
            u_rows.append(model.pack_row(j, u_tree))
            avals = lay.s_pack.leaves[j]
            st = tuple(jnp.asarray(value(env, outs[n_u + i])).astype(a.dtype)
                       for i, a in zip(s_idx, avals, strict=True))  # fmt: skip
            st_rows.append(lay.s_pack.pack(j, st))
        shape = lambda rows: {
            k: jnp.stack([row[k] for row in rows]).reshape((loc.v, loc.kl, -1)) for k in rows[0]
        }
        return shape(u_rows), shape(st_rows) if lay.s_pack.sizes else {}

    u_rows, new_rows = loc.switch(branch)
    node = packed_nodes(grads)[0]
    u_node = PackedStages(model, {k: u_rows[k].reshape(node[k].shape).astype(node[k].dtype)
                                  for k in node})  # fmt: skip
    new_rows = {k: new_rows[k].reshape(state.rows[k].shape) for k in state.rows}
    flat_u = iter(value({}, outs[i]) if lay.g_where[i] == EVERYWHERE else None for i in range(n_u))
    leaves = []
    for x in jax.tree.leaves(grads, is_leaf=is_packed):
        if is_packed(x):
            for _ in range(sum(len(jax.tree.leaves(model.abstract_stage(j)))
                               for j in range(_stage_count(model)))):  # fmt: skip
                next(flat_u)
            leaves.append(u_node)
        else:
            leaves.append(jnp.asarray(next(flat_u)).astype(jnp.result_type(x)))
    updates = jax.tree.unflatten(jax.tree.structure(grads, is_leaf=is_packed), leaves)
    shared = tuple(
        jnp.asarray(value({}, outs[n_u + i])).astype(old.dtype)
        for i, old in zip(
            [i for i, w in enumerate(lay.s_where) if w == EVERYWHERE], state.shared, strict=True
        )
    )
    return updates, StageState(new_rows, shared)


# -- as an optax transformation ---------------------------------------------------------------


def stagewise(
    tx: optax.GradientTransformationExtraArgs,
    mesh: Mesh | None,
    other: optax.GradientTransformationExtraArgs | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` that updates a pipeline's packed stages (`PackedStages`) as one device would
    update the stages' own trees, and any other parameters as ``tx`` does.

    Parameters with no packed stages get ``other``'s ``init`` and ``update`` (``tx``'s when
    None: ``other`` is ``tx`` with its state placed on the mesh).
    """
    other = tx if other is None else other

    def init_fn(params):
        if _model(params) is None:
            return other.init(params)
        return init(tx, params, mesh)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, StageState):
            if _model(params, updates) is not None:
                raise ValueError(
                    f"{_API}: update got packed pipeline stages (pipeline.sequential's "
                    f"model.pack) but an optimizer state made for other parameters; make it "
                    f"with opt.init(params) on the packed parameters."
                )
            return other.update(updates, state, params, **extra_args)
        return update(tx, updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
