"""1F1B: forward and backward interleaved in one scan, with a stash bounded by 2K-1 micro-batches.

A tick is Lv forward iterations, then Lv backward iterations in reverse layer order, each under
``lax.cond`` so that idle halves cost nothing. The forward keeps each layer's residuals as the
remat policy says (`residuals.SavedLayer`): with ``"none"`` everything the backward pass needs,
so nothing is recomputed (Megatron-LM's 1F1B); with ``"full"`` the layer's input, from which the
backward recomputes the layer; with ``"dots"`` the products' outputs. The stash is a ring of
``2K-1`` micro-batches' residuals, whatever the number of micro-batches. Two stage transfers per
tick: activations to ``s+1``, cotangents to ``s-1``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src.core import tracing
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.typing import PyTree
from replicator._src.pipeline import whole_grads
from replicator._src.pipeline.call import PipelineCall
from replicator._src.pipeline.layer_stack import vjp_inexact
from replicator._src.pipeline.residuals import Remat, SavedLayer
from replicator._src.pipeline.ticks import (
    LossFn,
    add,
    add_entry,
    entry,
    mean_loss,
    put,
    put_entry,
    run_ticks,
    shift,
    take,
    where,
    zeros,
)


class _Carry(NamedTuple):
    """What the scan carries on one stage; activations are one micro-batch's, ``[b, ...]``."""

    act: PyTree  # the activation received from stage s-1 at the end of the last tick
    cot: PyTree  # the cotangent received from stage s+1 at the end of the last tick
    h: PyTree  # the forward's activation after the layer just run
    g: PyTree  # the backward's cotangent after the layer just run
    dy: PyTree  # the loss's cotangent of the last stage's latest output
    stash: list  # layer residuals [2K-1, Lv, ...], written only when a forward runs
    g_params: PyTree  # this stage's layer gradients [Lv, ...], accumulated
    g_shared: PyTree  # the gradient of the stage's shared parameters, accumulated
    g_head: PyTree  # the head's gradient, accumulated (nonzero on the last stage)
    g_xs: PyTree  # input gradients [M + 1, b, ...]; row M is a spare (nonzero on stage 0)
    loss: jax.Array  # float32 scalar: this stage's share of the mean loss


def _start(
    x0: PyTree, params: PyTree, shared: PyTree, head_params: PyTree, xs: PyTree, slots: int,
    residuals: list, whole: bool,
) -> _Carry:  # fmt: skip
    """The carry before the first tick: all zeros, with the spare ``g_xs`` row; with
    ``whole``, the layers' gradients whole (`whole_grads.zeros`)."""
    lv = jax.tree.leaves(params)[0].shape[0]
    stash = [jnp.zeros((slots, lv, *r.shape), r.dtype) for r in residuals]
    spare = jax.tree.map(lambda a: jnp.zeros((a.shape[0] + 1, *a.shape[1:]), a.dtype), xs)
    g_params = whole_grads.zeros(params) if whole else zeros(params)
    return _Carry(
        x0, x0, x0, x0, x0, stash, g_params, zeros(shared), zeros(head_params), spare,
        jnp.zeros((), jnp.float32),
    )  # fmt: skip


