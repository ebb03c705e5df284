"""A stage as a stack of layers: `scan_layers`, and the engine's view of any ``stage_fn``.

A stage built with `scan_layers` exposes its layers, and the schedules step through them one
per iteration of their scan; any other ``stage_fn`` counts as one layer. The shape checks here
hold the activation to one structure, shape and dtype from layer to layer and from stage to
stage, which is what ``lax.scan`` needs to carry it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from replicator._src.typing import PyTree

StageFn = Callable[[PyTree, PyTree], PyTree]


def scan_layers(layer_fn: Callable[[PyTree, PyTree], PyTree], /) -> StageFn:
    """A ``stage_fn`` that applies ``layer_fn`` once per layer of its stage, as a ``lax.scan``.

    With stage parameters stacked as ``[layers_per_stage, ...]`` (what `stack_stages` gives each
    stage), compile time does not grow with the number of layers per stage. The pipeline engine
    also sees the layers: it steps through them one per iteration of its own scan, so that the
    compiled program is the same whatever the number of layers per stage, and 1F1B recomputes
    one layer at a time in the backward pass.

    Equivalent to: ``for p in stage_params: x = layer_fn(p, x)`` (``p``: one row of each leaf).

    Raises:
      ValueError: when the stage is called (or traced by the pipeline), if ``layer_fn`` returns
        an activation whose structure, shapes or dtypes differ from its input's, checked with
        ``jax.eval_shape`` on one layer before the scan.

    >>> import jax.numpy as jnp, replicator as rp
    >>> stage = rp.pipeline.scan_layers(lambda w, x: x @ w)
    >>> stage(jnp.stack([2 * jnp.eye(2)] * 3), jnp.ones((1, 2)))
    Array([[8., 8.]], dtype=float32)
    """
    return _ScanLayers(layer_fn)


_LAYER_CHANGES_SHAPE = (
    "rp.pipeline.scan_layers({name}): layer_fn maps an activation {want} to {got}. The layers "
    "of a stage run one after another in a lax.scan that carries the activation from layer to "
    "layer (and the pipeline passes it on from stage to stage), so every layer in a stack must "
    "map activations to the same shape and dtype. Put layers that change the width, such as an "
    "embedding or a head, outside the stages: the embedding on the inputs before the pipeline "
    "call, the head in loss_fn."
)


class _ScanLayers:
    """A stage made of layers of one structure; see `scan_layers`."""

    def __init__(self, layer_fn: Callable[[PyTree, PyTree], PyTree]) -> None:
        self.layer_fn = layer_fn

    def __call__(self, stage_params: PyTree, x: PyTree) -> PyTree:
        self.check_layer(stage_params, x)
        return run_layers(self.layer_fn, stage_params, x)

    def check_layer(self, stage_params: PyTree, x: PyTree) -> None:
        """Refuses a ``layer_fn`` whose output differs from its input in structure, shape or
        dtype, which ``lax.scan`` cannot carry; found with ``jax.eval_shape`` on one layer."""
        leaves = jax.tree.leaves(stage_params)
        if not leaves or any(not np.ndim(a) for a in leaves):
            return  # no layer axis to slice: lax.scan reports it
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stage_params)
        want = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)
        got = jax.eval_shape(self.layer_fn, layer, want)
        if not same_shapes(got, want):
            name = getattr(self.layer_fn, "__name__", repr(self.layer_fn))
            raise ValueError(_LAYER_CHANGES_SHAPE.format(
                name=name, want=describe(want), got=describe(got)
            ))  # fmt: skip

    def __repr__(self) -> str:
        return f"scan_layers({getattr(self.layer_fn, '__name__', self.layer_fn)!r})"


def run_layers(layer_fn: Callable, layers: PyTree, x: PyTree) -> PyTree:
    """Every layer in order, as one ``lax.scan`` over the leading axis of ``layers``.

    Equivalent to: ``for p in layers: x = layer_fn(p, x)`` (``p``: one row of each leaf).
    """
    return lax.scan(lambda h, p: (layer_fn(p, h), None), x, layers)[0]


def as_layers(stage_fn: StageFn, rows: PyTree) -> tuple[Callable, PyTree, int]:
    """The stage rows as layers ``[V, Lv, ...]``, the function of one layer, and Lv.

    A `scan_layers` stage exposes its layers; any other ``stage_fn`` is one layer of its own.
    """
    if isinstance(stage_fn, _ScanLayers):
        return stage_fn.layer_fn, rows, jax.tree.leaves(rows)[0].shape[1]
    return stage_fn, jax.tree.map(lambda a: a[:, None], rows), 1


def layers_as_rows(stage_fn: StageFn, layers: PyTree) -> PyTree:
    """The inverse of `as_layers`: layers ``[V, Lv, ...]`` (or their gradients) as stage rows."""
    if isinstance(stage_fn, _ScanLayers):
        return layers
    return jax.tree.map(lambda a: a[:, 0], layers)


def same_shapes(got: PyTree, want: PyTree) -> bool:
    """Whether two trees of shaped values have one structure, and equal shapes and dtypes."""
    return jax.tree.structure(got) == jax.tree.structure(want) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def describe(tree: PyTree) -> str:
    """The dtypes and shapes of a tree, as in ``{'x': 'float32[2, 8]'}``, for error messages."""
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree))
