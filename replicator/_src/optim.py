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

The inner transformation must act element by element (SGD, momentum, Adam, AdamW, Lion, ...)
when the state is sharded: it sees one slice of each leaf.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src import collectives
from replicator._src import mesh as mesh_lib
from replicator._src.binding import current_binding
from replicator._src.typing import PyTree

ZERO_STAGES = (0, 1, 2)


class ZeroState(NamedTuple):
    """The state of a ZeRO-sharded optimizer.

    ``inner`` is the inner transformation's state over the flattened, padded parameters: every
    leaf of shape ``[N * c]`` is sharded over the data axes (``c`` elements per replica), and
    the others (such as Adam's step count) are replicated.
    """

    inner: optax.OptState


def wrap_optimizer(
    tx: optax.GradientTransformation,
    /,
    *,
    mesh: Mesh | None = None,
    zero_stage: int = 0,
    clip_global_norm: float | None = None,
    grad_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
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

    Returns:
      An ``optax.GradientTransformationExtraArgs``. With ``zero_stage >= 1`` its ``init`` must
      run outside ``step_fn`` (it returns global arrays sharded over the data axes) and its
      ``update`` inside, with the parameters.

    Raises:
      TypeError: if ``tx`` is not an optax transformation.
      ValueError: for an unknown ``zero_stage`` or a non-positive ``clip_global_norm``.

    >>> import jax.numpy as jnp, optax
    >>> tx = wrap_optimizer(optax.sgd(0.1))          # public as Replicator.wrap_optimizer
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"]
    Array([-0.1, -0.1], dtype=float32)
    """
    api = "wrap_optimizer"
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"{api}: tx must be an optax.GradientTransformation (e.g. optax.adam(1e-3)); "
            f"got {type(tx).__name__}."
        )
    if zero_stage not in ZERO_STAGES:
        raise ValueError(
            f"{api}: zero_stage={zero_stage!r} is not supported; use one of {ZERO_STAGES} "
            f"(0: replicated optimizer state, 1 and 2: state sharded over the replicas)."
        )
    if clip_global_norm is not None and not clip_global_norm > 0:
        raise ValueError(f"{api}: clip_global_norm must be > 0 or None; got {clip_global_norm!r}.")
    if grad_dtype is not None:
        grad_dtype = jnp.dtype(grad_dtype)
    inner = optax.with_extra_args_support(tx)
    if zero_stage == 0:

        def update(grads, state, params=None, **extra_args):
            grads = _mean_over_replicas(grads, grad_dtype)
            if clip_global_norm is not None:
                grads = _clip(grads, _global_norm(grads), clip_global_norm)
            return inner.update(grads, state, params, **extra_args)

        return optax.GradientTransformationExtraArgs(inner.init, update)
    if mesh is None:
        raise ValueError(f"{api}: zero_stage={zero_stage} needs the mesh; use repl.wrap_optimizer.")
    return _zero(inner, mesh, clip_global_norm, grad_dtype)


def _mean_over_replicas(grads: PyTree, dtype) -> PyTree:
    if dtype is None:
        return collectives.all_reduce(grads, "mean")
    sent = jax.tree.map(lambda g: g.astype(dtype), grads)
    return jax.tree.map(lambda s, g: s.astype(g.dtype), collectives.all_reduce(sent, "mean"), grads)


def _global_norm(grads: PyTree, axes=()) -> jax.Array:
    total = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
    total = jnp.asarray(total, jnp.float32)
    return jnp.sqrt(lax.psum(total, axes) if axes else total)


def _clip(grads: PyTree, norm: jax.Array, max_norm: float) -> PyTree:
    # The same arithmetic as optax.clip_by_global_norm.
    scale = jnp.where(norm < max_norm, 1.0, max_norm / jnp.maximum(norm, 1e-38))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)


# -- ZeRO: the optimizer state sharded over the replicas ----------------------------------------


def _chunk(size: int, n: int) -> int:
    return max(1, math.ceil(size / n))


def _flat_padded(x, n: int) -> jax.Array:
    flat = jnp.ravel(x)
    return jnp.pad(flat, (0, n * _chunk(flat.size, n) - flat.size))


def _zero(inner, mesh: Mesh, clip_global_norm, grad_dtype) -> optax.GradientTransformationExtraArgs:
    n = mesh_lib.num_replicas(mesh)
    shard = NamedSharding(mesh, mesh_lib.batch_spec(mesh))
    replicated = NamedSharding(mesh, PartitionSpec())

    def init(params):
        for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
            spec = getattr(getattr(p, "sharding", None), "spec", None)
            if spec is not None and any(a is not None for a in spec):
                raise ValueError(
                    f"wrap_optimizer(zero_stage>=1): parameter {jax.tree_util.keystr(path)} is "
                    f"sharded as {spec}; ZeRO here shards the optimizer state of replicated "
                    f"parameters. Pass replicated parameters (repl.replicate)."
                )
        flat = jax.tree.map(lambda p: _flat_padded(p, n), params)
        sizes = {int(f.shape[0]) for f in jax.tree.leaves(flat)}
        state = inner.init(flat)
        place = lambda s: jax.device_put(
            s, shard if np.ndim(s) == 1 and int(np.shape(s)[0]) in sizes else replicated
        )
        return ZeroState(jax.tree.map(place, state))

    def update(grads, state, params=None, **extra_args):
        binding = current_binding()
        if binding.num_replicas != n:
            raise ValueError(
                f"wrap_optimizer(zero_stage>=1): the state is sharded over {n} replicas, but this "
                f"step runs on {binding.num_replicas}; call update inside repl.run of the "
                f"replicator that made the optimizer."
            )
        me = collectives.replica_id()

        def scatter(g):
            flat = _flat_padded(g, n)
            sent = flat if grad_dtype is None else flat.astype(grad_dtype)
            if binding.is_local:
                out = sent
            else:
                out = lax.psum_scatter(sent, binding.axes, scatter_dimension=0, tiled=True)
            return (out / n).astype(g.dtype)

        def my_slice(p):
            flat = _flat_padded(p, n)
            c = flat.shape[0] // n
            return lax.dynamic_slice_in_dim(flat, me * c, c)

        g_shards = jax.tree.map(scatter, grads)
        if clip_global_norm is not None:
            norm = _global_norm(g_shards, () if binding.is_local else binding.axes)
            g_shards = _clip(g_shards, norm, clip_global_norm)
        p_shards = None if params is None else jax.tree.map(my_slice, params)
        u_shards, inner_state = inner.update(g_shards, state.inner, p_shards, **extra_args)

        def gather(u, g):
            full = u if binding.is_local else lax.all_gather(u, binding.axes, tiled=True)
            return full[: g.size].reshape(g.shape).astype(g.dtype)

        return jax.tree.map(gather, u_shards, grads), ZeroState(inner_state)

    return optax.GradientTransformationExtraArgs(init, update)