def value_and_grad(
    call: PipelineCall, loss_fn: LossFn, head_params: PyTree, remat: Remat
) -> tuple[jax.Array, PyTree, PyTree, PyTree]:
    """1F1B with one layer per scan iteration, on this stage.

    A tick is Lv forward iterations (under ``lax.cond``, idle when the tick has no forward),
    then Lv backward iterations in reverse layer order, each from the residuals its forward
    stashed. Equivalent to, on stage ``s``::

        for t in range(T):                             # T = M + 2K - 2
            if (i := fwd[t, s]) >= 0:                  # forward of micro-batch i
                x = enter(xs[i]) if s == 0 else act
                y, stash[i % (2K-1)] = forward(params, x)   # residuals, per the policy
                if s == K - 1: loss += loss_fn(head, leave(y), ts[i]) / M;  dy = d loss / d y
            if (j := bwd[t, s]) >= 0:                  # backward of micro-batch j
                dp, g = backward(params, stash[j % (2K-1)], dy if s == K-1 else cot)
                g_params += dp
                if s == 0: g_xs[j] = enter_t(g)
            act, cot = shift(y, +1), shift(g, -1)

    With ``scatter_grads="step"`` and ZeRO-3 layers, ``params[l]`` is the layer gathered
    (`whole_grads.gathered`) in both halves, ``g_params`` is whole, and it is reduce-scattered
    once, after the last tick.

    Returns:
      ``(loss, g_rows, g_xs, g_head)``, as `gpipe.value_and_grad` returns them.
    """
    k, m, plan = call.num_stages, call.num_microbatches, call.plan
    slots = plan.stash_slots
    s = lax.axis_index(STAGE_AXIS)
    fwd, bwd = jnp.asarray(plan.fwd), jnp.asarray(plan.bwd)
    prog = call.program(call.rows)
    layer_fn, lv = prog.layer_fn, prog.lv
    params = take(prog.layers, 0)  # this stage's layers, [Lv, ...]
    shared = take(prog.shared, 0)
    is_first, is_last = s == 0, s == k - 1
    x0 = zeros(prog.enter(take(call.xs, 0)))
    whole = call.scatter_grads == "step" and whole_grads.has_split(params)
    # scatter_grads="step": each layer gathered where it runs, its gradient whole
    layer = lambda li: whole_grads.gathered(take(params, li)) if whole else take(params, li)
    one = whole_grads.abstract(take(params, 0)) if whole else take(params, 0)
    saved = SavedLayer(layer_fn, remat, one, shared, x0, s, jnp.int32(0))

    def grad_loss(head, y, t):
        loss, vjp = vjp_inexact(lambda hp, w: mean_loss(loss_fn, hp, prog.leave(w), t, m), head, y)
        return loss, vjp(jnp.ones((), jnp.float32))

    def iteration(c: _Carry, u):
        t, q = u // (2 * lv), u % (2 * lv)
        # Forward phase (q < Lv): layer q of micro-batch i, stashing the layer's input.
        i = fwd[t, s]
        ic, lf = jnp.maximum(i, 0), jnp.minimum(q, lv - 1)
        f_on = (i >= 0) & (q < lv)
        x = where(q == 0, where(is_first, prog.enter(take(call.xs, ic)), c.act), c.h)
        # Each stage is busy in M of the T ticks' forward halves, and in M backward halves.

        def run():  # the layer, its residuals filed in the stash: an idle half writes none
            h, res = saved.forward(layer(lf), shared, x, s, lf)
            slot = ic % slots
            return h, [put_entry(a, (slot, lf), v) for a, v in zip(c.stash, res, strict=True)]

        with tracing.runs(m, 2 * plan.num_ticks):
            h, stash = lax.cond(f_on, run, lambda: (c.h, c.stash))
        # The last stage turns its output into the loss and the cotangent at once.
        with tracing.runs(m, 2 * lv * plan.num_ticks):  # on the last stage, once per micro-batch
            loss, (g_head, dy) = lax.cond(
                f_on & (q == lv - 1) & is_last,
                lambda: grad_loss(head_params, h, take(call.ts, ic)),
                lambda: (jnp.zeros((), jnp.float32), (zeros(head_params), c.dy)),
            )
        # Backward phase (q >= Lv): layer 2Lv-1-q of micro-batch j, from its stashed input.
        j = bwd[t, s]
        jc, lb = jnp.maximum(j, 0), jnp.maximum(2 * lv - 1 - q, 0)
        b_on = (j >= 0) & (q >= lv)
        cot = where(q == lv, where(is_last, dy, c.cot), c.g)
        kept = [entry(a, (jc % slots, lb)) for a in stash]

        def backward():  # the layer's gradients added to the carry's, only when B runs
            g_layer, g_sh, g = saved.backward(layer(lb), shared, kept, cot)
            own = jax.tree.map(lambda a, d: add_entry(a, (lb,), d), c.g_params, g_layer)
            return own, add(c.g_shared, g_sh), g

        with tracing.runs(m, 2 * plan.num_ticks):
            g_params, g_shared, g = lax.cond(b_on, backward, lambda: (c.g_params, c.g_shared, c.g))
        end = q == 2 * lv - 1
        g_x = prog.enter_t(g)
        g_xs = put(c.g_xs, jnp.where(end & b_on & is_first, jc, m), g_x)  # else: spare row
        with tracing.runs(1, 2 * lv):  # after the tick's last backward layer
            act, cot_next = lax.cond(
                end,
                lambda: (shift(h, k, 1, ring=False), shift(g, k, -1, ring=False)),
                lambda: (c.act, c.cot),
            )
        new = _Carry(act, cot_next, h, g, dy, stash, g_params, g_shared, add(c.g_head, g_head),
                     g_xs, c.loss + loss)  # fmt: skip
        return new, None

    init = _start(x0, params, shared, head_params, call.xs, slots, saved.residuals, whole)
    c = run_ticks(iteration, init, plan.num_ticks * 2 * lv, call.unroll)
    g_params = whole_grads.scatter(c.g_params, params) if whole else c.g_params  # once a step
    g_rows = call.layers_as_rows(*(jax.tree.map(lambda g: g[None], (g_params, c.g_shared))))
    return c.loss, g_rows, jax.tree.map(lambda g: g[:m], c.g_xs), c.g_head
