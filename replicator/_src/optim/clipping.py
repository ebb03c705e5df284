"""Global-norm clipping that is exact across shards: the norm of the whole gradient.

`global_norm` is the norm optax computes on one device, from gradients that are split over
devices: over the replicas (ZeRO's slices) and over pipeline stages or model axes, where the
gradient of a parameter split over those axes is summed across them and that of a parameter
whole on every device of a replica counted once. `clip_by_global_norm` is
``optax.clip_by_global_norm`` with that norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from replicator._src.core import collectives
from replicator._src.core.binding import current_binding
from replicator._src.core.typing import PyTree

ClipByGlobalNormState = optax.EmptyState

_NORM_NEEDS_PARAMS = """\
wrap_optimizer({why}): on a mesh with the axes {axes}, the global norm of the gradients must add \
the gradients of parameters split over those axes (pipeline stages) across them, and count the \
others once. It reads which is which from the parameters, which must be passed as step_fn \
received them in its state:

    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)"""


def global_norm(
    grads: PyTree,
    params: PyTree,
    *,
    over_replicas: bool | Sequence[bool] = False,
    why: str | None = None,
) -> jax.Array | None:
    """The global norm of ``grads`` as on one device, or None if it is not needed and unknown.

    Equivalent to ``optax.tree.norm`` of the whole gradient, in float32.

    Args:
      grads: the gradients, reduced over the replicas (whole, or each replica's slice).
      params: the state leaves ``step_fn`` received, which tell which gradients are split over
        the ``stage`` (or ``model``) axes; only read on a mesh with such axes.
      over_replicas: each replica holds a part of the gradients (ZeRO): their squares are
        summed over the replicas too. One bool for every leaf, or one per leaf (ZeRO keeps
        leaves with no axis that divides by the replicas whole: those are counted once).
      why: the option that needs the norm (``"clip_global_norm=..."``), or None if it is only
        reported.

    Returns:
      A float32 scalar, the same on every device; or None if ``params`` do not tell how the
      gradients are split and ``why`` is None.

    Raises:
      ValueError: if ``params`` do not tell how the gradients are split and ``why`` is given.

    >>> import jax.numpy as jnp
    >>> global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}, None, over_replicas=False)
    Array(5., dtype=float32)
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
    parts = [over_replicas] * len(leaves) if isinstance(over_replicas, bool) else over_replicas
    whole = split_total = jnp.zeros((), jnp.float32)
    for g, split, part in zip(leaves, axes, parts, strict=True):
        square = collectives.sum_over_axes(jnp.sum(jnp.square(g.astype(jnp.float32))), split)
        if part:
            split_total += square
        else:
            whole += square
    if any(parts):
        whole += collectives.all_reduce(split_total, "sum")
    return jnp.sqrt(whole)


def clip_by_global_norm(
    max_norm: float, *, over_replicas: bool | Sequence[bool] = False
) -> optax.GradientTransformationExtraArgs:
    """Scales the updates down to the global norm ``max_norm`` if their norm is larger.

    The same arithmetic as ``optax.clip_by_global_norm``, with the norm of `global_norm`::

        norm = global_norm(updates, params, over_replicas=over_replicas)
        updates = updates if norm < max_norm else updates * max_norm / norm

    ``update(updates, state, params=None, *, grad_norm=None, **extra_args)`` takes the norm as
    ``grad_norm`` when the caller has it already (one reduction for clipping and reporting).

    Args:
      max_norm: the largest global norm, > 0.
      over_replicas: each replica holds a part of the updates (ZeRO), as for `global_norm`.

    Returns:
      An optax transformation whose state is `ClipByGlobalNormState` (empty).

    >>> import jax.numpy as jnp
    >>> tx = clip_by_global_norm(1.0)
    >>> tx.update({"a": jnp.array([3.0, 4.0])}, tx.init(None))[0]["a"]
    Array([0.6, 0.8], dtype=float32)
    """

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del extra_args
        if grad_norm is None:
            grad_norm = global_norm(
                updates, params, over_replicas=over_replicas, why="clip_global_norm=..."
            )
        return clip(updates, grad_norm, max_norm), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def clip(grads: PyTree, norm: jax.Array, max_norm: float) -> PyTree:
    """``grads`` scaled down to the global norm ``max_norm`` if ``norm`` is larger."""
    # The same arithmetic as optax.clip_by_global_norm.
    scale = jnp.where(norm < max_norm, 1.0, max_norm / jnp.maximum(norm, 1e-38))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
