"""Loss scaling, static or dynamic, for training in fp16: the state and the optax wrapper.

The loss is multiplied by a scale before differentiation, so that small gradients survive fp16,
and the mean gradients are divided by it (`unscale`) before clipping and the update. With
``"dynamic"`` scaling, `with_loss_scale` skips a step whose gradients are not finite (the
updates are zero and the inner state is kept), halves the scale, and doubles it after
``period`` finite steps in a row.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from replicator._src.core import placement
from replicator._src.core.typing import PyTree
from replicator._src.optim import clipping

DYNAMIC_START = 2.0**15


class LossScaleState(NamedTuple):
    """Dynamic loss scaling. All fields are replicated scalars."""

    scale: jax.Array  # shape=(), float32, replicated: the loss is multiplied by this
    good_steps: jax.Array  # shape=(), int32, replicated: finite steps since the scale changed
    skipped: jax.Array  # shape=(), int32, replicated: steps skipped as not finite, so far


class WrappedState(NamedTuple):
    """The state of a `DistributedOptimizer` with ZeRO or loss scaling (of `with_loss_scale`).

    ``inner`` is the inner transformation's state; with ``zero_stage >= 1`` it is over the
    flattened, padded parameters: every leaf of shape ``[N * c]`` is sharded over the data axes
    (``c`` elements per replica; on a mesh with ``model`` also over it, and for a pipeline's
    stage block ``[K * N * c]`` over ``stage`` and the data axes, see `zero.Zero`), the others
    (such as Adam's step count) are replicated.
    """

    inner: optax.OptState  # ZeRO: flat leaves sharded over the data axes; scalars replicated
    loss_scale: LossScaleState | None  # shape=() leaves, replicated; None without scaling


def unscale(grads: PyTree, state: LossScaleState | None) -> PyTree:
    """The gradients of the scaled loss divided by the scale, in their own dtype."""
    if state is None:
        return grads
    return jax.tree.map(lambda g: (g / state.scale).astype(g.dtype), grads)


def with_loss_scale(
    inner: optax.GradientTransformation,
    *,
    loss_scale: float | str | None = None,
    period: int = 2000,
    sharding: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """``inner`` with a loss scale in its state: `WrappedState` ``(inner, loss_scale)``.

    ``update(grads, state, params=None, *, grad_norm=None, **extra_args)`` takes gradients
    already unscaled (`unscale`) and their global norm (default: `clipping.global_norm` of
    ``grads`` as whole arrays); ``extra_args`` go to ``inner``. Equivalent to::

        updates, inner_state = inner.update(grads, state.inner, params)
        if loss_scale == "dynamic":
            if not isfinite(grad_norm):            # skip the step, halve the scale
                updates, inner_state = zeros, state.inner
                scale, good_steps, skipped = max(scale / 2, 1), 0, skipped + 1
            elif good_steps + 1 >= period:         # double the scale
                scale, good_steps = 2 * scale, 0
            else:
                good_steps += 1

    Args:
      inner: the transformation of the unscaled gradients.
      loss_scale: None (no scaling: the state is ``WrappedState(inner, None)``, the layout of a
        ZeRO optimizer), a static scale, or ``"dynamic"`` (starting at 2**15).
      period: finite steps after which a dynamic scale doubles.
      sharding: where ``init`` places the `LossScaleState` (e.g. replicated on the mesh).

    Returns:
      An optax transformation whose state is a `WrappedState`.

    >>> import jax.numpy as jnp, optax
    >>> tx = with_loss_scale(optax.sgd(1.0), loss_scale="dynamic", period=2)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state)
    >>> state.loss_scale.scale, state.loss_scale.skipped
    (Array(16384., dtype=float32), Array(1, dtype=int32))
    """
    inner = optax.with_extra_args_support(inner)
    dynamic = loss_scale == "dynamic"

    def init(params):
        inner_state = inner.init(params)
        if loss_scale is None:
            return WrappedState(inner_state, None)
        start = DYNAMIC_START if dynamic else float(loss_scale)
        scale = LossScaleState(jnp.float32(start), jnp.int32(0), jnp.int32(0))
        if sharding is not None:
            scale = placement.put(scale, sharding)
        return WrappedState(inner_state, scale)

    def update(grads, state, params=None, *, grad_norm=None, **extra_args):
        updates, inner_state = inner.update(grads, state.inner, params, **extra_args)
        if not dynamic:
            return updates, WrappedState(inner_state, state.loss_scale)
        if grad_norm is None:
            grad_norm = clipping.global_norm(
                grads, params, over_replicas=False, why="loss_scale='dynamic'"
            )
        return _skip_if_not_finite(
            grad_norm, updates, inner_state, state.inner, state.loss_scale, period
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _skip_if_not_finite(norm, updates, new_inner, old_inner, scale: LossScaleState, period: int):
    """The dynamic rule of `with_loss_scale`: ``(updates, WrappedState)``."""
    finite = jnp.isfinite(norm)  # the same on every replica: a reduced value
    updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
    new_inner = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, old_inner)
    good = jnp.where(finite, scale.good_steps + 1, 0)
    grow = good >= period
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
    return updates, WrappedState(new_inner, scale)
