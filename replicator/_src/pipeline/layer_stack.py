"""A stage as a stack of layers: `scan_layers`, and the engine's view of any ``stage_fn``.

A stage built with `scan_layers` exposes its layers, and the schedules step through them one
per iteration of their scan; any other ``stage_fn`` counts as one layer. The shape checks here
hold the activation to one structure, shape and dtype from layer to layer and from stage to
stage, which is what ``lax.scan`` needs to carry it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from replicator._src.core.typing import PyTree

StageFn = Callable[[PyTree, PyTree], PyTree]


def scan_layers(layer_fn: Callable[[PyTree, PyTree], PyTree], /) -> StageFn:
    """A ``stage_fn`` that applies ``layer_fn`` once per layer of its stage, as a ``lax.scan``.

    With stage parameters stacked as ``[layers_per_stage, ...]`` (what `stack_stages` gives each
    stage), compile time does not grow with the number of layers per stage. The pipeline engine
    also sees the layers: it steps through them one per iteration of its own scan, so that the
    compiled program is the same whatever the number of layers per stage, and 1F1B recomputes
    one layer at a time in the backward pass.

    Equivalent to: ``for p in stage_params: x = layer_fn(p, x)`` (``p``: one row of each leaf).

    Args:
      layer_fn: ``layer_fn(layer_params, x) -> x``, one layer; the activation keeps its
        structure, shapes and dtypes.

    Returns:
      ``stage_fn(stage_params, x) -> x``, for `value_and_grad` or `apply`.

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


def _identity(x: PyTree) -> PyTree:
    return x


@dataclasses.dataclass(frozen=True)
class Program:
    """What a schedule runs on each stage: layers, and how the inputs enter and the output leaves.

    Attributes:
      layer_fn: ``layer_fn(layer_params, shared, x, j, li) -> x``: layer ``li`` of logical stage
        ``j`` (int32 scalars, possibly traced) on one micro-batch's activation ``x``, with that
        layer's parameters and the stage's shared parameters.
      layers: the stage rows as layers ``[V, Lv, ...]``.
      lv: Lv, layers per stage.
      shared: parameters that any layer of a stage may read, ``[V, ...]``; their gradient is the
        sum over the stage's layers (``{}`` for stacks of identical stages).
      enter: one micro-batch of the inputs as the activation stage 0 receives.
      leave: the last stage's activation as the model's output (what ``loss_fn`` receives).
      enter_t: the transpose of ``enter``: an activation's cotangent as the inputs' cotangent.
    """

    layer_fn: Callable[[PyTree, PyTree, PyTree, jax.Array, jax.Array], PyTree]
    layers: PyTree
    lv: int
    shared: PyTree = dataclasses.field(default_factory=dict)
    enter: Callable[[PyTree], PyTree] = _identity
    leave: Callable[[PyTree], PyTree] = _identity
    enter_t: Callable[[PyTree], PyTree] = _identity


def as_layers(stage_fn: StageFn, rows: PyTree) -> Program:
    """The `Program` of identical stages: rows ``[V, ...]`` as layers ``[V, Lv, ...]``.

    A `scan_layers` stage exposes its layers; any other ``stage_fn`` is one layer of its own.
    """
    if isinstance(stage_fn, _ScanLayers):
        fn = stage_fn.layer_fn
        lv = jax.tree.leaves(rows)[0].shape[1]
        return Program(lambda p, _s, x, _j, _li: fn(p, x), rows, lv)
    layers = jax.tree.map(lambda a: a[:, None], rows)
    return Program(lambda p, _s, x, _j, _li: stage_fn(p, x), layers, 1)


def layers_as_rows(stage_fn: StageFn, layers: PyTree) -> PyTree:
    """The inverse of `as_layers`: layers ``[V, Lv, ...]`` (or their gradients) as stage rows."""
    if isinstance(stage_fn, _ScanLayers):
        return layers
    return jax.tree.map(lambda a: a[:, 0], layers)


def vjp_inexact(fn: Callable, *primals: PyTree) -> tuple[PyTree, Callable]:
    """``jax.vjp`` that differentiates only the floating leaves of ``primals`` and outputs.

    Integer leaves (token ids, masks, a stage index) are held constant: ``vjp_fn(cot)`` ignores
    the cotangent's integer leaves and returns zeros of their own dtype for the primals' integer
    leaves, so every result has the structure and dtypes of what it stands for.
    """
    flat, treedef = jax.tree.flatten(primals)
    diff = [_inexact(a) for a in flat]

    def f(*dl):
        it = iter(dl)
        full = [next(it) if d else a for a, d in zip(flat, diff, strict=True)]
        out = fn(*jax.tree.unflatten(treedef, full))
        leaves = jax.tree.leaves(out)
        return [a for a in leaves if _inexact(a)], out

    kept, vjp, out = jax.vjp(f, *(a for a, d in zip(flat, diff, strict=True) if d), has_aux=True)

    def vjp_fn(cot):
        grads = iter(vjp([a for a in jax.tree.leaves(cot) if _inexact(a)]))
        full = [next(grads) if d else jnp.zeros(jnp.shape(a), jnp.result_type(a))
                for a, d in zip(flat, diff, strict=True)]  # fmt: skip
        return jax.tree.unflatten(treedef, full)

    del kept
    return out, vjp_fn


def _inexact(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def same_shapes(got: PyTree, want: PyTree) -> bool:
    """Whether two trees of shaped values have one structure, and equal shapes and dtypes."""
    return jax.tree.structure(got) == jax.tree.structure(want) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def describe(tree: PyTree) -> str:
    """The dtypes and shapes of a tree, as in ``{'x': 'float32[2, 8]'}``, for error messages."""
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree))
