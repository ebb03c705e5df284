"""The wrapped optimizer: cross-replica gradient reduction, then any optax transformation.

Options follow Horovod and DeepSpeed:

* ``zero_stage=1`` or ``2`` (ZeRO): the optimizer state is sharded over the replicas. Each leaf
  is flattened and padded to ``N * c`` elements; replica r owns elements ``[r c, (r+1) c)`` of
  every state leaf. ``update`` reduce-scatters the gradients (each replica gets the mean of its
  slice), runs the inner transformation on its slice, and all-gathers the updates: the same
  bytes on the wire as an all-reduce, and 1/N of the optimizer state per device. Within one step
  stages 1 and 2 are the same program; they differ in where accumulated gradients live, which
  matters with gradient accumulation.
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

The inner transformation must act element by element (SGD, momentum, Adam, AdamW, Lion, ...)
when the state is sharded: it sees one slice of each leaf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding

from replicator._src import collectives, errors, placement, zero
from replicator._src.binding import current_binding
from replicator._src.mesh import replicated_sharding
from replicator._src.sharded_eval import chunk
from replicator._src.typing import PyTree
from replicator._src.zero import ShardedParam, is_sharded_param

ZERO_STAGES = (0, 1, 2, 3)


class LossScaleState(NamedTuple):
    """Dynamic loss scaling. All fields are replicated scalars."""

    scale: jax.Array  # float32: the loss is multiplied by this before differentiation
    good_steps: jax.Array  # int32: finite steps since the scale last changed
    skipped: jax.Array  # int32: steps skipped so far because a gradient was not finite


class WrappedState(NamedTuple):
    """The state of a `DistributedOptimizer` with ZeRO or loss scaling.

    ``inner`` is the inner transformation's state; with ``zero_stage >= 1`` it is over the
    flattened, padded parameters: every leaf of shape ``[N * c]`` is sharded over the data axes
    (``c`` elements per replica), the others (such as Adam's step count) are replicated.
    """

    inner: optax.OptState
    loss_scale: LossScaleState | None


class DistributedOptimizer(optax.GradientTransformationExtraArgs):
    """An optax transformation (``init``, ``update``) that also runs a whole training step.

    ``update(grads, state, params)`` reduces local gradients over the replicas, clips them and
    applies the inner transformation. `step` also computes the gradients: with gradient
    accumulation and loss scaling, which need to see the loss.
    """

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
          ``metrics`` holds ``loss`` (the mean over replicas), ``grad_norm`` (of the mean
          gradient, before clipping), and with loss scaling ``loss_scale`` and ``skipped`` (the
          number of steps skipped so far).
        """
        return self._step(loss_fn, params, state, batch)

    def shard_params(self, params: PyTree, *, stacked: Any = ()) -> PyTree:
        """ZeRO-3: ``params`` stored as `ShardedParam` leaves, 1/N of each on every replica.

        Args:
          params: replicated or host parameters.
          stacked: top-level keys of ``params`` whose leaves are stacked layers (a leading
            layer axis): each layer is sharded on its own, so that a layer scan can
            `gather_params` one layer at a time.

        Inside ``step_fn``, ``loss_fn`` receives these and calls ``rp.gather_params``.
        """
        return self._shard_params(params, stacked)


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
) -> DistributedOptimizer:
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
      tx: any ``optax.GradientTransformation`` (element-wise when ``zero_stage >= 1``).
      mesh: the replicator's mesh; needed for ``zero_stage >= 1`` (``init`` places the sharded
        state on it). ``Replicator.wrap_optimizer`` passes it.
      zero_stage: 0 (replicated state), or 1 and 2 (state sharded over the replicas).
      clip_global_norm: clip the mean gradient to this global norm, if given.
      grad_dtype: the dtype the gradients are communicated in (default: their own).
      accumulate_steps: micro-batches per `DistributedOptimizer.step`.
      loss_scale: ``None``, a static scale, or ``"dynamic"``.
      loss_scale_period: finite steps after which a dynamic scale doubles.

    Returns:
      A `DistributedOptimizer`. Its state is ``tx``'s own when ``zero_stage == 0`` and there is
      no loss scaling, else a `WrappedState`. With ``zero_stage >= 1`` its ``init`` must run
      outside ``step_fn`` (it returns global arrays sharded over the data axes) and ``update``
      inside, with the parameters.

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
    api = "wrap_optimizer"
    if not isinstance(tx, optax.GradientTransformation):
        hint = (
            f" ({type(tx).__name__} has one: tx.gradient_transformation())"
            if hasattr(tx, "gradient_transformation")
            else ""
        )
        raise TypeError(
            f"{api}: tx must be an optax.GradientTransformation (e.g. optax.adam(1e-3)); "
            f"got {type(tx).__name__}{hint}."
        )
    if zero_stage not in ZERO_STAGES:
        raise ValueError(
            f"{api}: zero_stage={zero_stage!r} is not supported; use one of {ZERO_STAGES} "
            f"(0: replicated optimizer state, 1 and 2: state sharded over the replicas, 3: "
            f"parameters sharded too)."
        )
    if clip_global_norm is not None and not clip_global_norm > 0:
        raise ValueError(f"{api}: clip_global_norm must be > 0 or None; got {clip_global_norm!r}.")
    errors.positive_int(accumulate_steps, api=api, name="accumulate_steps")
    dynamic = loss_scale == "dynamic"
    if not (
        loss_scale is None or dynamic or (isinstance(loss_scale, int | float) and loss_scale > 0)
    ):
        raise ValueError(
            f"{api}: loss_scale must be None, a positive number or 'dynamic'; got {loss_scale!r}."
        )
    errors.positive_int(loss_scale_period, api=api, name="loss_scale_period")
    if zero_stage == 3 and grad_dtype is not None:
        raise ValueError(
            f"{api}: grad_dtype is not supported with zero_stage=3 (its gradients are reduced "
            f"by autodiff's reduce-scatter); cast the parameters before gather_params instead."
        )
    if zero_stage and mesh is None:
        raise ValueError(f"{api}: zero_stage={zero_stage} needs the mesh; use repl.wrap_optimizer.")
    grad_dtype = None if grad_dtype is None else jnp.dtype(grad_dtype)
    inner = optax.with_extra_args_support(tx)
    sharded = zero.Zero(mesh, stage=zero_stage) if zero_stage else None
    wrapped = zero_stage > 0 or loss_scale is not None

    def init(params):
        if zero_stage == 3:
            _check_stage3_params(params)
        if sharded:
            zero.warn_if_gathered(zero_stage, sharded.plan(inner, params))
            inner_state = sharded.init(inner, params)
        else:
            inner_state = inner.init(params)
        if mesh is not None and not sharded:
            inner_state = _on_mesh(inner_state, mesh)
        if not wrapped:
            return inner_state
        scale = None
        if loss_scale is not None:
            start = 2.0**15 if dynamic else float(loss_scale)
            scale = LossScaleState(jnp.float32(start), jnp.int32(0), jnp.int32(0))
            if mesh is not None:
                scale = placement.put(scale, replicated_sharding(mesh))
        return WrappedState(inner_state, scale)

    def reduce(grads):
        """Local gradients -> the mean over replicas: whole (stage 0) or this replica's slice."""
        if zero_stage == 3:  # autodiff of gather_params already summed each slice
            return jax.tree.map(lambda g: g / sharded.n, grads)
        if sharded:
            return sharded.reduce_scatter(grads, grad_dtype)
        return _mean_over_replicas(grads, grad_dtype)

    def finish(reduced, state, params, extra_args, like):
        """Reduced gradients -> (updates, state, metrics): unscale, check, clip, apply."""
        inner_state = state.inner if wrapped else state
        scale = state.loss_scale if wrapped else None
        if scale is not None:
            reduced = jax.tree.map(lambda g: (g / scale.scale).astype(g.dtype), reduced)
        needs = [
            *(["clip_global_norm=..."] if clip_global_norm is not None else []),
            *(["loss_scale='dynamic'"] if scale is not None and dynamic else []),
        ]
        norm = _global_norm(
            reduced, params, over_replicas=sharded is not None, why=", ".join(needs) or None
        )
        if clip_global_norm is not None:
            reduced = _clip(reduced, norm, clip_global_norm)
        if sharded:
            updates, new_inner = sharded.apply(
                inner, reduced, inner_state, params, extra_args, like
            )
        else:
            updates, new_inner = inner.update(reduced, inner_state, params, **extra_args)
        metrics = {} if norm is None else {"grad_norm": norm}
        if scale is not None and dynamic:
            finite = jnp.isfinite(norm)  # the same on every replica: a reduced value
            updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
            new_inner = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, inner_state)
            good = jnp.where(finite, scale.good_steps + 1, 0)
            grow = good >= loss_scale_period
            new_scale = jnp.where(
                finite,
                jnp.where(grow, scale.scale * 2, scale.scale),
                jnp.maximum(scale.scale / 2, 1.0),
            )
            scale = LossScaleState(
                new_scale.astype(jnp.float32),
                jnp.where(grow, 0, good).astype(jnp.int32),
                (scale.skipped + jnp.where(finite, 0, 1)).astype(jnp.int32),
            )
        if scale is not None:
            metrics |= {"loss_scale": scale.scale, "skipped": scale.skipped}
        new_state = WrappedState(new_inner, scale) if wrapped else new_inner
        return updates, new_state, metrics

    def update(grads, state, params=None, **extra_args):
        if sharded:
            sharded.check_binding()
        updates, new_state, _ = finish(reduce(grads), state, params, extra_args, grads)
        return updates, new_state

    def step(loss_fn, params, state, batch):
        if sharded:
            sharded.check_binding()
        k = accumulate_steps
        factor = state.loss_scale.scale if wrapped and state.loss_scale is not None else 1.0

        def grad_of(mb):
            loss, g = jax.value_and_grad(lambda p: loss_fn(p, mb) * factor)(params)
            return loss / factor, g

        if k == 1:
            loss, grads = grad_of(batch)
            reduced = reduce(grads)
        else:
            micro = _split(batch, k)
            # ZeRO-2 and 3: accumulate only this replica's slice.
            per_mb_reduce = zero_stage >= 2
            if zero_stage == 3:
                acc0 = jax.tree.map(jnp.zeros_like, params)
            elif per_mb_reduce:  # this replica's slice of each flattened, padded leaf
                acc0 = jax.tree.map(
                    lambda p: jnp.zeros(chunk(np.size(p), sharded.n), jnp.result_type(p)), params
                )
            else:
                acc0 = jax.tree.map(jnp.zeros_like, params)

            def body(carry, mb):
                loss_sum, acc = carry
                loss, g = grad_of(mb)
                g = reduce(g) if per_mb_reduce else g
                return (loss_sum + loss, jax.tree.map(jnp.add, acc, g)), None

            (loss_sum, acc), _ = lax.scan(body, (jnp.zeros((), jnp.float32), acc0), micro)
            loss = loss_sum / k
            acc = jax.tree.map(lambda a: a / k, acc)
            reduced = acc if per_mb_reduce else reduce(acc)
        updates, new_state, metrics = finish(reduced, state, params, {}, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": collectives.all_reduce(jnp.asarray(loss, jnp.float32), "mean")} | metrics
        return params, new_state, metrics

    def shard_params(params, stacked):
        if zero_stage != 3:
            raise ValueError(
                f"shard_params: parameters are stored sharded only with zero_stage=3; this "
                f"optimizer has zero_stage={zero_stage}."
            )
        return sharded.shard_params(params, stacked)

    opt = DistributedOptimizer(init, update)
    opt._step = step
    opt._shard_params = shard_params
    return opt


def _check_stage3_params(params: PyTree) -> None:
    if not any(
        isinstance(x, ShardedParam) for x in jax.tree.leaves(params, is_leaf=is_sharded_param)
    ):
        raise ValueError(
            "wrap_optimizer(zero_stage=3): init got plain parameters; store them sharded first: "
            "params = opt.shard_params(params), and call rp.gather_params in the forward pass."
        )


def _on_mesh(state: PyTree, mesh: Mesh) -> PyTree:
    """Leaves not yet on ``mesh`` (such as Adam's step count) replicated on it, so that the
    state ``run`` gets has the placement of the state it returns, and the step compiles once."""
    replicated = replicated_sharding(mesh)

    def place(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return x
        return placement.put(x, replicated)

    return jax.tree.map(place, state)


def _split(batch: PyTree, k: int) -> PyTree:
    def split(path, a):
        if np.ndim(a) == 0 or a.shape[0] % k:
            raise ValueError(
                f"DistributedOptimizer.step: batch leaf {jax.tree_util.keystr(path)} of shape "
                f"{np.shape(a)} does not split into accumulate_steps={k} micro-batches; use a "
                f"per-replica batch that is a multiple of {k}."
            )
        return a.reshape((k, a.shape[0] // k, *a.shape[1:]))

    return jax.tree_util.tree_map_with_path(split, batch)


def _mean_over_replicas(grads: PyTree, dtype) -> PyTree:
    if dtype is None:
        return collectives.all_reduce(grads, "mean")
    sent = jax.tree.map(lambda g: g.astype(dtype), grads)
    return jax.tree.map(lambda s, g: s.astype(g.dtype), collectives.all_reduce(sent, "mean"), grads)


def _global_norm(grads: PyTree, params: PyTree, *, over_replicas: bool, why: str | None):
    """The global norm of ``grads`` as on one device, or None if it is not needed and unknown.

    ``over_replicas``: each replica holds a slice of the gradients (ZeRO). On a mesh with
    ``stage`` (or ``model``) axes, the gradient of a parameter split over them (a pipeline's
    stage parameters) is summed over them, and that of a parameter whole on every device of a
    replica counted once; which is which is read from ``params``, the state leaves ``step_fn``
    received. ``why`` names the option that needs the norm (clipping, loss scaling), or None.
    """
    binding = current_binding()
    leaves = jax.tree.leaves(grads)
    axes: list[tuple] = [()] * len(leaves)
    if binding.model_axes():
        p_leaves = None if params is None else jax.tree.leaves(params)
        found = p_leaves is not None and len(p_leaves) == len(leaves)
        axes = [binding.split_axes(p) for p in p_leaves] if found else [None] * len(leaves)
        if any(a is None for a in axes):
            if why is None:
                return None
            raise ValueError(_NORM_NEEDS_PARAMS.format(why=why, axes=binding.model_axes()))
    total = jnp.zeros((), jnp.float32)
    for g, split in zip(leaves, axes, strict=True):
        total += collectives.sum_over_axes(jnp.sum(jnp.square(g.astype(jnp.float32))), split)
    return jnp.sqrt(collectives.all_reduce(total, "sum") if over_replicas else total)


_NORM_NEEDS_PARAMS = """\
wrap_optimizer({why}): on a mesh with the axes {axes}, the global norm of the gradients must add \
the gradients of parameters split over those axes (pipeline stages) across them, and count the \
others once. It reads which is which from the parameters, which must be passed as step_fn \
received them in its state:

    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)"""


def _clip(grads: PyTree, norm: jax.Array, max_norm: float) -> PyTree:
    # The same arithmetic as optax.clip_by_global_norm.
    scale = jnp.where(norm < max_norm, 1.0, max_norm / jnp.maximum(norm, 1e-38))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
