"""Any optax transformation on a pipeline of stages that differ, exactly as on one device.

``rp.pipeline.sequential`` packs each stage's parameters into one flat row per dtype
(`PackedStages`). An optimizer given the rows would see one buffer per stage: element-wise ones
(SGD, Adam) would not mind, but anything that looks at a leaf as a whole would compute something
else: a weight-decay mask by leaf name or rank, LAMB's per-leaf trust ratio, Adafactor's
factored moments, ``multi_transform`` by name, per-leaf clipping.

`stagewise` runs the transformation on the tree it has on one device, in which the rows are
replaced by the list of the stages' own trees. Its program (``tx.update`` traced on that tree)
is placed stage by stage (`program.StageProgram`): each device unpacks its stage's row
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import placement
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.packed import is_packed, is_stage_rows, stage_row_nodes
from replicator._src.core.packing import Packing
from replicator._src.core.typing import PyTree
from replicator._src.optim.stages import program as sp
from replicator._src.optim.stages import zero_parts
from replicator._src.optim.stages.execution import StageRun, stage_count
from replicator._src.optim.stages.program import EVERYWHERE

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
    nodes = stage_row_nodes(params if params is not None else grads)
    models = {id(n.model): n.model for n in nodes}
    if len(models) > 1:
        raise ValueError(
            f"{_API}: the parameters hold the packed stages of {len(models)} different "
            f"pipeline.sequential models; one optimizer updates the stages of one model. Put "
            f"the stages into one model, or use one optimizer per model."
        )
    return next(iter(models.values()), None)


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
    return lambda _: [model.abstract_stage(j) for j in range(stage_count(model))]


def _unpacked_stages(model):
    """The stages' trees from the global rows ``{dtype: [K, n]}`` or ``[V, K, n]``."""

    def trees(node):
        s = stage_count(model)
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
        for j in range(stage_count(model))
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


def init(inner, params: PyTree, mesh: Mesh | None, *, zero_n: int = 0) -> StageState:
    """``inner.init`` of the one-device tree, each state leaf with the stage that updates it;
    with ``zero_n`` replicas, each stage's leaves on their ZeRO parts (`zero_parts`)."""
    model = _model(params)
    lay = _layout(inner, model, params, params, {})
    one_device = lambda p: inner.init(_one_device(p, _unpacked_stages(model))[0])
    leaves = jax.tree.leaves(jax.jit(one_device)(params))  # one program, not op by op
    if zero_n:
        zs = zero_parts.splits(lay, model, zero_n)
        rows = zero_parts.init_rows(lay, model, zs, leaves, mesh)
        shared = tuple(x for x, w in zip(leaves, lay.s_where, strict=True) if w == EVERYWHERE)
        return StageState(rows, placement.put(shared, NamedSharding(mesh, PartitionSpec())))
    s = stage_count(model)
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


def _check_state(lay: _Layout, state: Any) -> None:
    if not isinstance(state, StageState) or len(state.shared) != lay.s_where.count(EVERYWHERE):
        raise ValueError(
            f"{_API}: the optimizer state does not belong to these packed stages; make it with "
            f"opt.init(params) on the packed parameters (model.pack(params)) that update gets."
        )


def update(inner, grads, state, params, extra_args, *, zero_n: int = 0, grad_dtype=None):
    """The updates and new state of ``inner`` on the one-device tree (see the module); with
    ``zero_n`` replicas, from local gradients, on ZeRO's parts (`zero_parts`)."""
    model = _model(params, grads)
    split = [x for x in stage_row_nodes(params) if not is_packed(x)]  # ZeRO-3's stored parts
    lay = _layout(inner, model, grads, grads if split else params, extra_args)
    _check_state(lay, state)
    if not zero_n:
        return StageRun(lay, model, grads, state, params)()
    zs = zero_parts.splits(lay, model, zero_n)
    return zero_parts.ZeroStageRun(lay, model, grads, state, params, zs, grad_dtype)()


def only_packed(params: PyTree, what: str) -> bool:
    """Whether ``params`` hold packed stages; refuses them beside other parameters."""
    if _model(params) is None:
        return False
    others = [x for x in jax.tree.leaves(params, is_leaf=is_stage_rows) if not is_stage_rows(x)]
    if others:
        raise ValueError(
            f"{_API}({what}): the parameters hold packed pipeline stages beside "
            f"{len(others)} other leaves; with ZeRO, give the optimizer the packed stages "
            f"alone (make the embedding and the head stages of the model), or use zero_stage=0."
        )
    return True


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
