"""ZeRO: optimizer state (and with stage 3, parameters) sharded over the replicas.

Every leaf of shape ``(*lead, *rest)`` is stored as ``(*lead, N * c)``: ``rest`` flattened and
padded to ``N * c`` elements, replica ``r`` holding ``[r c, (r + 1) c)``. ``lead`` is empty except
for ZeRO-3's stacked layers, which are sharded layer by layer. Leaves of one element are
replicated.

On 3-D meshes:

* ``stage`` (pipelines): a parameter split over ``stage`` is, inside a step, one device's stage
  block; its state is stored by blocks, ``[K * N * c]`` over ``("stage", data axes)``: block
  ``s`` flattened and padded to ``N * c``, replica ``r`` holding ``[r c, (r + 1) c)`` of it, so
  1/(K N) of the leaf per device. Full reductions of a block's slices are completed over the
  replicas and the stages. ZeRO-3 stores a stage block's layers flat layer by layer,
  ``[K, L/K, N * c]`` over ``("stage", None, data axes)`` (`zero_blocks`).
* ``model`` (XLA's): a step sees every parameter whole along it, so the layout is that of the
  data axes alone; each replica's slice (``c``, a multiple of T) is stored split over ``model``
  too, 1/(N T) per device, and XLA moves it where the step needs it.

The inner optax transformation is written for whole arrays. `Zero.apply` runs its one-device
program on the slices (`replicator._src.sharded_eval`): exact for element-wise transformations
and for full reductions such as global-norm clipping and LAMB's trust ratio, with 1/N of the
state per device. A transformation with an operation that has no meaning on slices (Adafactor's
factored row and column statistics, a transpose, random numbers) runs instead on whole arrays,
gathered for the update: still exact, with the state sharded between steps but whole during the
update. `Zero.plan` tells which, before a step runs.

As optax transformations: `scatter_mean` takes local gradients to this replica's slice of their
mean, and `sharded_update` runs an optax transformation on the slices, its state in this layout.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src import collectives, placement, sharded_eval, zero_blocks
from replicator._src import mesh as mesh_lib
from replicator._src.binding import current_binding
from replicator._src.sharded_params import ShardedParam, has_sharded_params, is_sharded_param
from replicator._src.typing import PyTree


class _Program(NamedTuple):
    """An optax update traced on one-device shapes, and whether it runs on the slices."""

    closed: Any  # jax.extend.core.ClosedJaxpr: (grads, state[, params]) -> (updates, state)
    reason: str | None  # None: runs on the slices; else why it runs on gathered arrays
    layout: sharded_eval.Layout
    shapes: list  # the one-device shape of each parameter leaf
    s_avals: list  # the one-device shape and dtype of each state leaf


def _real_shape(leaf_shape: tuple[int, ...], node: ShardedParam | None) -> tuple[int, ...]:
    return tuple(leaf_shape) if node is None else (*leaf_shape[:-1], *node.shape)


class Zero:
    """The ZeRO layout of one mesh, and the update of an optax transformation on it."""

    def __init__(self, mesh: Mesh, *, stage: int) -> None:
        self.mesh = mesh
        self.stage = stage
        self.n = mesh_lib.num_replicas(mesh)
        self.k = dict(mesh.shape).get(mesh_lib.STAGE_AXIS, 1)  # pipeline stages
        self.t = dict(mesh.shape).get(mesh_lib.MODEL_AXIS, 1)  # XLA's model axis
        # A flat leaf is split over the replicas and, with a `model` axis, over it too: each
        # replica's slice of c elements (a multiple of T) is split further by XLA.
        model = (mesh_lib.MODEL_AXIS,) if self.t > 1 else ()
        self.flat_axes = (*mesh_lib.replica_axes(mesh), *model)
        self.entry = zero_blocks.entry(self.flat_axes)
        self.replicated = mesh_lib.replicated_sharding(mesh)

    def new_layout(self, leads=(), splits=()) -> sharded_eval.Layout:
        """The `sharded_eval.Layout` of this mesh (slices of a multiple of T elements)."""
        return sharded_eval.Layout(self.n, tuple(leads), self.t, tuple(splits))

    # -- shapes ---------------------------------------------------------------------------------

    def real_avals(self, tree: PyTree) -> PyTree:
        """``tree`` with each leaf replaced by its one-device shape (same tree structure)."""

        def real(x):
            if isinstance(x, ShardedParam):
                flat = jnp.shape(x.flat)
                aval = jax.ShapeDtypeStruct(_real_shape(flat, x), jnp.result_type(x.flat))
                return ShardedParam(aval, x.shape)
            return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

        return jax.tree.map(real, tree, is_leaf=is_sharded_param)

    def layout(
        self, params: PyTree, splits: list | None = None
    ) -> tuple[sharded_eval.Layout, str | None]:
        """The layout for ``params`` and, if two leaves of one shape are laid out differently
        (a stacked and an unstacked ZeRO-3 parameter of the same shape, or a stage block and
        a whole parameter), why it cannot be used. ``splits`` gives each leaf's axes besides
        the replicas that it is one device's block of (`step_splits`, `zero_blocks.stage_view`)."""
        leads: dict[tuple[int, ...], int] = {}
        axes: dict[tuple[int, ...], tuple] = {}
        leaves = jax.tree.leaves(params, is_leaf=is_sharded_param)
        for x, split in zip(leaves, splits or [()] * len(leaves), strict=True):
            if isinstance(x, ShardedParam):
                flat = jnp.shape(x.flat)
                shape, lead = _real_shape(flat, x), len(flat) - 1
            else:
                shape, lead = tuple(jnp.shape(x)), 0
            if math.prod(shape) > 1 and leads.setdefault(shape, lead) != lead:
                return self.new_layout(), (
                    f"parameters of shape {shape} are stored both stacked and unstacked"
                )
            if math.prod(shape) > 1 and axes.setdefault(shape, split) != split:
                return self.new_layout(), (
                    f"parameters of shape {shape} are both split over {split or axes[shape]} "
                    f"and whole on every device of a replica"
                )
        return self.new_layout(
            ((s, k) for s, k in leads.items() if k), ((s, a) for s, a in axes.items() if a)
        ), None

    # -- init -----------------------------------------------------------------------------------

    def check_params(self, params: PyTree) -> None:
        zero_blocks.check_params(params, self.mesh, stage=self.stage)

    def init(self, inner, params: PyTree) -> PyTree:
        """``inner.init`` on the one-device parameters, each leaf then stored in the layout.

        A state leaf shaped like a stage-split parameter is stored by blocks: each stage's
        block flattened, padded and split over the replicas (and ``model``), 1/(K N) of the
        leaf per device; the other leaves flattened over the replicas, as `layout` says.
        """
        self.check_params(params)
        layout, _ = self.layout(params)
        dims = zero_blocks.stage_dims(
            params, self.k, api=f"wrap_optimizer(zero_stage={self.stage})"
        )
        # ZeRO-3 stage blocks: the state of a layer is stored as the layer's flat is
        flats = {
            _real_shape(x.flat.shape, x): placement.sharding_of(x.flat)
            for x in jax.tree.leaves(params, is_leaf=is_sharded_param)
            if isinstance(x, ShardedParam) and zero_blocks.stage_dim(x, self.k) is not None
        }
        avals = jax.eval_shape(lambda p: inner.init(self._whole(p)), params)
        shardings = jax.tree.map(
            lambda a: (
                flats.get(a.shape) or self._stored_sharding(layout, a.shape, dims.get(a.shape))
            ),
            avals,
        )

        def init(p):
            state = inner.init(self._whole(p))
            return jax.tree.map(lambda s: self._stored(layout, s, dims.get(s.shape)), state)

        state = jax.jit(init, out_shardings=shardings)(params)
        return placement.put(state, shardings)  # a no-op here; noted for Replicator.abstract

    def _whole(self, params: PyTree) -> PyTree:
        """Stored (global) parameters as one device has them: ZeRO-3 flats cropped, reshaped."""

        def whole(x):
            if not isinstance(x, ShardedParam):
                return x
            flat = x.flat
            size = math.prod(x.shape)
            return ShardedParam(flat[..., :size].reshape((*flat.shape[:-1], *x.shape)), x.shape)

        return jax.tree.map(whole, params, is_leaf=is_sharded_param)

    def _stored(self, layout: sharded_eval.Layout, x: jax.Array, dim: int | None) -> jax.Array:
        if dim is None:
            return x if layout.whole(jnp.shape(x)) else layout.flat_padded(x)
        block = (*x.shape[:dim], x.shape[dim] // self.k, *x.shape[dim + 1 :])
        return zero_blocks.by_blocks(x, dim, self.k, self.n * self.new_layout().chunk(block))

    def _stored_sharding(self, layout: sharded_eval.Layout, shape, dim) -> NamedSharding:
        if dim is not None:
            entry = zero_blocks.entry((mesh_lib.STAGE_AXIS, *self.flat_axes))
            return NamedSharding(self.mesh, PartitionSpec(entry))
        if layout.whole(shape):
            return self.replicated
        spec = PartitionSpec(*([None] * layout.lead(shape)), self.entry)
        return NamedSharding(self.mesh, spec)

    # -- the update -----------------------------------------------------------------------------

    def check_binding(self) -> None:
        binding = current_binding()
        if binding.num_replicas != self.n:
            raise ValueError(
                f"wrap_optimizer(zero_stage={self.stage}): the state is sharded over {self.n} "
                f"replicas, but this step runs on {binding.num_replicas}; call update inside "
                f"repl.run of the replicator that made the optimizer."
            )

    def plan(self, inner, params: PyTree, extra_args: dict | None = None) -> str | None:
        """None if ``inner``'s update runs on the slices exactly, else why it is gathered.

        ``params`` are global (as ``init`` gets them); stage-split ones are seen as one
        device's block.

        Raises:
          ValueError: if the update cannot run on the slices and a parameter is split over
            ``stage`` (gathering over the replicas would give one block, not the leaf).
        """
        view, splits = zero_blocks.stage_view(params, self.k)
        prog = self._program(inner, view, True, extra_args or {}, splits)
        self._refuse_gathered(prog)
        return prog.reason

    def _refuse_gathered(self, prog: _Program) -> None:
        zero_blocks.refuse_gathered(self.stage, prog.reason, prog.layout.splits)

    def step_splits(self, params: PyTree, grads: PyTree) -> list | None:
        """Inside a step: each gradient's axes besides the replicas that it is one block of,
        read from ``params`` as step_fn received them; `sharded_eval.UNKNOWN` for each when
        ``params`` is None on a mesh with such axes (a full reduction is then refused)."""
        binding = current_binding()
        if not binding.model_axes():
            return None
        if params is None:
            return [(sharded_eval.UNKNOWN,)] * len(jax.tree.leaves(grads))
        return [binding.split_axes(p) or () for p in jax.tree.leaves(params)]

    def _program(
        self, inner, params: PyTree, with_params: bool, extra_args: dict, splits=None
    ) -> _Program:
        real_p = self.real_avals(params)
        layout, conflict = self.layout(params, splits)
        p_avals, p_def = jax.tree.flatten(real_p)
        s_avals, s_def = jax.tree.flatten(jax.eval_shape(inner.init, real_p))

        def update(g, s, *p):
            updates, new_state = inner.update(
                jax.tree.unflatten(p_def, g),
                jax.tree.unflatten(s_def, s),
                jax.tree.unflatten(p_def, p[0]) if p else None,
                **extra_args,
            )
            return jax.tree.leaves(updates), jax.tree.leaves(new_state)

        args = (p_avals, s_avals, p_avals) if with_params else (p_avals, s_avals)
        closed = jax.make_jaxpr(update)(*args)
        reason = conflict or sharded_eval.unsupported(closed, layout)
        return _Program(closed, reason, layout, [a.shape for a in p_avals], s_avals)

    def reduce_scatter(self, grads: PyTree, dtype) -> PyTree:
        """Local whole gradients -> this replica's slice of their mean (ZeRO-1/2)."""
        n = self.n

        def scatter(g):
            flat = self.new_layout().flat_padded(g)
            sent = flat if dtype is None else flat.astype(dtype)
            out = collectives.reduce_scatter(sent, axis=0, op="sum")
            return (out / n).astype(g.dtype)

        return jax.tree.map(scatter, grads)

    def slice_zeros(self, params: PyTree) -> PyTree:
        """Zeros shaped as this replica's slice of the mean gradients (`reduce_scatter` with
        ZeRO-1/2: flat ``[c]`` per leaf; ZeRO-3: the `ShardedParam` layout of ``params``)."""
        if self.stage == 3:
            return jax.tree.map(jnp.zeros_like, params)
        layout = self.new_layout()
        return jax.tree.map(
            lambda p: jnp.zeros(layout.chunk(np.shape(p)), jnp.result_type(p)), params
        )

    def apply(self, inner, g_local: PyTree, state: PyTree, params: PyTree, extra_args, like):
        """``inner.update`` of the mean gradients, as on one device: ``(updates, state)``.

        ``g_local`` is this replica's slice of each mean gradient (ZeRO-1/2: flat ``[c]``;
        ZeRO-3: the `ShardedParam` layout), ``state`` its slice of the stored state, ``params``
        the parameters as ``step_fn`` holds them (or None), ``like`` the gradients as
        ``step_fn`` computed them (whole with ZeRO-1/2). The updates come back whole with
        ZeRO-1/2 and in the `ShardedParam` layout with ZeRO-3.
        """
        splits = self.step_splits(params, like)
        prog = self._program(
            inner, like if params is None else params, params is not None, extra_args, splits
        )
        self._refuse_gathered(prog)
        layout, shapes = prog.layout, prog.shapes
        g_stored, g_def = jax.tree.flatten(g_local)
        s_stored, s_def = jax.tree.flatten(state)
        s_shapes = [a.shape for a in prog.s_avals]
        if params is None:
            p_local = []
        elif self.stage == 3:
            p_local = jax.tree.leaves(params)
        else:
            p_local = [layout.to_local(p) for p in jax.tree.leaves(params)]
        if prog.reason is None:  # the one-device program, run on this replica's slices
            local = sharded_eval.stored_local
            g = [local(layout, s, x) for s, x in zip(shapes, g_stored, strict=True)]
            s = [local(layout, s, x) for s, x in zip(s_shapes, s_stored, strict=True)]
            p = [local(layout, s, x) for s, x in zip(shapes, p_local)]
            outs = sharded_eval.evaluate(prog.closed, layout, *g, *s, *p)
            u, new_s = outs[: len(g)], outs[len(g) :]
            if self.stage < 3:
                u = [layout.to_real(x, shape) for x, shape in zip(u, shapes, strict=True)]
        else:  # the one-device program, run on whole arrays gathered from the slices
            g = [layout.to_real(x, shape) for x, shape in zip(g_stored, shapes, strict=True)]
            s = [layout.to_real(x, shape) for x, shape in zip(s_stored, s_shapes, strict=True)]
            if self.stage == 3:
                p = [layout.to_real(x, shape) for x, shape in zip(p_local, shapes)]
            else:
                p = [] if params is None else jax.tree.leaves(params)
            outs = jex.jaxpr_as_fun(prog.closed)(*g, *s, *p)
            u, new_s = outs[: len(g)], [layout.to_local(x) for x in outs[len(g) :]]
            if self.stage == 3:
                u = [layout.to_local(x) for x in u]
        if self.stage == 3:
            u = [sharded_eval.as_stored(layout, x, jnp.shape(o)) for x, o in zip(u, g_stored)]
        new_state = [
            sharded_eval.as_stored(layout, x, jnp.shape(o)).astype(jnp.result_type(o))
            for x, o in zip(new_s, s_stored, strict=True)
        ]
        return jax.tree.unflatten(g_def, u), jax.tree.unflatten(s_def, new_state)

    # -- ZeRO-3 parameters ----------------------------------------------------------------------

    def shard_params(self, params: PyTree, stacked) -> PyTree:
        stacked = set(stacked)
        if stacked and not isinstance(params, dict):
            raise ValueError("shard_params: stacked names top-level keys; params must be a dict.")
        missing = stacked - set(params) if stacked else set()
        if missing:
            raise ValueError(f"shard_params: stacked keys {sorted(missing)} are not in params.")

        def shard(x, lead: int):
            dim = zero_blocks.stage_dim(x, self.k)  # a stage block of layers: by layers
            lead = lead if dim is None else dim + 2
            x = jnp.asarray(x)
            shape = x.shape[lead:]
            flat = x.reshape((*x.shape[:lead], -1))
            c = self.new_layout().chunk(flat.shape[-1:])
            flat = jnp.pad(flat, [(0, 0)] * lead + [(0, self.n * c - flat.shape[-1])])
            spec = [None] * lead + [self.entry]
            if dim is not None:
                spec[dim] = mesh_lib.STAGE_AXIS
            sharding = NamedSharding(self.mesh, PartitionSpec(*spec))
            return ShardedParam(placement.put(flat, sharding), shape)

        if not stacked:
            return jax.tree.map(lambda x: shard(x, 0), params)
        return {
            k: jax.tree.map(lambda x, lead=int(k in stacked): shard(x, lead), v)
            for k, v in params.items()
        }


def warn_if_gathered(stage: int, reason: str | None) -> None:
    """Warns, at ``init``, that the update runs on gathered arrays, and why.

    The warning points at the user's ``opt.init``: the caller of `DistributedOptimizer.init`,
    which calls the loss-scale wrapper's ``init``, which calls `sharded_update`'s.
    """
    if reason is None:
        return
    warnings.warn(
        f"wrap_optimizer(zero_stage={stage}): the optax transformation is not computed on "
        f"shards: {reason}. Its update runs on whole arrays, gathered for each step (exact; "
        f"the state stays sharded between steps, but is whole on every device during the "
        f"update, and gathering it moves its bytes once per step). Element-wise "
        f"transformations and full reductions (global-norm clipping, LAMB) run on shards; "
        f"see the README section 'What is exact, and what is refused'.",
        stacklevel=5,
    )


# -- as optax transformations -------------------------------------------------------------------

ScatterMeanState = optax.EmptyState

_PLAIN_PARAMS = (
    "wrap_optimizer(zero_stage=3): init got plain parameters; store them sharded first: "
    "params = opt.shard_params(params), and call rp.gather_params in the forward pass."
)


def scatter_mean(zero: Zero, *, grad_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
    """Local gradients -> this replica's slice of their mean over the replicas (stateless).

    ZeRO-1/2: each leaf is flattened, padded and reduce-scattered (sent in ``grad_dtype`` if
    given, e.g. ``jnp.bfloat16``), the same bytes as half an all-reduce. ZeRO-3: the gradients of
    `ShardedParam` leaves are slices already, summed over the replicas by the autodiff of
    `gather_params`; they are divided by N.

    Equivalent to (replica ``r``)::

        updates = [mean over replicas of flat_padded(g)[r c : (r + 1) c] for g in grads]

    Args:
      zero: the ZeRO layout.
      grad_dtype: the dtype the gradients are sent in (ZeRO-1/2), or None for their own.

    Returns:
      An optax transformation whose state is `ScatterMeanState` (empty).
    """

    def update(grads, state, params=None, **extra_args):
        del params, extra_args
        if zero.stage == 3:  # autodiff of gather_params already summed each slice
            return jax.tree.map(lambda g: g / zero.n, grads), state
        return zero.reduce_scatter(grads, grad_dtype), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def sharded_update(
    tx: optax.GradientTransformation, zero: Zero
) -> optax.GradientTransformationExtraArgs:
    """``tx`` run on this replica's slices of the mean gradients, as on one device (`Zero.apply`).

    ``init(params)`` runs ``tx.init`` on the one-device parameters and stores each state leaf in
    the ZeRO layout (global arrays: run it outside ``step_fn``); it warns if the update cannot
    run on slices and will gather (`Zero.plan`). With ZeRO-3 ``params`` must be `ShardedParam`
    leaves. ``update(slices, state, params=None, *, local_grads=None, **extra_args)`` takes the
    slices of `scatter_mean` and returns whole updates (ZeRO-3: in the `ShardedParam` layout);
    ``local_grads``, the gradients as ``step_fn`` computed them, gives the one-device shapes when
    ``params`` is None. Other ``extra_args`` go to ``tx``.

    Args:
      tx: any optax transformation.
      zero: the ZeRO layout.

    Returns:
      An optax transformation whose state is ``tx``'s, each leaf ``[N * c]`` sharded over the data
      axes (scalar leaves, such as Adam's count, replicated).

    Raises:
      ValueError: from ``init``, with ZeRO-3 and plain parameters.
    """
    inner = optax.with_extra_args_support(tx)

    def init(params):
        if zero.stage == 3 and not has_sharded_params(params):
            raise ValueError(_PLAIN_PARAMS)
        warn_if_gathered(zero.stage, zero.plan(inner, params))
        return zero.init(inner, params)

    def update(slices, state, params=None, *, local_grads=None, **extra_args):
        return zero.apply(inner, slices, state, params, extra_args, local_grads)

    return optax.GradientTransformationExtraArgs(init, update)
