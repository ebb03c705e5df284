"""Data parallelism's gradient reduction: the mean of the local gradients over all replicas.

An optax transformation (`mean_over_replicas`), stateless, that Horovod calls the
``DistributedOptimizer``'s all-reduce, with its ``Compression.fp16``: the gradients may be sent
in a smaller dtype and go on in their own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from replicator._src.core import collectives
from replicator._src.core.binding import xla_cpu_with
from replicator._src.core.mesh import MODEL_AXIS
from replicator._src.core.typing import PyTree

MeanOverReplicasState = optax.EmptyState


def mean_over_replicas(*, grad_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
    """Local gradients -> their mean over all replicas; every replica gets the whole mean.

    Equivalent to::

        updates = rp.all_reduce(grads, "mean")   # sent in grad_dtype, if given

    Args:
      grad_dtype: the dtype the gradients are sent in (e.g. ``jnp.bfloat16``), or None for their
        own; the mean comes back in the gradients' own dtype.

    Returns:
      An optax transformation whose state is `MeanOverReplicasState` (empty).

    >>> import jax.numpy as jnp
    >>> tx = mean_over_replicas()                     # outside a replicator: one replica
    >>> tx.update({"w": jnp.ones(2)}, tx.init(None))[0]["w"]
    Array([1., 1.], dtype=float32)
    """

    def update(grads, state, params=None, **extra_args):
        del params, extra_args
        return mean(grads, grad_dtype), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def mean(grads: PyTree, dtype: Any) -> PyTree:
    """The mean of ``grads`` over all replicas, sent in ``dtype`` (None: their own)."""
    refuse_narrow_on_xla_cpu(dtype)
    if dtype is None:
        return collectives.all_reduce(grads, "mean")
    sent = jax.tree.map(lambda g: g.astype(dtype), grads)
    return jax.tree.map(lambda s, g: s.astype(g.dtype), collectives.all_reduce(sent, "mean"), grads)


def refuse_narrow_on_xla_cpu(dtype: Any) -> None:
    """Refuses gradients sent in a dtype narrower than fp32 in a program for XLA:CPU with a
    ``model`` axis, whose compiler ends the process on it (its AllReducePromotion pass clones a
    bf16 all-reduce whose reducer is a copy, for the leaves kept whole over ``model``). A TPU
    compiles it. As `models.layers.common.reduce_cast` refuses ZeRO-3's bf16 parts there."""
    if dtype is None or jnp.dtype(dtype).itemsize >= 4 or not xla_cpu_with(MODEL_AXIS):
        return
    raise ValueError(
        f"wrap_optimizer(grad_dtype={jnp.dtype(dtype).name}) with a {MODEL_AXIS!r} axis aborts "
        f"XLA:CPU's compiler; on the CPU send the gradients in fp32 (grad_dtype=None; "
        f"model.reduce_dtype: null in a config) or use a mesh without {MODEL_AXIS!r}. A TPU "
        f"compiles it: `replicator explain CONFIG --target TYPE` reads that program from here."
    )
