"""ZeRO as the optimizer's two transformations: `scatter_mean` (local gradients -> this
replica's part of their mean) and `sharded_update` (any optax transformation on the parts),
both on a `zero.Zero` layout."""

from __future__ import annotations

from typing import Any

import optax

from replicator._src.core.sharded_params import has_sharded_params
from replicator._src.optim import zero_plan
from replicator._src.optim.stages import split_rows, zero_parts
from replicator._src.optim.stages import transform as stagewise
from replicator._src.optim.zero import Zero

_PLAIN_PARAMS = (
    "wrap_optimizer(zero_stage=3): init got plain parameters; store them sharded first: "
    "params = opt.shard_params(params), and call rp.gather_params in the forward pass."
)


def scatter_mean(zero: Zero, *, grad_dtype: Any = None) -> optax.GradientTransformationExtraArgs:
    """Local gradients -> this replica's part of their mean over the replicas (stateless).

    A gradient is reduce-scattered along its leaf's split axis (sent in ``grad_dtype`` if
    given, e.g. ``jnp.bfloat16``), the same bytes as half an all-reduce; that of a
    `ShardedParam` (ZeRO-3) was reduce-scattered by the autodiff of `gather_params` and is
    divided by N; a leaf with no split axis is all-reduced (`Zero.reduce`).

    Equivalent to (replica ``r``, ``dim`` each leaf's split axis)::

        updates = [split(mean over replicas of g, N, dim)[r] for g in grads]

    ``update(grads, state, params=None)``: ``params`` as ``step_fn`` received them give each
    leaf's split axis (and ``model`` split); without them it is chosen from the shapes.
    """

    zero.grad_dtype = grad_dtype  # for `Zero.across_tree` after an accumulation

    def update(grads, state, params=None, *, across=True, **extra_args):
        del extra_args
        if stagewise.only_packed(grads, f"zero_stage={zero.stage}"):
            return grads, state  # reduce-scattered leaf by leaf in the update (stage_zero)
        return zero.reduce(grads, params, grad_dtype, across=across), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def sharded_update(
    tx: optax.GradientTransformation, zero: Zero, *, grad_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    """``tx`` run on this replica's parts of the mean gradients, as on one device (`Zero.apply`).

    ``init(params)`` runs ``tx.init`` on the global parameters and places each state leaf in
    ZeRO's layout (global arrays: run it outside ``step_fn``); it warns if some of the update
    gathers (`Zero.plan`). With ZeRO-3 ``params`` must hold `ShardedParam` leaves.
    ``update(parts, state, params=None, *, local_grads=None, **extra_args)`` takes the parts
    of `scatter_mean` and returns whole updates (ZeRO-3: in the `ShardedParam` layout);
    ``local_grads``, the gradients as ``step_fn`` computed them, gives the one-device shapes
    when ``params`` is None. Other ``extra_args`` go to ``tx``.

    Returns:
      An optax transformation whose state is ``tx``'s, each leaf in its own shape, split over
      the data axes along its split axis (scalar leaves, such as Adam's count, replicated).

    Raises:
      ValueError: from ``init``, with ZeRO-3 and plain parameters.
    """
    inner = optax.with_extra_args_support(tx)

    def init(params):
        if zero.stage == 3:
            zero_parts.refuse_whole_rows(zero.stage, params)
        if stagewise.only_packed(params, f"zero_stage={zero.stage}"):
            whole = split_rows.whole_params(params)  # ZeRO-3's stored parts made whole
            return stagewise.init(inner, whole, zero.mesh, zero_n=zero.n)
        if zero.stage == 3 and not has_sharded_params(params):
            raise ValueError(_PLAIN_PARAMS)
        state, plan = zero.init(inner, params)
        zero_plan.warn_if_gathered(plan)
        return state

    def update(parts, state, params=None, *, local_grads=None, **extra_args):
        if isinstance(state, stagewise.StageState):
            return stagewise.update(
                inner, parts, state, params, extra_args, zero_n=zero.n, grad_dtype=grad_dtype
            )
        if zero.stage == 3:
            zero_parts.refuse_whole_rows(zero.stage, params if params is not None else parts)
        return zero.apply(inner, parts, state, params, extra_args, local_grads)

    return optax.GradientTransformationExtraArgs(init, update)
