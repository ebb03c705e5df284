"""The wrapped optimizer: cross-replica gradient reduction, then any optax transformation."""

from __future__ import annotations

import optax

from replicator._src import collectives


def wrap_optimizer(tx: optax.GradientTransformation, /) -> optax.GradientTransformationExtraArgs:
    """Wraps ``tx`` so that it first takes the mean of the gradients over all replicas.

    This is Horovod's ``DistributedOptimizer``: ``step_fn`` computes local gradients, exactly as
    on one device, and the wrapped optimizer all-reduces them before ``tx`` sees them. Because
    the mean is a placeholder collective, the same optimizer works unreplicated (one replica:
    the mean is the identity).

    Equivalent to::

        updates, state = tx.update(rp.all_reduce(grads, "mean"), state, params)

    Args:
      tx: any ``optax.GradientTransformation``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with the same state as ``tx``.

    Raises:
      TypeError: if ``tx`` is not an optax transformation.

    >>> import jax.numpy as jnp, optax
    >>> tx = wrap_optimizer(optax.sgd(0.1))          # public as Replicator.wrap_optimizer
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"]
    Array([-0.1, -0.1], dtype=float32)
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"wrap_optimizer: tx must be an optax.GradientTransformation (e.g. optax.adam(1e-3)); "
            f"got {type(tx).__name__}."
        )
    inner = optax.with_extra_args_support(tx)

    def update(grads, state, params=None, **extra_args):
        return inner.update(collectives.all_reduce(grads, "mean"), state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)
