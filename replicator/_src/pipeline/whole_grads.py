"""ZeRO-3 inside a pipeline: a stage's gradients held whole and reduce-scattered once a step.

Under ZeRO-3 a stage's layers are stored split over the replicas (`ShardedParam`) and the
layer function gathers them (`rp.gather_params`), so autodiff reduce-scatters each layer's
gradient in every backward pass it runs: M micro-batches reduce-scatter the whole stage's
gradients M times a step (GPipe's backward, M + K - 1 ticks, M + K - 1 times), where ZeRO-3
without a pipeline does it once. ``scatter_grads="step"`` instead hands each layer to the
layer function gathered (a `ShardedParam` with no split axis, which `gather_params` passes
through), so its gradient comes back whole; the schedules add it into an accumulator of the
whole stage, in `accumulator_dtype`, and `scatter` reduce-scatters that once, after the last
tick (FSDP2's ``set_requires_gradient_sync(False)`` over micro-batches, DeepSpeed's ZeRO-3
with pipelines).

1F1B, Interleaved1F1B and ZeroBubble gather each layer where they run it (`gathered`, forward
and backward, as ZeRO-3 does per micro-batch), and hold the whole stage's gradients only.
GPipe and Circular differentiate their forward scan with ``jax.vjp``, whose accumulated
cotangent has the shape of what it differentiates: they gather the stage once a step and keep
it for the step (FSDP2's ``reshard_after_forward=False``), holding the whole stage's weights
and gradients.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.core import collectives
from replicator._src.core.sharded_params import ShardedParam, is_sharded_param
from replicator._src.core.typing import PyTree

CHOICES = ("microbatch", "step")


def check(value: Any, api: str) -> str:
    """``value`` as a ``scatter_grads`` choice, or a ``ValueError`` that names ``api``.

    >>> check("step", "f")
    'step'
    """
    if value not in CHOICES:
        raise ValueError(
            f"{api}: scatter_grads must be 'microbatch' (ZeRO-3's stage gradients "
            f"reduce-scattered in each micro-batch's backward pass) or 'step' (accumulated whole "
            f"over the micro-batches and reduce-scattered once a step); got {value!r}."
        )
    return value


def _split(x: Any) -> bool:
    return isinstance(x, ShardedParam) and x.dim is not None


def has_split(tree: PyTree) -> bool:
    """Whether ``tree`` holds a `ShardedParam` split over the replicas."""
    return any(map(_split, jax.tree.leaves(tree, is_leaf=is_sharded_param)))


def accumulator_dtype(dtype: Any) -> Any:
    """The dtype a whole gradient of ``dtype`` parameters is summed in: float32 for narrower
    floats (a bfloat16 sum over M micro-batches would round M times), else ``dtype``."""
    return jnp.promote_types(dtype, jnp.float32)


def gathered(tree: PyTree) -> PyTree:
    """``tree`` with each split `ShardedParam` all-gathered over the replicas, as a
    `ShardedParam` with no split axis (its ``auto`` kept), which `gather_params` passes
    through. Outside a differentiated function: no reduce-scatter follows."""

    def gather(x):
        if not _split(x):
            return x
        return x.like(collectives.gather_replicas(x.value, x.dim, x.auto), None)

    return jax.tree.map(gather, tree, is_leaf=is_sharded_param)


def _whole_shape(x: ShardedParam) -> tuple[int, ...]:
    shape = list(np.shape(x.value))
    shape[x.dim] *= collectives.num_replicas()
    return tuple(shape)


def abstract(tree: PyTree) -> PyTree:
    """What `gathered` returns, as ``ShapeDtypeStruct`` leaves: for shapes, with no gather."""

    def like(x):
        if not _split(x):
            return x
        whole = jax.ShapeDtypeStruct(_whole_shape(x), jnp.result_type(x.value))
        return x.like(whole, None)

    return jax.tree.map(like, tree, is_leaf=is_sharded_param)


def zeros(tree: PyTree) -> PyTree:
    """The accumulators of ``tree``'s gradients: for a split `ShardedParam`, zeros of its
    whole shape in `accumulator_dtype` (no split axis, as `gathered`'s); for any other leaf,
    zeros like it (its gradient is whole already)."""

    def zero(x):
        if not _split(x):
            return jax.tree.map(jnp.zeros_like, x)
        dtype = accumulator_dtype(jnp.result_type(x.value))
        return x.like(jnp.zeros(_whole_shape(x), dtype), None)

    return jax.tree.map(zero, tree, is_leaf=is_sharded_param)


def widened(tree: PyTree) -> PyTree:
    """`gathered` parameters in `accumulator_dtype` (GPipe differentiates these, so that its
    accumulated cotangent has that dtype)."""
    cast = lambda x: x.astype(accumulator_dtype(x.dtype))
    return jax.tree.map(lambda x: _map_value(x, cast) if _whole(x) else x, tree, is_leaf=_whole)


def narrowed(tree: PyTree, like: PyTree) -> PyTree:
    """``tree`` (`widened` parameters) cast back to the dtypes of ``like``'s leaves."""
    return jax.tree.map(lambda a, b: a.astype(b.dtype), tree, like)


def _whole(x: Any) -> bool:
    return isinstance(x, ShardedParam) and x.dim is None


def _map_value(x: ShardedParam, f) -> ShardedParam:
    return x.like(f(x.value))


def scatter(accumulated: PyTree, like: PyTree) -> PyTree:
    """The accumulated whole gradients reduce-scattered over the replicas, each into the
    layout and dtype of its parameter in ``like`` (the stage's stored parameters): one
    reduce-scatter a leaf, the transpose of `gather_params`' all-gather. Leaves that were not
    split pass through."""

    def one(g, p):
        if not _split(p):
            return g
        value = g.value.astype(jnp.result_type(p.value))
        return p.like(collectives.scatter_replicas(value, p.dim, p.auto))

    return jax.tree.map(one, accumulated, like, is_leaf=is_sharded_param)


def device_shapes(tree: PyTree) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The dtype and per-device shape of each whole accumulator `zeros` makes for ``tree``,
    for ``Replicator.explain`` to find in the compiled program: its axes split over ``model``
    (``auto``, which XLA partitions) are divided by that axis's size."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)) if mesh.axis_names else {}
    out = []
    for x in jax.tree.leaves(tree, is_leaf=is_sharded_param):
        if not _split(x):
            continue
        shape = list(_whole_shape(x))
        entries = [None] * (len(shape) - len(x.auto)) + list(x.auto)[-len(shape) :]
        for d, entry in enumerate(entries):
            names = entry if isinstance(entry, tuple) else (entry,)
            shape[d] //= math.prod(sizes.get(n, 1) for n in names if isinstance(n, str))
        dtype = jnp.dtype(accumulator_dtype(jnp.result_type(x.value)))
        out.append((dtype.name, tuple(shape)))
    return tuple(out)
