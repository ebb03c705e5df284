"""Local SGD / DiLoCo: each worker takes H steps alone, then the workers average their moves.

Across slices the data-centre network (DCN) carries a small fraction of the inter-chip
bandwidth, and synchronous data parallelism sends every step's gradients over it. DiLoCo
(Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language Models")
sends one exchange every H steps instead:

* a *worker* is an index of the ``dcn_data`` axis (a slice, or a part of one);
* in each of H *inner steps* a worker reduces its gradients over its own replicas only (the
  other data axes, inside the slice) and takes a step of the inner optimizer, whose state is
  its own;
* then the workers average their parameter deltas ``start - params`` over ``dcn_data`` (the one
  crossing of the DCN), and the *outer* optimizer (Nesterov momentum by default, as the paper)
  takes that mean delta as a gradient from ``start``.

`LocalSGD.step` runs the H inner steps and the outer step in one compiled program, so the
parameters are the same on every replica between steps, as everywhere else in replicator: a
checkpoint, a metric or a ``check_replicas`` test sees one model. Each worker's inner state
is kept with a leading axis of the ``dcn_data`` size, split over it.

With H = 1, an ``optax.sgd(1.0)`` outer step and an inner optimizer linear in the gradients
(SGD, with or without momentum), a step equals the synchronous step
(`tests/test_local_sgd.py`).

>>> import jax, optax, replicator as rp
>>> repl = rp.Replicator(mesh_shape={"dcn_data": 2, "data": -1})
>>> opt = repl.wrap_optimizer(optax.sgd(0.1), local_steps=8)
>>> type(opt).__name__, opt.local_steps, opt.workers
('LocalSGD', 8, 2)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import binding as binding_lib
from replicator._src.core import collectives, placement
from replicator._src.core.mesh import DCN_AXIS
from replicator._src.core.typing import PyTree
from replicator._src.optim import accumulation


def default_outer() -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum 0.9 and a learning rate of 0.7."""
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


class LocalSGDState(NamedTuple):
    """A `LocalSGD` optimizer's state.

    Attributes:
      inner: each worker's inner optimizer state; on a mesh with ``dcn_data``, every leaf has
        a leading axis of its size, split over it (worker ``w`` holds row ``w``).
      outer: the outer optimizer's state, the same on every replica.
    """

    inner: optax.OptState
    outer: optax.OptState


