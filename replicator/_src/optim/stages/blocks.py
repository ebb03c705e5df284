"""A pipeline's stage blocks updated without ZeRO, as parts of their whole leaves.

A stage block (``[K, ...]`` over ``stage``) is one leaf on one device, split over the stage
devices on a mesh with a ``stage`` axis: a transformation that looks at a leaf as a whole (LAMB's
trust ratio, a global norm, Adafactor's factored statistics) must see the whole leaf. Without
ZeRO the update runs on the blocks with ZeRO's evaluator (`zero.Zero` with no split over the
replicas), completing such reductions over ``stage``; element-wise work stays on each device's
block.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh

from replicator._src.core.binding import current_binding
from replicator._src.optim import sharded_eval
from replicator._src.optim.stages import program as stage_program
from replicator._src.optim.zero import _NEEDS_PARAMS, Zero


def on_stage_blocks(
    tx: optax.GradientTransformation, mesh: Mesh, placed: optax.GradientTransformationExtraArgs
) -> optax.GradientTransformationExtraArgs:
    """``tx`` without ZeRO on a mesh with a ``stage`` axis, as on one device.

    A pipeline's stage block (``[K, ...]`` over ``stage``) is one leaf on one device, split
    over the stage devices here: a transformation that looks at a leaf as a whole (LAMB's
    trust ratio, a global norm) must see the whole leaf. The update runs on the blocks with
    ZeRO's evaluator, completing such reductions over ``stage`` (`Zero` with no data split);
    element-wise work stays on each device's block. ``placed`` (``tx`` placing its state on
    the mesh) makes the state, each leaf placed as before (a moment like its parameter, a
    scalar replicated), and serves updates without the parameters when ``tx`` is element-wise;
    the update reads each state leaf's split from its placement.
    """
    inner = optax.with_extra_args_support(tx)
    blocks = Zero(mesh, stage=0)

    def init(params):
        return placed.init(params)

    def update(grads, state, params=None, **extra_args):
        if not current_binding().model_axes():
            return placed.update(grads, state, params, **extra_args)
        if params is None:
            _element_wise_or_refuse(inner, grads, state, extra_args)
            return placed.update(grads, state, params, **extra_args)
        return blocks.apply(inner, grads, state, params, extra_args, grads)

    return optax.GradientTransformationExtraArgs(init, update)


_KEEPS_SPLITS = sharded_eval.ELEMENTWISE | {"broadcast_in_dim", "copy_p", "stop_gradient"}


def _element_wise_or_refuse(inner, grads, state, extra_args) -> None:
    """Refuses an update without the parameters on a mesh with a ``stage`` axis unless the
    transformation acts element by element: only then is a stage block's update the block of
    the whole leaf's."""
    closed = jax.make_jaxpr(lambda g, s: inner.update(g, s, None, **extra_args))(grads, state)
    nodes: list = []
    stage_program.inline(closed.jaxpr, closed.consts, list(closed.jaxpr.invars), nodes)
    other = sorted({n.eqn.primitive.name for n in nodes} - _KEEPS_SPLITS)
    if other:
        raise ValueError(
            _NEEDS_PARAMS.format(stage=0)
            + f"\n(the transformation is not element-wise: it uses {', '.join(other[:4])}, "
            f"which must see each stage block as part of its whole leaf)"
        )
