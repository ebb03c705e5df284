"""1F1B: forward and backward interleaved in one scan, with a stash bounded by 2K-1 inputs.

A tick is Lv forward iterations, then Lv backward iterations in reverse layer order, each under
``lax.cond`` so that idle halves cost nothing. The backward recomputes each layer from its
stashed input (``jax.vjp``), and the stash is a ring of ``2K-1`` micro-batches' layer inputs,
whatever the number of micro-batches. Two stage transfers per tick: activations to ``s+1``,
cotangents to ``s-1``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src import tracing
from replicator._src.mesh import STAGE_AXIS
from replicator._src.pipeline.call import PipelineCall
from replicator._src.pipeline.layers import vjp_inexact
from replicator._src.pipeline.ticks import (
    LossFn,
    add,
    mean_loss,
    put,
    run_ticks,
    shift,
    take,
    where,
    zeros,
)
from replicator._src.typing import PyTree


class _Carry(NamedTuple):
    """What the scan carries on one stage; activations are one micro-batch's, ``[b, ...]``."""

    act: PyTree  # the activation received from stage s-1 at the end of the last tick
    cot: PyTree  # the cotangent received from stage s+1 at the end of the last tick
    h: PyTree  # the forward's activation after the layer just run
    g: PyTree  # the backward's cotangent after the layer just run
    dy: PyTree  # the loss's cotangent of the last stage's latest output
    stash: PyTree  # layer inputs [2K-1 + 1, Lv, b, ...]; slot 2K-1 is a spare for idle halves
    g_params: PyTree  # this stage's layer gradients [Lv, ...], accumulated
    g_shared: PyTree  # the gradient of the stage's shared parameters, accumulated
    g_head: PyTree  # the head's gradient, accumulated (nonzero on the last stage)
    g_xs: PyTree  # input gradients [M + 1, b, ...]; row M is a spare (nonzero on stage 0)
    loss: jax.Array  # float32 scalar: this stage's share of the mean loss


def _start(
    x0: PyTree, params: PyTree, shared: PyTree, head_params: PyTree, xs: PyTree, slots: int
) -> _Carry:
    """The carry before the first tick: all zeros, with the spare stash slot and ``g_xs`` row."""
    lv = jax.tree.leaves(params)[0].shape[0]
    stash = jax.tree.map(lambda a: jnp.zeros((slots + 1, lv, *a.shape), a.dtype), x0)
    spare = jax.tree.map(lambda a: jnp.zeros((a.shape[0] + 1, *a.shape[1:]), a.dtype), xs)
    return _Carry(
        x0, x0, x0, x0, x0, stash, zeros(params), zeros(shared), zeros(head_params), spare,
        jnp.zeros((), jnp.float32),
    )  # fmt: skip


def value_and_grad(
    call: PipelineCall, loss_fn: LossFn, head_params: PyTree
) -> tuple[jax.Array, PyTree, PyTree, PyTree]:
    """1F1B with one layer per scan iteration, on this stage.

    A tick is Lv forward iterations (under ``lax.cond``, idle when the tick has no forward),
    then Lv backward iterations in reverse layer order, each recomputing its layer from the
    stashed layer input. Equivalent to, on stage ``s``::

        for t in range(T):                             # T = M + 2K - 2
            if (i := fwd[t, s]) >= 0:                  # forward of micro-batch i
                x = enter(xs[i]) if s == 0 else act
                stash[i % (2K-1)] = x;  y = stage_fn(params, x)
                if s == K - 1: loss += loss_fn(head, leave(y), ts[i]) / M;  dy = d loss / d y
            if (j := bwd[t, s]) >= 0:                  # backward of micro-batch j
                dp, g = vjp(stage_fn, params, stash[j % (2K-1)])(dy if s == K-1 else cot)
                g_params += dp
                if s == 0: g_xs[j] = enter_t(g)
            act, cot = shift(y, +1), shift(g, -1)

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
        with tracing.runs(m, 2 * plan.num_ticks):
            h = lax.cond(f_on, lambda: layer_fn(take(params, lf), shared, x, s, lf), lambda: c.h)
        slot = jnp.where(f_on, ic % slots, slots)  # idle: the spare slot
        stash = jax.tree.map(lambda a, v: a.at[slot, lf].set(v), c.stash, x)
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
        saved = jax.tree.map(lambda a: a[jc % slots, lb], stash)
        with tracing.runs(m, 2 * plan.num_ticks):
            g_layer, g_shared, g = lax.cond(
                b_on,
                lambda: vjp_inexact(
                    lambda p, sh, x: layer_fn(p, sh, x, s, lb), take(params, lb), shared, saved
                )[1](cot),
                lambda: (zeros(take(params, 0)), zeros(shared), c.g),
            )
        end = q == 2 * lv - 1
        g_x = prog.enter_t(g)
        g_xs = put(c.g_xs, jnp.where(end & b_on & is_first, jc, m), g_x)  # else: spare row
        with tracing.runs(1, 2 * lv):  # after the tick's last backward layer
            act, cot_next = lax.cond(
                end,
                lambda: (shift(h, k, 1, ring=False), shift(g, k, -1, ring=False)),
                lambda: (c.act, c.cot),
            )
        g_params = jax.tree.map(
            lambda a, d: a.at[lb].add(jnp.where(b_on, d, 0)), c.g_params, g_layer
        )
        g_shared = add(c.g_shared, g_shared)  # zeros when idle
        new = _Carry(act, cot_next, h, g, dy, stash, g_params, g_shared, add(c.g_head, g_head),
                     g_xs, c.loss + loss)  # fmt: skip
        return new, None

    init = _start(zeros(prog.enter(take(call.xs, 0))), params, shared, head_params, call.xs, slots)
    c = run_ticks(iteration, init, plan.num_ticks * 2 * lv, call.unroll)
    g_rows = call.layers_as_rows(*(jax.tree.map(lambda g: g[None], (c.g_params, c.g_shared))))
    return c.loss, g_rows, jax.tree.map(lambda g: g[:m], c.g_xs), c.g_head
