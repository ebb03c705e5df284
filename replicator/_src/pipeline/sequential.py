"""Without a ``stage`` axis: every stage in order, on each micro-batch.

This is the single-device meaning of a pipeline call, and what runs under the local lowering,
on a mesh of data axes only, or outside any ``Replicator``: a scan over the micro-batches of a
scan over every layer, in logical order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src.core.typing import PyTree
from replicator._src.pipeline.call import PipelineCall
from replicator._src.pipeline.layer_stack import Program, vjp_inexact
from replicator._src.pipeline.residuals import Remat
from replicator._src.pipeline.ticks import LossFn, mean_loss, take


def _run(prog: Program, layer_fn, x: PyTree) -> PyTree:
    """Every layer of every stage in logical order on one micro-batch, as one ``lax.scan``.

    Equivalent to: ``for j in range(S): for li in range(Lv): x = layer_fn(layers[j, li],
    shared[j], x, j, li)``.
    """
    flat = jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1], *a.shape[2:])), prog.layers)
    n = jax.tree.leaves(flat)[0].shape[0]
    u = jnp.arange(n, dtype=jnp.int32)
    stage, li = u // prog.lv, u % prog.lv

    def one(h, pj):
        p, j, i = pj
        return layer_fn(p, take(prog.shared, j), h, j, i), None

    return lax.scan(one, x, (flat, stage, li))[0]


def outputs(call: PipelineCall) -> PyTree:
    """The last stage's output for every micro-batch, ``[M, b, ...]``.

    Equivalent to: ``[stage_S-1(... stage_0(x)) for x in xs]``.
    """
    prog = call.program(call.rows)
    return lax.map(lambda x: prog.leave(_run(prog, prog.layer_fn, prog.enter(x))), call.xs)


def value_and_grad(
    call: PipelineCall, loss_fn: LossFn, head_params: PyTree, remat: Remat
) -> tuple[jax.Array, tuple[PyTree, PyTree, PyTree]]:
    """The mean loss over the micro-batches and its gradients, remat per layer as in the pipeline.

    Equivalent to: ``mean(loss_fn(head, stage_S-1(... stage_0(x)), t) for x, t in zip(xs, ts))``
    and its gradients with respect to the stage params, the inputs (zeros for integer inputs)
    and ``head_params``.
    """
    m = call.num_microbatches

    def total(rows, xs, head):
        prog = call.program(rows)
        fn = remat.wrap(prog.layer_fn)

        def one(acc, xt):
            x, t = xt
            y = prog.leave(_run(prog, fn, prog.enter(x)))
            return acc + mean_loss(loss_fn, head, y, t, m), None

        return lax.scan(one, jnp.zeros((), jnp.float32), (xs, call.ts))[0]

    loss, vjp = vjp_inexact(total, call.rows, call.xs, head_params)
    g_rows, g_xs, g_head = vjp(jnp.ones((), jnp.float32))
    return loss, (call.from_rows(g_rows), call.merge_batch(g_xs), g_head)
