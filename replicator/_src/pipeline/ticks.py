"""What the scanned schedules share: the tick loop, the stage transfer, and tree helpers.

A schedule is one body ``iteration(carry, u)`` that runs one layer of one tick on this stage
(iteration ``u`` of a tick of Lv iterations); `run_ticks` runs it as one ``lax.scan``, or, to
debug, as a Python loop over the same body. `shift` is the only communication between stages:
``lax.ppermute`` over the ``stage`` axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.typing import PyTree

LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]


def run_ticks(iteration: Callable, carry: PyTree, num_iterations: int, unroll: bool) -> PyTree:
    """Runs ``iteration(carry, u)`` for every ``u``: one ``lax.scan``, or a Python loop to debug.

    Equivalent to: ``for u in range(num_iterations): carry, _ = iteration(carry, u)``; with
    ``unroll`` that loop is what is traced (one copy of the body per iteration).
    """
    if unroll:
        for u in range(num_iterations):
            carry, _ = iteration(carry, jnp.int32(u))
        return carry
    return lax.scan(iteration, carry, jnp.arange(num_iterations, dtype=jnp.int32))[0]


def shift(tree: PyTree, k: int, step: int, *, ring: bool) -> PyTree:
    """Sends each stage's value to stage ``s + step`` (cyclically if ``ring``).

    Equivalent to: ``out[s + step] = tree[s]`` for every stage ``s`` of the ``k``; a stage
    that receives nothing gets zeros.
    """
    perm = [(s, (s + step) % k) for s in range(k) if ring or 0 <= s + step < k]
    return lax.ppermute(tree, STAGE_AXIS, perm)


def mean_loss(loss_fn: LossFn, head_params: PyTree, y: PyTree, t: PyTree, m: int) -> jax.Array:
    """One micro-batch's share of the mean loss over ``m`` micro-batches, in float32."""
    return jnp.asarray(loss_fn(head_params, y, t), jnp.float32) / m


def take(tree: PyTree, i) -> PyTree:
    """Row ``i`` of every leaf (``i`` may be traced)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def put(tree: PyTree, i, value: PyTree) -> PyTree:
    """Every leaf with row ``i`` set to ``value``'s leaf (``i`` may be traced)."""
    return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


def where(pred, a: PyTree, b: PyTree) -> PyTree:
    """``a`` where ``pred`` is true, else ``b``, leaf by leaf."""
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def zeros(tree: PyTree) -> PyTree:
    """Zeros shaped like ``tree``."""
    return jax.tree.map(jnp.zeros_like, tree)


def add(a: PyTree, b: PyTree) -> PyTree:
    """The leaf-wise sum of two trees of one structure."""
    return jax.tree.map(jnp.add, a, b)


def entry(a: jax.Array, lead: tuple) -> jax.Array:
    """``a[lead]`` for traced integer indices ``lead`` (one per leading axis): a dynamic slice."""
    starts = (*lead, *([0] * (a.ndim - len(lead))))
    sizes = (*([1] * len(lead)), *a.shape[len(lead) :])
    return lax.dynamic_slice(a, starts, sizes).reshape(a.shape[len(lead) :])


def put_entry(a: jax.Array, lead: tuple, x: jax.Array) -> jax.Array:
    """``a`` with ``a[lead] = x``: a dynamic update slice, which XLA runs in place (``a.at[i,
    j].set(x)`` with traced indices is a scatter, which may rewrite all of ``a``)."""
    starts = (*lead, *([0] * (a.ndim - len(lead))))
    update = x.astype(a.dtype).reshape((1,) * len(lead) + tuple(x.shape))
    return lax.dynamic_update_slice(a, update, starts)


def add_entry(a: jax.Array, lead: tuple, x: jax.Array) -> jax.Array:
    """``a`` with ``x`` added to ``a[lead]``, in place."""
    return put_entry(a, lead, entry(a, lead) + x)
