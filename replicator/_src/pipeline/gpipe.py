"""GPipe and Circular: the forward ticks in one scan, the backward by ``jax.vjp`` of that scan.

Circular is GPipe with V virtual stages per device around a ring; both read the plan's
``fwd``/``fwd_repeat`` tables and share this scan. The backward replays the forward ticks in
reverse, so stages compute through the bubbles; with ``remat`` only each layer's input is kept
per iteration, never a copy of the parameters. ``apply`` runs the same forward ticks alone.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from replicator._src.core import tracing
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.typing import PyTree
from replicator._src.pipeline import whole_grads
from replicator._src.pipeline.call import PipelineCall
from replicator._src.pipeline.layer_stack import vjp_inexact
from replicator._src.pipeline.residuals import Remat, never_gathered
from replicator._src.pipeline.ticks import (
    LossFn,
    mean_loss,
    put,
    run_ticks,
    shift,
    take,
    where,
    zeros,
)

_PARAMS = "rp_pipeline_layer_params"


def value_and_grad(
    call: PipelineCall, loss_fn: LossFn, head_params: PyTree, remat: Remat
) -> tuple[jax.Array, PyTree, PyTree, PyTree]:
    """This stage's share of the loss, and its gradients: ``jax.vjp`` of `forward_ticks`.

    With ``scatter_grads="step"`` and ZeRO-3 rows, the rows are gathered once, before the
    ticks, and ``jax.vjp`` differentiates the gathered rows (in
    `whole_grads.accumulator_dtype`): the backward scan sums their gradients whole, and they
    are reduce-scattered once, after it.

    Returns:
      ``(loss, g_rows, g_xs, g_head)``: the loss and the gradients of the head and of the inputs
      ``[M, b, ...]`` are this stage's share (to be summed over ``stage``); ``g_rows`` are the
      gradients of this stage's rows. Integer inputs get zero gradients.
    """
    whole = call.scatter_grads == "step" and whole_grads.has_split(call.rows)
    rows = call.rows
    if whole:  # the stage's weights for the whole step, and the gradients of them
        gathered = whole_grads.gathered(call.rows)
        rows = whole_grads.widened(gathered)

    def local_loss(rows, xs, head):
        if whole:
            rows = whole_grads.narrowed(rows, gathered)
        return forward_ticks(call, loss_fn, head, rows, call.ts, xs, remat=remat)

    loss, vjp = vjp_inexact(local_loss, rows, call.xs, head_params)
    g_rows, g_xs, g_head = vjp(jnp.ones((), jnp.float32))
    if whole:
        g_rows = whole_grads.scatter(g_rows, call.rows)  # once a step
    return loss, g_rows, g_xs, g_head


def outputs(call: PipelineCall) -> PyTree:
    """The last stage's outputs ``[M, b, ...]`` of the forward ticks, zeros on other stages."""
    wires = forward_ticks(call, None, None, call.rows, None, call.xs, remat=None)
    return call.program(call.rows).leave(wires)


def forward_ticks(
    call: PipelineCall, loss_fn: LossFn | None, head_params: PyTree,
    rows: PyTree, ts: PyTree, xs: PyTree, *, remat: Remat | None,
) -> PyTree:  # fmt: skip
    """Runs the forward ticks of ``call.plan`` on this stage, one layer per scan iteration.

    Iteration ``u`` runs layer ``u % Lv`` of tick ``u // Lv``; the activation moves to the
    next stage after a tick's last layer. Equivalent to, on stage ``s``::

        for t in range(T):
            i, r = fwd[t, s], fwd_repeat[t, s]        # micro-batch and virtual stage, or -1
            x = enter(xs[i]) if s == 0 and r == 0 else recv
            for li in range(Lv):
                x = layer_fn(rows[r][li], shared[r], x, r*K + s, li)   # logical stage r*K + s
            if i >= 0 and s == K - 1 and r == V - 1:  # leaves the pipeline
                acc += loss_fn(head_params, leave(x), ts[i]) / M   # or: ys[i] = x
            recv = shift(x, +1)                       # around the ring when V > 1

    Returns:
      With ``loss_fn``: this stage's share of the mean loss (nonzero on the last stage). Without
      it: the last stage's activations ``[M, ...]`` (zeros elsewhere), before ``leave``.
    """
    plan = call.plan
    k, v, m = call.num_stages, plan.repeats, call.num_microbatches
    s = lax.axis_index(STAGE_AXIS)
    fwd, rep = jnp.asarray(plan.fwd), jnp.asarray(plan.fwd_repeat)
    prog = call.program(rows)
    layers, lv = prog.layers, prog.lv
    run_layer = _layer_on(prog.layer_fn, remat)
    x0 = zeros(prog.enter(take(xs, 0)))

    def iteration(carry, u):
        recv, h, acc = carry
        t, li = u // lv, u % lv
        i, r = fwd[t, s], rep[t, s]
        ic = jnp.maximum(i, 0)
        x = where(li == 0, where((s == 0) & (r == 0), prog.enter(take(xs, ic)), recv), h)
        h = run_layer(layers, prog.shared, r, li, x, r * k + s)
        last_layer = li == lv - 1
        done = last_layer & (i >= 0) & (s == k - 1) & (r == v - 1)  # leaves the pipeline
        if loss_fn is None:
            acc = where(done, put(acc, ic, h), acc)
        else:
            with tracing.runs(m, plan.num_ticks * lv):  # on the last stage, once per micro-batch
                acc = acc + lax.cond(
                    done,
                    lambda: mean_loss(loss_fn, head_params, prog.leave(h), take(ts, ic), m),
                    lambda: jnp.zeros((), jnp.float32),
                )
        with tracing.runs(1, lv):  # after the tick's last layer
            recv = lax.cond(last_layer, lambda: shift(h, k, 1, ring=v > 1), lambda: recv)
        return (recv, h, acc), None

    acc0 = jax.tree.map(lambda a: jnp.zeros((m, *a.shape), a.dtype), x0)
    init = (x0, x0, jnp.zeros((), jnp.float32) if loss_fn is not None else acc0)
    return run_ticks(iteration, init, plan.num_ticks * lv, call.unroll)[2]


def _layer_on(layer_fn: Callable, remat: Remat | None) -> Callable:
    """``g(layers, shared, r, li, x, j)``: ``layer_fn`` on layer ``li`` of row ``r`` (logical stage
    ``j``), for a differentiated scan (``remat=None``: not differentiated).

    What the scan keeps per iteration for the backward pass must never be a copy of the layer's
    parameters: they are sliced inside a checkpoint, so with ``"full"`` the residuals are the
    layer's input and indices, with ``"none"`` every intermediate activation but the parameters
    (and ZeRO-3's gathered ones), and with another policy what it saves, the parameters never.
    """

    def run(layers, shared, r, li, x, j):
        layer = jax.tree.map(lambda a: take(take(a, r), li), layers)
        own = checkpoint_name(take(shared, r), _PARAMS)
        return layer_fn(checkpoint_name(layer, _PARAMS), own, x, j, li)

    if remat is None:
        return run
    return jax.checkpoint(run, prevent_cse=False, policy=_never_params(never_gathered(remat)))


def _never_params(policy: Callable) -> Callable:
    """``policy``, except that the layer's parameters (named `_PARAMS`) are never saved."""

    def saves(prim, *args, **params):
        if prim.name == "name" and params.get("name") == _PARAMS:
            return False
        return policy(prim, *args, **params)

    return saves
