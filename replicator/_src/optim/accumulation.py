"""Gradient accumulation: the gradients of k micro-batches, summed in one ``lax.scan``.

`accumulated_grads` is the scan `DistributedOptimizer.step` runs inside the one compiled step
(Horovod's ``backward_passes_per_step``, DeepSpeed's ``gradient_accumulation_steps``): equal to
the gradient of the whole batch, with the activations of one micro-batch alive at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from replicator._src.core import placement
from replicator._src.core.typing import PyTree

_UNROLLED = False  # set by `unrolled`


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
    """Steps traced within have their micro-batches unrolled: straight-line code, no loop.

    The same values; for reading a program whose every op runs once, as XLA's
    ``cost_analysis()`` counts a loop's body once (`replicator explain` reads XLA's estimate of a
    step with accumulation so, from its one- and two-layer programs). It acts where a step is
    traced: ``jax.jit`` of a function traced before reuses that trace.

    >>> with unrolled():
    ...     accumulated_grads(lambda p, b: jnp.mean(p * b), 2.0, jnp.arange(4.0), steps=2)[0]
    Array(3., dtype=float32)
    """
    global _UNROLLED
    before, _UNROLLED = _UNROLLED, True
    try:
        yield
    finally:
        _UNROLLED = before


def split_batch(
    batch: PyTree, k: int, *, api: str = "DistributedOptimizer.step",
    parts: str = "accumulate_steps={k} micro-batches",
) -> PyTree:  # fmt: skip
    """``batch`` with each leaf's leading axis ``b`` split into ``(k, b // k)`` micro-batches.

    Raises:
      ValueError: if a leaf's leading axis does not divide by ``k`` (naming ``api`` and the
        ``parts``, formatted with ``k``).
    """

    def split(path, a):
        if np.ndim(a) == 0 or a.shape[0] % k:
            raise ValueError(
                f"{api}: batch leaf {jax.tree_util.keystr(path)} of shape {np.shape(a)} does "
                f"not split into {parts.format(k=k)}; use a per-replica batch that is a "
                f"multiple of {k}."
            )
        return a.reshape((k, a.shape[0] // k, *a.shape[1:]))

    return jax.tree_util.tree_map_with_path(split, batch)


def accumulated_grads(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    params: PyTree,
    batch: PyTree,
    *,
    steps: int = 1,
    scale: float | jax.Array = 1.0,
    each: Callable[[PyTree], PyTree] | None = None,
    zeros: Callable[[PyTree], PyTree] | None = None,
) -> tuple[jax.Array, PyTree]:
    """The mean loss and the mean gradients over ``steps`` micro-batches of ``batch``.

    Equivalent to (one ``lax.scan`` when ``steps > 1``)::

        for mb in split_batch(batch, steps):
            loss, g = jax.value_and_grad(lambda p: loss_fn(p, mb) * scale)(params)
            loss_sum, acc = loss_sum + loss / scale, acc + each(g)
        return loss_sum / steps, acc / steps

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a batch.
      params: the parameters to differentiate.
      batch: this replica's batch; its leading axis must divide by ``steps``.
      steps: the number of micro-batches.
      scale: the loss scale: the loss is multiplied by it before differentiation and the losses
        divided by it after (the gradients are not).
      each: applied to each micro-batch's gradients before they are summed (ZeRO-2 and 3
        reduce each micro-batch's gradients to this replica's slice); None: the identity.
      zeros: ``zeros(params)``, the accumulator's zeros, shaped as ``each``'s output (default:
        zeros like ``params``).

    Returns:
      ``(loss, grads)``.

    >>> import jax.numpy as jnp
    >>> loss_fn = lambda p, b: jnp.mean(p * b)
    >>> accumulated_grads(loss_fn, jnp.float32(2.0), jnp.arange(4.0), steps=2)
    (Array(3., dtype=float32), Array(1.5, dtype=float32))
    """

    def grad_of(mb):
        loss, g = jax.value_and_grad(lambda p: loss_fn(p, mb) * scale)(params)
        g = placement.to_device(g)  # a parameter's in host memory (`rp.to_host`): so is its own
        return loss / scale, g if each is None else each(g)

    if steps == 1:
        return grad_of(batch)

    def body(carry, mb):
        loss_sum, acc = carry
        loss, g = grad_of(mb)
        return (loss_sum + loss, jax.tree.map(jnp.add, acc, g)), None

    micro = split_batch(batch, steps)
    acc0 = jax.tree.map(_zeros_on_device, params) if zeros is None else zeros(params)
    (loss_sum, acc), _ = lax.scan(
        body, (jnp.zeros((), jnp.float32), acc0), micro, unroll=steps if _UNROLLED else 1
    )
    return loss_sum / steps, jax.tree.map(lambda a: a / steps, acc)


def _zeros_on_device(p: jax.Array) -> jax.Array:
    """Zeros like ``p``, on the device even where ``p`` is kept in host memory."""
    return jnp.zeros(p.shape, p.dtype) if placement.in_host_memory(p) else jnp.zeros_like(p)
