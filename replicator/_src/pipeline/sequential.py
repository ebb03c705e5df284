"""Without a ``stage`` axis: every stage in order, on each micro-batch.

This is the single-device meaning of a pipeline call, and what runs under the local lowering,
on a mesh of data axes only, or outside any ``Replicator``: a scan over the micro-batches of a
scan over every layer, in logical order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src.pipeline.call import PipelineCall
from replicator._src.pipeline.layers import StageFn, as_layers, run_layers
from replicator._src.pipeline.ticks import LossFn, mean_loss
from replicator._src.typing import PyTree


def _flat(layers: PyTree) -> PyTree:
    """Layers ``[S, Lv, ...]`` as one stack ``[S * Lv, ...]``, in logical order."""
    return jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), layers)


def outputs(call: PipelineCall, stage_fn: StageFn) -> PyTree:
    """The last stage's output for every micro-batch, ``[M, b, ...]``.

    Equivalent to: ``[stage_S-1(... stage_0(x)) for x in xs]``.
    """
    layer_fn, layers, _ = as_layers(stage_fn, call.rows)
    return lax.map(lambda x: run_layers(layer_fn, _flat(layers), x), call.xs)


def value_and_grad(
    call: PipelineCall, stage_fn: StageFn, loss_fn: LossFn, head_params: PyTree, remat: bool
) -> tuple[jax.Array, tuple[PyTree, PyTree, PyTree]]:
    """The mean loss over the micro-batches and its gradients, remat per layer as in the pipeline.

    Equivalent to: ``mean(loss_fn(head, stage_S-1(... stage_0(x)), t) for x, t in zip(xs, ts))``
    and its gradients with respect to the stage params, the inputs and ``head_params``.
    """
    layer_fn, _, _ = as_layers(stage_fn, call.rows)
    fn = jax.checkpoint(layer_fn, prevent_cse=False) if remat else layer_fn
    m = call.num_microbatches

    def total(rows, xs, head):
        layers = _flat(as_layers(stage_fn, rows)[1])

        def one(acc, xt):
            x, t = xt
            return acc + mean_loss(loss_fn, head, run_layers(fn, layers, x), t, m), None

        return lax.scan(one, jnp.zeros((), jnp.float32), (xs, call.ts))[0]

    loss, (g_rows, g_xs, g_head) = jax.value_and_grad(total, argnums=(0, 1, 2))(
        call.rows, call.xs, head_params
    )
    return loss, (call.from_rows(g_rows), call.merge_batch(g_xs), g_head)