class LocalSGD(optax.GradientTransformationExtraArgs):
    """`DistributedOptimizer` ``inner`` run ``local_steps`` times by each worker, then ``outer``.

    Made by ``repl.wrap_optimizer(tx, local_steps=H)``; use `step` inside ``step_fn``. Its
    ``init`` runs outside ``step_fn``, as ZeRO's, since it places each worker's state.
    """

    inner: Any  # the DistributedOptimizer of each inner step
    outer: optax.GradientTransformation
    local_steps: int
    mesh: Mesh | None

    def __new__(cls, inner, outer, local_steps: int, mesh: Mesh | None) -> LocalSGD:
        def init(params):
            return self.init(params)

        def update(grads, state, params=None, **extra_args):
            return self.update(grads, state, params, **extra_args)

        self = super().__new__(cls, init, update)
        self.inner, self.outer, self.local_steps, self.mesh = inner, outer, local_steps, mesh
        return self

    def __getnewargs__(self):
        return (self.inner, self.outer, self.local_steps, self.mesh)

    @property
    def workers(self) -> int:
        """The number of workers: the size of ``dcn_data`` (1 without a mesh)."""
        return 1 if self.mesh is None else int(dict(self.mesh.shape).get(DCN_AXIS, 1))

    def init(self, params: PyTree) -> LocalSGDState:
        """The state for ``params`` (placed on the mesh): every worker's inner state starts
        as ``inner.init(params)``; call it outside ``step_fn``."""
        inner = self.inner.init(params)
        outer = self.outer.init(params)
        if self.workers > 1:
            inner = jax.tree.map(self._per_worker, inner)
        return LocalSGDState(inner, outer)

    def _per_worker(self, x):
        x = jnp.asarray(x) if not isinstance(x, jax.Array | jax.core.Tracer) else x
        sharding = placement.sharding_of(x)  # (a traced leaf: the one `put` recorded)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        used = {a for entry in spec if entry is not None
                for a in (entry if isinstance(entry, tuple) else (entry,))}  # fmt: skip
        if used & {DCN_AXIS, "data"}:
            raise ValueError(
                f"wrap_optimizer(local_steps={self.local_steps}): an inner state leaf is split "
                f"over the data axes ({spec}); each worker keeps its whole inner state. Use "
                f"zero_stage=0."
            )
        target = NamedSharding(self.mesh, PartitionSpec(DCN_AXIS, *spec))
        stack = lambda a: jnp.broadcast_to(a[None], (self.workers, *a.shape))
        return placement.put(jax.jit(stack, out_shardings=target)(x), target)  # (abstract)

    def update(self, grads, state, params=None, **extra_args):
        raise ValueError(
            f"wrap_optimizer(local_steps={self.local_steps}): update() takes one step of "
            f"gradients, but a local-SGD step is {self.local_steps} inner steps and an outer "
            f"one; call opt.step(loss_fn, params, opt_state, batch) inside step_fn instead "
            f"(it splits the batch into the {self.local_steps} inner steps' batches)."
        )

    def step(self, loss_fn, params: PyTree, state: LocalSGDState, batch: PyTree):
        """One outer step: ``local_steps`` inner steps on ``batch``, then the outer update.

        Equivalent to (one replica's view; ``H = local_steps``; worker = its ``dcn_data``
        index)::

            start = params
            for b in split(batch, H):   # the gradients reduced over this worker's replicas
                params, inner_state, _ = inner.step(loss_fn, params, inner_state, b)
            delta = mean over the workers of (start - params)   # the one DCN exchange
            updates, outer_state = outer.update(delta, outer_state, start)
            params = start + updates

        Args:
          loss_fn, params: as `DistributedOptimizer.step`.
          state: this optimizer's `LocalSGDState`.
          batch: this replica's batch of all ``H`` inner steps; its leading axis must divide
            by ``H`` (times the inner optimizer's ``accumulate_steps``).

        Returns:
          ``(params, state, metrics)``: ``metrics`` as the inner step's (``loss``,
          ``grad_norm``), each the mean over the inner steps and the workers.
        """
        H = self.local_steps
        b = binding_lib.current_binding()
        workers = 1 if b.is_local else b.axis_size(DCN_AXIS)
        if not b.is_local and DCN_AXIS not in b.axes:
            raise ValueError(
                f"wrap_optimizer(local_steps={H}): the workers are the indices of a "
                f"'{DCN_AXIS}' axis, and this program's replica axes are {b.axes}; build the "
                f"Replicator with one, e.g. Replicator(mesh_shape={{'{DCN_AXIS}': 2, "
                f"'data': -1}}); in a config, mesh.dcn_data (or --slices N with a TPU target)."
            )
        if workers != self.workers and not b.is_local:
            raise ValueError(
                f"wrap_optimizer(local_steps={H}): the optimizer was made for "
                f"{self.workers} workers ('{DCN_AXIS}' of its mesh) and runs on {workers}; "
                f"wrap it with the Replicator that runs the step."
            )
        inner_axes = tuple(a for a in b.axes if a != DCN_AXIS)
        inside = binding_lib.narrowed(b, inner_axes)  # the workers' steps: dcn_data unmapped
        stacked = self.workers > 1 and not b.is_local
        inner_state = jax.tree.map(lambda a: a[0], state.inner) if stacked else state.inner
        parts = accumulation.split_batch(
            batch,
            H,
            api="LocalSGD.step",
            parts="local_steps={k} inner batches (a step is all of them)",
        )

        def one(carry, part):
            p, s = carry
            with binding_lib.bind(inside):
                p, s, metrics = self.inner.step(loss_fn, p, s, part)
            return (p, s), metrics

        kept, start = params, placement.to_device(params)
        (params, inner_state), metrics = lax.scan(one, (params, inner_state), parts)
        moved = jax.tree.map(lambda s, p: s - p, start, placement.to_device(params))
        if workers > 1:  # the only exchange over the DCN
            n = max(1, b.num_replicas // workers)
            moved = jax.tree.map(lambda x: _mean_over_workers(x, inner_axes, n), moved)
        updates, outer = self.outer.update(moved, state.outer, start)
        new = placement.like_spaces(optax.apply_updates(start, updates), kept)
        metrics = jax.tree.map(lambda m: jnp.mean(m.astype(jnp.float32), axis=0), metrics)
        if workers > 1:
            metrics = collectives.mean_over_axes(metrics, (DCN_AXIS,))
        if stacked:
            inner_state = jax.tree.map(lambda a: a[None], inner_state)
        return new, LocalSGDState(inner_state, outer), metrics


def _mean_over_workers(x: jax.Array, inner: tuple, n: int) -> jax.Array:
    """The mean of ``x`` over ``dcn_data``, hierarchically: ``x`` is the same on a worker's
    ``n`` replicas (over the ``inner`` axes), so each averages its ``1 / n`` part across the
    workers and the parts are gathered inside the worker. A chip sends ``2 (S-1)/S x bytes / n``
    across (a synchronous step's all-reduce sends as much, every step), not the whole of it."""
    if n == 1 or x.size < n:
        return collectives.mean_over_axes(x, (DCN_AXIS,))
    flat = x.reshape(-1)
    per = -(-flat.size // n)
    flat = jnp.pad(flat, (0, per * n - flat.size))
    part = lax.dynamic_slice_in_dim(flat, lax.axis_index(inner) * per, per)
    whole = collectives.gather_over_axes(collectives.mean_over_axes(part, (DCN_AXIS,)), inner, 0)
    return whole[: x.size].reshape(x.shape)


def check_options(local_steps, outer, zero_stage, loss_scale) -> None:
    """Refuses, with `wrap_optimizer`'s errors, local-SGD options it does not take."""
    api = f"wrap_optimizer(local_steps={local_steps!r})"
    if not (isinstance(local_steps, int | np.integer) and not isinstance(local_steps, bool)
            and local_steps >= 1):  # fmt: skip
        raise ValueError(f"{api}: local_steps must be an int >= 1 (inner steps a step), or None.")
    if outer is not None and not isinstance(outer, optax.GradientTransformation):
        raise TypeError(
            f"{api}: outer_optimizer must be an optax.GradientTransformation (e.g. "
            f"optax.sgd(0.7, momentum=0.9, nesterov=True)); got {type(outer).__name__}."
        )
    if zero_stage:
        raise ValueError(
            f"{api}: zero_stage={zero_stage} shards the state over the data axes, across the "
            f"workers, while each worker must keep its own; use zero_stage=0."
        )
    if loss_scale == "dynamic":
        raise ValueError(
            f"{api}: loss_scale='dynamic' would skip steps on some workers and not others; use "
            f"a static loss_scale or none."
        )
