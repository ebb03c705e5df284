"""`wrap_optimizer`'s checks of its arguments: each refuses what the optimizer cannot take
with a ``ValueError`` (``TypeError`` for a wrong type) naming the argument and the fix."""

from __future__ import annotations

from typing import Any

import optax
from jax.sharding import Mesh

from replicator._src.core import errors
from replicator._src.core import mesh as mesh_lib
from replicator._src.core.mesh import STAGE_AXIS

ZERO_STAGES = (0, 1, 2, 3)


def zero_axes(zero_axes: Any, zero_stage: int, mesh: Mesh | None) -> None:
    """Refuses ``zero_axes`` that do not name a proper part of the mesh's replica axes, or
    that come without ZeRO, or with a pipeline."""
    if zero_axes is None:
        return
    api = f"wrap_optimizer(zero_axes={zero_axes!r})"
    if isinstance(zero_axes, str) or not all(isinstance(a, str) for a in zero_axes):
        raise TypeError(f"{api}: zero_axes must be a tuple of mesh axis names, e.g. ('data',).")
    if not zero_stage:
        raise ValueError(f"{api}: zero_axes says where ZeRO splits; give zero_stage=1, 2 or 3.")
    if mesh is None:
        raise ValueError(f"{api}: call repl.wrap_optimizer, which knows the mesh.")
    replicas = mesh_lib.replica_axes(mesh)
    if not zero_axes or not set(zero_axes) < set(replicas):
        raise ValueError(
            f"{api}: zero_axes must be some, not all, of the mesh's replica axes {replicas} "
            f"(e.g. ('data',) on {{'dcn_data': S, 'data': N}}: split inside each slice, whole "
            f"on every one); None splits over all of them."
        )
    if dict(mesh.shape).get(STAGE_AXIS, 1) > 1:
        raise ValueError(
            f"{api}: hybrid ZeRO with a pipeline ('{STAGE_AXIS}' axis) is not built; drop "
            f"zero_axes (ZeRO then splits over every replica axis)."
        )


def options(
    tx: Any,
    zero_stage: Any,
    clip_global_norm: Any,
    accumulate_steps: Any,
    loss_scale: Any,
    loss_scale_period: Any,
) -> None:
    """Refuses, with `wrap_optimizer`'s errors, a ``tx`` or option values it does not take."""
    api = "wrap_optimizer"
    if not isinstance(tx, optax.GradientTransformation):
        hint = (
            f" ({type(tx).__name__} has one: tx.gradient_transformation())"
            if hasattr(tx, "gradient_transformation")
            else ""
        )
        raise TypeError(
            f"{api}: tx must be an optax.GradientTransformation (e.g. optax.adam(1e-3)); "
            f"got {type(tx).__name__}{hint}."
        )
    if zero_stage not in ZERO_STAGES:
        raise ValueError(
            f"{api}: zero_stage={zero_stage!r} is not supported; use one of {ZERO_STAGES} "
            f"(0: replicated optimizer state, 1 and 2: state sharded over the replicas, 3: "
            f"parameters sharded too)."
        )
    if clip_global_norm is not None and not clip_global_norm > 0:
        raise ValueError(f"{api}: clip_global_norm must be > 0 or None; got {clip_global_norm!r}.")
    errors.positive_int(accumulate_steps, api=api, name="accumulate_steps")
    if not (
        loss_scale is None
        or loss_scale == "dynamic"
        or (isinstance(loss_scale, int | float) and loss_scale > 0)
    ):
        raise ValueError(
            f"{api}: loss_scale must be None, a positive number or 'dynamic'; got {loss_scale!r}."
        )
    errors.positive_int(loss_scale_period, api=api, name="loss_scale_period")


def zero_needs(zero_stage: int, mesh: Mesh | None, grad_dtype: Any, zero_axes: Any = None) -> None:
    """Refuses, with `wrap_optimizer`'s errors, ZeRO without what it needs. (With hybrid
    ZeRO-3, ``grad_dtype`` is the dtype of the parts' mean across the slices.)"""
    api = "wrap_optimizer"
    if zero_stage == 3 and grad_dtype is not None and zero_axes is None:
        raise ValueError(
            f"{api}: grad_dtype is not supported with zero_stage=3 (its gradients are reduced "
            f"by autodiff's reduce-scatter); cast the parameters before gather_params instead."
        )
    if zero_stage and mesh is None:
        raise ValueError(f"{api}: zero_stage={zero_stage} needs the mesh; use repl.wrap_optimizer.")
