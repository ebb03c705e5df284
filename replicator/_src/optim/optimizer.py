"""The wrapped optimizer: cross-replica gradient reduction, then any optax transformation.

Options follow Horovod and DeepSpeed:

* ``zero_stage=1`` or ``2`` (ZeRO): the optimizer state is sharded over the replicas, each leaf
  in its own shape with one axis split (`zero`). ``update`` reduce-scatters the gradients, runs
  the inner transformation on this replica's part, and all-gathers the updates: the bytes of an
  all-reduce, 1/N of the optimizer state per device. Stages 1 and 2 differ only in where
  accumulated gradients live.
* ``clip_global_norm``: clip by the norm of the whole mean gradient, summed over the shards, as
  ``optax.clip_by_global_norm`` on one device.
* ``grad_dtype``: communicate the gradients in this dtype (e.g. ``jnp.bfloat16``, Horovod's
  ``Compression.fp16``), then go on in the gradients' own dtype.
* ``accumulate_steps=k`` (used by `DistributedOptimizer.step`): the batch is split into k
  micro-batches whose gradients are summed in a ``lax.scan`` inside the one compiled step, equal
  to one step on the whole batch (Horovod's ``backward_passes_per_step``, DeepSpeed's
  ``gradient_accumulation_steps``). With ZeRO-2 each micro-batch's gradients are reduce-scattered
  at once and only this replica's slice is accumulated.
* ``loss_scale``: a static scale, or ``"dynamic"``: the loss is multiplied by the scale before
  differentiation; a step whose gradients are not finite is skipped (parameters and optimizer
  state unchanged), the scale halves, and after ``loss_scale_period`` finite steps it doubles.

The inner transformation sees the tree it would see on one device, whatever the mesh: ZeRO
runs its one-device program on each replica's parts (`zero`), a pipeline's stage blocks are
parts of their whole leaves (`zero.on_stage_blocks`), and the packed stages of
``rp.pipeline.sequential`` are each stage's own tree (`stagewise`). So masks by name, LAMB,
Adafactor and global norms in a chain are exact, or refused before a step runs.

ZeRO on 3-D meshes: a leaf keeps its split over ``stage`` (a pipeline's stage blocks) and
``model``, and one more of its axes is split over the replicas (`zero`), so a stage block's
state is 1/(K N) per device; with ``zero_stage=3`` its parameters are gathered one layer at a
time inside ``rp.pipeline.scan_layers``.

This module checks the options and chains the transformations that do the work, one concern
each: `replica_mean` (the all-reduce), `zero` (ZeRO's reduce-scatter and sharded update),
`clipping`, `loss_scaling` and `accumulation`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from replicator._src.core import collectives, placement
from replicator._src.core.mesh import STAGE_AXIS, replicated_sharding
from replicator._src.core.packed import packed_nodes, stage_row_nodes
from replicator._src.core.typing import PyTree
from replicator._src.optim import (
    accumulation,
    checks,
    clipping,
    local_sgd,
    loss_scaling,
    replica_mean,
    zero,
    zero_transforms,
)
from replicator._src.optim.stages import blocks as stage_blocks
from replicator._src.optim.stages import transform as stagewise

ZERO_STAGES = checks.ZERO_STAGES
_EMPTY = optax.EmptyState()


class Parts(NamedTuple):
    """The transformations a `DistributedOptimizer` chains, and the options of its `step`."""

    inner: optax.GradientTransformation  # tx, as given to wrap_optimizer
    reduce: optax.GradientTransformationExtraArgs  # local grads -> mean (ZeRO: replica's slice)
    clip: optax.GradientTransformationExtraArgs | None  # global-norm clipping, if asked for
    apply: optax.GradientTransformationExtraArgs  # tx (ZeRO: on the slices), maybe loss-scaled
    norm: Callable[..., jax.Array | None]  # `clipping.global_norm` of reduced grads
    layout: zero.Zero | None  # the ZeRO layout; None with zero_stage=0
    wrapped: bool  # the state is a `loss_scaling.WrappedState` (ZeRO or loss scaling)
    accumulate_steps: int  # micro-batches per `DistributedOptimizer.step`


class DistributedOptimizer(optax.GradientTransformationExtraArgs):
    """An optax transformation (``init``, ``update``) that also runs a whole training step.

    ``update(grads, state, params)`` reduces local gradients over the replicas, clips them and
    applies the inner transformation. `step` also computes the gradients: with gradient
    accumulation and loss scaling, which need to see the loss. Each concern is a transformation
    of its own, in ``parts`` (a `Parts`); `wrap_optimizer` builds them.
    """

    # A NamedTuple of exactly (init, update): optax tells a transformation by isinstance (and
    # optax.chain unpacks (init, update) pairs), so no third field; the items call the methods
    # below, and `parts` is set once, in the constructor.

    parts: Parts

    def __new__(cls, parts: Parts) -> DistributedOptimizer:
        def init(params):
            return self.init(params)

        def update(grads, state, params=None, **extra_args):
            return self.update(grads, state, params, **extra_args)

        self = super().__new__(cls, init, update)
        self.parts = parts
        return self

    def __getnewargs__(self) -> tuple[Parts]:  # copy.copy: the constructor takes `parts`
        return (self.parts,)

    def init(self, params: PyTree) -> optax.OptState:
        """The optimizer state for ``params``; with ZeRO, call it outside ``step_fn``.

        Returns:
          ``tx``'s own state (zero_stage 0, no loss scaling), else a `loss_scaling.WrappedState`;
          with ``zero_stage >= 1``, global arrays sharded over the data axes.

        Raises:
          ValueError: for ZeRO with clipping or dynamic loss scaling on ``pipeline.sequential``."""
        p = self.parts
        if p.layout is not None and stage_row_nodes(params) and p.norm.keywords.get("why"):
            raise ValueError(
                f"wrap_optimizer(zero_stage={p.layout.stage}, {p.norm.keywords['why']}): with "
                f"the packed stages of pipeline.sequential, ZeRO reduces each stage's gradients "
                f"inside the update; clip with optax.clip_by_global_norm in the chain instead "
                f"(exact: the norm is taken over every stage), and use a static loss_scale."
            )
        return p.apply.init(params)

    def update(
        self, grads: PyTree, state: optax.OptState, params: PyTree = None, **extra_args
    ) -> tuple[PyTree, optax.OptState]:
        """``(updates, state)`` from this replica's local ``grads``; call it inside ``step_fn``.

        Equivalent to::

            grads = rp.all_reduce(grads, "mean")   # ZeRO: this replica's slice of the mean
            if clip_global_norm: grads = clip_by_global_norm(grads, clip_global_norm)
            updates, state = tx.update(grads, state, params, **extra_args)

        Args:
          grads: this replica's local gradients.
          state: this optimizer's state.
          params: the parameters (needed with ZeRO, and by a ``tx`` that reads them).
          **extra_args: passed on to ``tx``.
        """
        p = self.parts
        kept, state, grads, params = state, *placement.to_device((state, grads, params))
        with self._scope():
            if p.layout is not None:
                p.layout.check_binding()
                extra_args = {**extra_args, "local_grads": grads}
            reduced = self._reduce(grads, params)
            updates, state, _ = self._apply(reduced, state, params, extra_args, like=grads)
        return updates, placement.like_spaces(state, kept)

    def step(self, loss_fn, params: PyTree, state, batch: PyTree):
        """One optimizer step on ``batch``: ``(params, state, metrics)``.

        Equivalent to (one replica's view; ``k = accumulate_steps``)::

            grads = mean over the k micro-batches mb of jax.grad(loss_fn)(params, mb)
            updates, state = self.update(grads, state, params)   # mean over replicas, ...
            params = optax.apply_updates(params, updates)

        Args:
          loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a batch.
          params: the parameters, as ``step_fn`` sees them.
          state: this optimizer's state.
          batch: this replica's batch; its leading axis must divide by ``accumulate_steps``.

        Returns:
          ``(params, state, metrics)``: ``metrics`` holds ``loss`` (mean over replicas),
          ``grad_norm`` (of the mean gradient, before clipping); with loss scaling ``loss_scale``
          and ``skipped`` (the number of steps skipped so far).
        """
        p = self.parts
        with self._scope():
            _ = p.layout is None or p.layout.check_binding()
        scale = state.loss_scale.scale if p.wrapped and state.loss_scale is not None else 1.0
        scale = placement.to_device(scale)
        # accumulate this replica's slice (packed stages: reduced leaf by leaf in the update)
        sliced = p.layout is not None and p.layout.stage >= 2 and not stage_row_nodes(params)
        loss, grads = accumulation.accumulated_grads(
            loss_fn,
            params,
            batch,
            steps=p.accumulate_steps,
            scale=scale,
            each=(lambda g: self._reduce_inside(g, placement.to_device(params)))
            if sliced
            else None,
            zeros=p.layout.slice_zeros if sliced else None,
        )
        if sliced:  # hybrid ZeRO-2: the micro-batches' sum crosses the slices once
            grads = p.layout.across_tree(grads)
        kept = (params, state)  # `rp.to_host`'s: a layer at a time forward, whole for the update
        params, state = placement.to_device(params), placement.to_device(state)
        with self._scope():
            reduced = grads if sliced else self._reduce(grads, params)
            updates, state, metrics = self._apply(reduced, state, params, {}, like=params)
        params, state = placement.like_spaces((optax.apply_updates(params, updates), state), kept)
        metrics = {"loss": collectives.all_reduce(jnp.asarray(loss, jnp.float32), "mean")} | metrics
        return params, state, metrics

    def shard_params(self, params: PyTree, *, stacked: Any = (), split: Any = None) -> PyTree:
        """ZeRO-3: ``params`` stored as `ShardedParam` leaves, 1/N of each on every replica.

        Each parameter keeps its shape; its first axis that divides by the replicas and is
        not split over ``stage`` or ``model`` already is split over the data axes too
        (`zero_layout.split_dim`). A parameter with no such axis is kept whole on every replica.

        Args:
          params: placed (``repl.place``, ``repl.replicate``) or host parameters.
          stacked: top-level keys of ``params`` whose leaves are stacked layers (a leading
            layer axis): that axis is never the split one, so that a layer scan can
            `gather_params` one layer at a time. A dict gives each key's number of leading
            layer axes, e.g. ``{"stages": 2}`` for a pipeline's ``[K, L/K, ...]`` stages on a
            mesh without ``stage`` (on a mesh with it, they are known from the placement).
          split: top-level keys of ``params`` and the axis (negative: counted from the end) to
            split their leaves by where that axis can be, for example ``{"embed": -1}``: the
            token table ``[V, D]`` by columns, so that each replica looks up its own columns of
            every token's row instead of gathering the table (``gpt.zero_split``).

        Inside ``step_fn``, ``loss_fn`` receives these and calls ``rp.gather_params`` (over the
        data axes only, so a product split over ``model`` is computed once).

        A leaf split over ``stage`` (`rp.pipeline.stage_spec`) is a stage block of stacked
        layers: its stage and layer axes are never split, whether or not its key is in
        ``stacked``, and the layer function gathers its layer inside the scan,
        ``rp.pipeline.scan_layers(lambda p, h: layer_fn(rp.gather_params(p), h))``.

        Returns:
          ``params`` with `ShardedParam` leaves, global arrays on the mesh.

        Raises:
          ValueError: without ``zero_stage=3``.
        """
        layout = self.parts.layout
        if layout is None or layout.stage != 3:
            raise ValueError(
                f"shard_params: parameters are stored sharded only with zero_stage=3; this "
                f"optimizer has zero_stage={0 if layout is None else layout.stage}."
            )
        return layout.shard_params(params, stacked, split)

    def plan(self, params: PyTree) -> zero.ZeroPlan:
        """Where ZeRO keeps each parameter and state leaf, and what the update gathers.

        Args:
          params: the parameters, as ``init`` takes them.

        Returns:
          A `ZeroPlan` (nothing is allocated): each leaf's split axis and bytes, and which
          operations of the update gather.

        >>> import jax, jax.numpy as jnp, optax, replicator as rp
        >>> repl = rp.Replicator(devices=jax.devices()[:2])
        >>> opt = repl.wrap_optimizer(optax.adafactor(1e-2, min_dim_size_to_factor=2), zero_stage=1)
        >>> plan = opt.plan(repl.replicate({"w": jnp.zeros((4, 6))}))
        >>> plan.params[0].split   # w is split along its 4 rows, 2 on each replica
        0
        >>> [(leaf.shape, leaf.split) for leaf in plan.state]  # count, row and column statistics
        [((), None), ((4,), 0), ((6,), None), ((1,), None)]
        >>> plan.on_shards   # the row means split like the rows; the column means completed
        True

        Raises:
          ValueError: with ``zero_stage=0`` (nothing is sharded), or for parameters ZeRO
            refuses (as ``init`` would).
        """
        layout = self.parts.layout
        if layout is None:
            raise ValueError("plan: zero_stage=0 keeps every leaf whole; there is no ZeRO layout.")
        return layout.layout(optax.with_extra_args_support(self.parts.inner), params)[1]

    def _scope(self):
        """Where the reduction and the update run: inside each slice with hybrid ZeRO
        (`zero.Zero.scope`), else over every replica."""
        layout = self.parts.layout
        return contextlib.nullcontext() if layout is None else layout.scope()

    def _reduce_inside(self, grads: PyTree, params: PyTree) -> PyTree:
        """`_reduce` over the replicas ZeRO splits over only (hybrid ZeRO: inside the slice;
        ``layout.across_tree`` then takes the mean across the slices)."""
        with self._scope():
            return self.parts.reduce.update(grads, _EMPTY, params, across=False)[0]

    def _reduce(self, grads: PyTree, params: PyTree) -> PyTree:
        """Local gradients -> the mean over replicas: whole (stage 0) or this replica's part."""
        return self.parts.reduce.update(grads, _EMPTY, params)[0]

    def _apply(self, reduced: PyTree, state, params: PyTree, extra_args: dict, *, like: PyTree):
        """Reduced gradients -> ``(updates, state, metrics)``: unscale, clip, ``tx``, loss scale.

        The global norm is computed once, for clipping, the dynamic loss scale and the metrics.
        ``like`` is the gradients (or parameters) as ``step_fn`` holds them: ZeRO reads from
        them which reduced leaves are this replica's part.
        """
        p = self.parts
        scale = state.loss_scale if p.wrapped else None
        reduced = loss_scaling.unscale(reduced, scale)
        if p.layout is not None and packed_nodes(reduced):
            norm = None  # not reduced yet: ZeRO reduces packed stages inside the update
        else:
            split = False if p.layout is None else p.layout.split_flags(params, like)
            norm = p.norm(reduced, params, over_replicas=split)
        if p.clip is not None:
            reduced, _ = p.clip.update(reduced, _EMPTY, params, grad_norm=norm)
        if p.wrapped:
            extra_args = {**extra_args, "grad_norm": norm}
        updates, state = p.apply.update(reduced, state, params, **extra_args)
        metrics = {} if norm is None else {"grad_norm": norm}
        if scale is not None:
            metrics |= {"loss_scale": state.loss_scale.scale, "skipped": state.loss_scale.skipped}
        return updates, state, metrics


def wrap_optimizer(
    tx: optax.GradientTransformation,
    /,
    *,
    mesh: Mesh | None = None,
    zero_stage: int = 0,
    clip_global_norm: float | None = None,
    grad_dtype: Any = None,
    accumulate_steps: int = 1,
    loss_scale: float | str | None = None,
    loss_scale_period: int = 2000,
    local_steps: int | None = None,
    outer_optimizer: optax.GradientTransformation | None = None,
    zero_axes: tuple[str, ...] | None = None,
) -> DistributedOptimizer | local_sgd.LocalSGD:
    """Wraps ``tx`` so that it first takes the mean of the gradients over all replicas.

    This is Horovod's ``DistributedOptimizer``: ``step_fn`` computes local gradients, exactly as
    on one device, and the wrapped optimizer all-reduces them before ``tx`` sees them. Because
    the mean is a placeholder collective, the same optimizer works unreplicated (one replica:
    the mean is the identity).

    Equivalent to::

        grads = rp.all_reduce(grads, "mean")
        if clip_global_norm: grads = clip_by_global_norm(grads, clip_global_norm)
        updates, state = tx.update(grads, state, params)

    Args:
      tx: any ``optax.GradientTransformation``.
      mesh: the replicator's mesh; needed for ``zero_stage >= 1`` (``init`` places the sharded
        state on it). ``Replicator.wrap_optimizer`` passes it.
      zero_stage: 0 (replicated state), 1 and 2 (state sharded over the replicas, and over
        ``stage`` and ``model`` as the parameters are), or 3 (parameters sharded too).
      clip_global_norm: clip the mean gradient to this global norm, if given.
      grad_dtype: the dtype the gradients are communicated in (default: their own).
      accumulate_steps: micro-batches per `DistributedOptimizer.step`.
      loss_scale: ``None``, a static scale, or ``"dynamic"``.
      loss_scale_period: finite steps after which a dynamic scale doubles.
      local_steps: local SGD / DiLoCo (`local_sgd`): each worker (an index of ``dcn_data``)
        takes this many steps with its gradients reduced over its own replicas, then the
        workers average their parameter deltas, once, and ``outer_optimizer`` takes the mean
        as a gradient. Use ``opt.step``: a step is all of them. ``None``: synchronous.
      outer_optimizer: the outer step of ``local_steps`` (default: SGD, learning rate 0.7,
        Nesterov momentum 0.9, as DiLoCo).
      zero_axes: hybrid ZeRO (FSDP's ``HYBRID_SHARD``, MaxText's FSDP inside a slice with
        ``dcn_data`` across): the replica axes ZeRO splits the state (and with
        ``zero_stage=3`` the parameters) over, e.g. ``("data",)``; each part is whole on every
        index of the others, whose replicas then exchange only the reduced gradients' parts.
        None: every replica axis.

    Returns:
      A `DistributedOptimizer` (its ``init`` runs outside ``step_fn`` with ZeRO, ``update``
      inside); with ``local_steps``, a `local_sgd.LocalSGD` around one.

    Raises:
      TypeError: if ``tx`` is not an optax transformation.
      ValueError: for an unknown ``zero_stage``, a non-positive ``clip_global_norm``, or bad
        ``accumulate_steps`` or ``loss_scale``.

    >>> import jax.numpy as jnp, optax
    >>> tx = wrap_optimizer(optax.sgd(0.1))          # public as Replicator.wrap_optimizer
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"]
    Array([-0.1, -0.1], dtype=float32)
    """
    checks.options(
        tx, zero_stage, clip_global_norm, accumulate_steps, loss_scale, loss_scale_period
    )
    checks.zero_axes(zero_axes, zero_stage, mesh)  # (local SGD takes no ZeRO: refused below)
    if local_steps is not None or outer_optimizer is not None:
        steps = 1 if local_steps is None else local_steps
        local_sgd.check_options(steps, outer_optimizer, zero_stage, loss_scale)
        inner = wrap_optimizer(
            tx, mesh=mesh, clip_global_norm=clip_global_norm, grad_dtype=grad_dtype,
            accumulate_steps=accumulate_steps, loss_scale=loss_scale,
            loss_scale_period=loss_scale_period,
        )  # fmt: skip
        outer = local_sgd.default_outer() if outer_optimizer is None else outer_optimizer
        outer = optax.with_extra_args_support(outer)
        outer = outer if mesh is None else _placed_on(outer, mesh)  # placed as the parameters
        return local_sgd.LocalSGD(inner, outer, int(steps), mesh)
    checks.zero_needs(zero_stage, mesh, grad_dtype, zero_axes)
    grad_dtype = None if grad_dtype is None else jnp.dtype(grad_dtype)
    inner = optax.with_extra_args_support(tx)
    layout = zero.Zero(mesh, stage=zero_stage, axes=zero_axes) if zero_stage else None
    if layout is not None:
        reduce = zero_transforms.scatter_mean(layout, grad_dtype=grad_dtype)
        apply = zero_transforms.sharded_update(inner, layout, grad_dtype=grad_dtype)
    else:
        reduce = replica_mean.mean_over_replicas(grad_dtype=grad_dtype)
        other = None if mesh is None else _placed_on(inner, mesh)
        if mesh is not None and dict(mesh.shape).get(STAGE_AXIS, 1) > 1:
            other = stage_blocks.on_stage_blocks(inner, mesh, other)
        apply = stagewise.stagewise(inner, mesh, other)
    wrapped = zero_stage > 0 or loss_scale is not None
    if wrapped:
        sharding = None if mesh is None else replicated_sharding(mesh)
        apply = loss_scaling.with_loss_scale(
            apply, loss_scale=loss_scale, period=loss_scale_period, sharding=sharding
        )
    needs = [
        *(["clip_global_norm=..."] if clip_global_norm is not None else []),
        *(["loss_scale='dynamic'"] if loss_scale == "dynamic" else []),
    ]
    norm = functools.partial(clipping.global_norm, why=", ".join(needs) or None)
    clip = None
    if clip_global_norm is not None:
        clip = clipping.clip_by_global_norm(clip_global_norm)
    return DistributedOptimizer(
        Parts(tx, reduce, clip, apply, norm, layout, wrapped, accumulate_steps)
    )


def _placed_on(tx: optax.GradientTransformationExtraArgs, mesh: Mesh):
    """``tx`` whose ``init`` replicates on ``mesh`` the state leaves not yet on it (such as
    Adam's step count), so that the state ``run`` gets has the placement of the state it
    returns, and the step compiles once."""
    replicated = replicated_sharding(mesh)

    def place(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return x
        return placement.put(x, replicated)

    def init(params):
        state = tx.init(params)
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
            return jax.tree.map(place, state)
        return _abstract_placed(state, params, mesh, replicated)

    return optax.GradientTransformationExtraArgs(init, tx.update)


def _abstract_placed(state: PyTree, params: PyTree, mesh: Mesh, replicated) -> PyTree:
    """`_placed_on`'s placement of ``tx.init(params)`` when the state is built from shapes
    (``Replicator.abstract``), where a traced leaf carries no sharding. Eagerly, a state leaf
    made like a parameter (``zeros_like``: Adam's moments, momentum) has the parameter's
    sharding; here a subtree with the parameters' structure and shapes gets their shardings,
    a scalar is replicated, and any other leaf is refused rather than guessed."""
    shardings = [placement.sharding_of(p) for p in jax.tree.leaves(params)]
    treedef = jax.tree.structure(params)
    shapes = [(np.shape(p), None) for p in jax.tree.leaves(params)]

    def like_params(node) -> bool:
        if jax.tree.structure(node) != treedef:
            return False
        return [(np.shape(x), None) for x in jax.tree.leaves(node)] == shapes

    def place_node(node):
        if placement.sharding_of(node) is not None:  # placed inside tx.init already
            return node
        if like_params(node):
            if any(s is None for s in shardings):
                raise ValueError(
                    "wrap_optimizer: building the optimizer state from shapes (repl.abstract), "
                    "a parameter was not placed by the library (repl.replicate, repl.place), so "
                    "the placement of the state made like it would be a guess. Place the "
                    "parameters with repl.place inside the init function."
                )
            leaves = jax.tree.leaves(node)
            placed = [placement.put(x, s) for x, s in zip(leaves, shardings, strict=True)]
            return jax.tree.unflatten(treedef, placed)
        if np.ndim(node) == 0:  # a leaf here: every node shaped like the params is above
            return placement.put(node, replicated)
        raise ValueError(
            f"wrap_optimizer: building the optimizer state from shapes (repl.abstract), a "
            f"state leaf of shape {list(np.shape(node))} is neither a scalar nor part of a tree "
            f"shaped like the parameters, so its placement on the mesh would be a guess. Build "
            f"this state from real parameters, or place it yourself inside the init function "
            f"(repl.place(opt_state, specs))."
        )

    return jax.tree.map(place_node, state, is_leaf=like_params)
