"""ZeroBubble: the backward split into B (input gradients) and W (weight gradients), in one scan.

A tick on a stage runs three phases, in order: F (the forward of micro-batch ``fwd[t, s]``), B
(the input-gradient pass of ``bwd[t, s]``) and W (the weight-gradient pass of ``wgt[t, s]``).
Each phase is Lv iterations of the scan, one layer each, under ``lax.cond`` so that an idle
phase costs nothing. At the end of a tick the F output goes to ``s+1`` and the B output (the
cotangent of the stage input) to ``s-1``: two stage transfers per tick, as in 1F1B.

F keeps each layer's residuals as the remat policy says (`residuals.SavedLayer`). B runs the
operations that the input's cotangent needs and keeps what W needs besides (the cotangents of
the products with parameters, and the activations it recomputed); W runs the rest. So B and W
together do one fused backward pass's work, as in the zero-bubble paper, and with ``"none"``
nothing is recomputed at all.

Because B and W of a micro-batch may run ticks apart, what they read is kept in ring buffers,
written when it arrives and read when the tables say, so an arrival need not be consumed in the
next tick:

- the stage inputs ``[stash_slots + 1, b, ...]``: from the arrival from ``s-1`` to F;
- the residuals ``[stash_slots + 1, Lv, ...]``: from F to W;
- the output cotangents ``[grad_slots + 1, Lv, b, ...]``: entry ``[i % grad_slots, li]`` is the
  cotangent of layer ``li``'s output, from its arrival from ``s+1`` (or the loss's, on the last
  stage) until W;
- what B hands to W ``[grad_slots + 1, Lv, ...]``: from B to W.

The last slot of each ring is a spare that idle iterations write to.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src import tracing
from replicator._src.mesh import STAGE_AXIS
from replicator._src.pipeline import schedules as schedules_lib
from replicator._src.pipeline.call import PipelineCall
from replicator._src.pipeline.layers import vjp_inexact
from replicator._src.pipeline.residuals import Remat, SavedLayer
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

    h: PyTree  # the F phase's activation after the layer just run
    g: PyTree  # the B phase's cotangent after the layer just run
    inbox: PyTree  # stage inputs from s-1 [stash_slots + 1, b, ...]; the last slot: a spare
    stash: list  # layer residuals [stash_slots + 1, Lv, ...]; the last slot is a spare
    grads: PyTree  # layer output cotangents [grad_slots + 1, Lv, b, ...]; the last: a spare
    inter: list  # what B keeps for W [grad_slots + 1, Lv, ...]; the last: a spare
    g_params: PyTree  # (layer gradients [Lv, ...], shared parameters' gradient), from W
    g_head: PyTree  # the head's gradient, accumulated (nonzero on the last stage)
    g_xs: PyTree  # input gradients [M + 1, b, ...]; row M is a spare (nonzero on stage 0)
    loss: jax.Array  # float32 scalar: this stage's share of the mean loss


def _ring(x0: PyTree, slots: int, lv: int | None = None) -> PyTree:
    layers = () if lv is None else (lv,)
    return jax.tree.map(lambda a: jnp.zeros((slots + 1, *layers, *a.shape), a.dtype), x0)


def _get(ring: PyTree, slot, layer=None) -> PyTree:
    return jax.tree.map(lambda a: a[slot] if layer is None else a[slot, layer], ring)


def _set(ring: PyTree, slot, layer, value: PyTree) -> PyTree:
    if layer is None:
        return jax.tree.map(lambda a, v: a.at[slot].set(v), ring, value)
    return jax.tree.map(lambda a, v: a.at[slot, layer].set(v), ring, value)


def value_and_grad(
    call: PipelineCall, loss_fn: LossFn, head_params: PyTree, remat: Remat
) -> tuple[jax.Array, PyTree, PyTree, PyTree]:
    """ZeroBubble with one layer per scan iteration, on this stage.

    A tick is Lv F iterations, then Lv B iterations in reverse layer order, then Lv W
    iterations, each under ``lax.cond``. Equivalent to, on stage ``s`` (``S = stash_slots``,
    ``G = grad_slots``, ``L = Lv``)::

        for t in range(T):
            if (i := fwd[t, s]) >= 0:                       # F: forward of micro-batch i
                x = enter(xs[i]) if s == 0 else inbox[i % S]
                for li in range(L):
                    x, stash[i % S, li] = forward(params[li], x)   # residuals, per the policy
                if s == K - 1:
                    loss += loss_fn(head, leave(x), ts[i]) / M;  grads[i % G, L-1] = d loss / d x
            if (j := bwd[t, s]) >= 0:                       # B: input gradients of j
                for li in reversed(range(L)):
                    g, inter[j % G, li] = input_grad(params[li], stash[j % S, li], grads[j % G, li])
                    if li > 0: grads[j % G, li - 1] = g
                if s == 0: g_xs[j] = enter_t(g)
            if (w := wgt[t, s]) >= 0:                       # W: weight gradients of w
                for li in range(L):
                    g_params[li] += weight_grad(params[li], stash[w % S, li], grads[w % G, li],
                                                inter[w % G, li])
            x_in, g_in = shift(x, +1), shift(g, -1)        # the tick's F and B outputs
            if s > 0 and fwd[t, s-1] >= 0: inbox[fwd[t, s-1] % S] = x_in
            if s < K-1 and bwd[t, s+1] >= 0: grads[bwd[t, s+1] % G, L-1] = g_in

    Returns:
      ``(loss, g_rows, g_xs, g_head)``, as `one_f_one_b.value_and_grad` returns them. Integer
      leaves (of the inputs or the activation) get zero gradients.

    Raises:
      ValueError: if the plan's tables break a dependency or its rings are too small
        (`schedules.check_dependencies`).
    """
    st = _Stage(call, loss_fn, head_params, remat)
    x0 = st.x0
    spare = jax.tree.map(lambda a: jnp.zeros((st.m + 1, *a.shape[1:]), a.dtype), call.xs)
    init = _Carry(
        x0, x0, _ring(x0, st.ss), _ring(st.no_res, st.ss, st.lv), _ring(x0, st.gs, st.lv),
        _ring(st.no_inter, st.gs, st.lv), zeros((st.params, st.shared)), zeros(head_params),
        spare, jnp.zeros((), jnp.float32),
    )  # fmt: skip
    c = run_ticks(st.iteration, init, st.ticks * 3 * st.lv, call.unroll)
    g_rows = call.layers_as_rows(*jax.tree.map(lambda a: a[None], c.g_params))  # [1, ...]
    return c.loss, g_rows, jax.tree.map(lambda a: a[: st.m], c.g_xs), c.g_head


class _F(NamedTuple):
    """The F phase of one iteration."""

    on: jax.Array  # bool: this iteration runs a forward layer
    mb: jax.Array  # its micro-batch (0 when idle)
    layer: jax.Array  # its layer
    res: list  # the layer's residuals (zeros when idle)
    h: PyTree  # the layer's output (the carry's when idle)
    loss_made: jax.Array  # bool: the last stage made micro-batch mb's loss and cotangent
    loss: jax.Array  # that loss's share of the mean, else 0
    g_head: PyTree  # the head's gradient from it, else zeros
    dy: PyTree  # the cotangent of the stage output, else the carry's h


class _BW(NamedTuple):
    """The B and W phases of one iteration."""

    in_b: jax.Array  # bool: the iteration is in the B phase
    b_on: jax.Array  # bool: it runs a B layer
    mb: jax.Array  # B's micro-batch (0 when idle)
    layer: jax.Array  # B's layer
    g: PyTree  # B's output: the cotangent of the layer's input (the carry's when idle)
    inter: list  # what B keeps for W (zeros when idle)
    g_params: PyTree  # the stage's weight gradients, with W's layer added
    g_xs: PyTree  # the inputs' gradients, with stage 0's last B layer put


class _Stage:
    """This stage's plan, layers and loss: the scan's iteration and its three phases."""

    def __init__(
        self, call: PipelineCall, loss_fn: LossFn, head_params: PyTree, remat: Remat
    ) -> None:
        plan = call.plan
        schedules_lib.check_dependencies(plan)  # the rings and orders the scan relies on
        self.call, self.loss_fn, self.head_params = call, loss_fn, head_params
        self.k, self.m, self.ticks = call.num_stages, call.num_microbatches, plan.num_ticks
        self.ss, self.gs = plan.stash_slots, plan.grad_slots
        self.fwd, self.bwd, self.wgt = (jnp.asarray(a) for a in (plan.fwd, plan.bwd, plan.wgt))
        self.prog = call.program(call.rows)
        self.lv = self.prog.lv
        self.params = take(self.prog.layers, 0)  # this stage's layers, [Lv, ...]
        self.shared = take(self.prog.shared, 0)
        self.s = lax.axis_index(STAGE_AXIS)
        self.is_first, self.is_last = self.s == 0, self.s == self.k - 1
        self.x0 = zeros(self.prog.enter(take(call.xs, 0)))
        one = take(self.params, 0)
        self.saved = SavedLayer(
            self.prog.layer_fn, remat, one, self.shared, self.x0, self.s, jnp.int32(0)
        )
        self.no_res = [jnp.zeros(r.shape, r.dtype) for r in self.saved.residuals]
        inter = self.saved.inter_shapes(one, self.shared, self.no_res, self.x0)
        self.no_inter = [jnp.zeros(r.shape, r.dtype) for r in inter]

    def iteration(self, c: _Carry, u) -> tuple[_Carry, None]:
        """Iteration ``u``: layer ``q`` of phase F, B or W of tick ``t`` (``u = 3Lv t + q``)."""
        t, q = u // (3 * self.lv), u % (3 * self.lv)
        f = self.forward(c, t, q)
        bw = self.backward(c, t, q)
        inbox, stash, grads, inter = self.file(c, t, q, f, bw)
        return _Carry(
            f.h, bw.g, inbox, stash, grads, inter, bw.g_params, add(c.g_head, f.g_head),
            bw.g_xs, c.loss + f.loss,
        ), None  # fmt: skip

    def forward(self, c: _Carry, t, q) -> _F:
        """F (``q < Lv``): layer ``q`` of micro-batch ``fwd[t, s]``, and on the last stage its
        loss and the loss's cotangent."""
        lv, m, call = self.lv, self.m, self.call
        i = self.fwd[t, self.s]
        ic, lf = jnp.maximum(i, 0), jnp.minimum(q, lv - 1)
        on = (i >= 0) & (q < lv)
        arrived = where(
            self.is_first, self.prog.enter(take(call.xs, ic)), _get(c.inbox, ic % self.ss)
        )
        x = where(q == 0, arrived, c.h)
        # Each stage is busy in M of the T ticks' F phases, M of the B's and M of the W's.
        with tracing.runs(m, 3 * self.ticks):
            h, res = lax.cond(
                on,
                lambda: self.saved.forward(take(self.params, lf), self.shared, x, self.s, lf),
                lambda: (c.h, self.no_res),
            )

        def grad_loss(head, y, t):
            loss, vjp = vjp_inexact(
                lambda hp, w: mean_loss(self.loss_fn, hp, self.prog.leave(w), t, m), head, y
            )
            return loss, vjp(jnp.ones((), jnp.float32))

        loss_made = on & (q == lv - 1) & self.is_last
        with tracing.runs(m, 3 * lv * self.ticks):  # on the last stage, once per micro-batch
            loss, (g_head, dy) = lax.cond(
                loss_made,
                lambda: grad_loss(self.head_params, h, take(call.ts, ic)),
                lambda: (jnp.zeros((), jnp.float32), (zeros(self.head_params), c.h)),
            )
        return _F(on, ic, lf, res, h, loss_made, loss, g_head, dy)

    def backward(self, c: _Carry, t, q) -> _BW:
        """B (``Lv <= q < 2Lv``: layer ``2Lv-1-q`` of micro-batch ``bwd[t, s]``) and W (``q >=
        2Lv``: layer ``q-2Lv`` of ``wgt[t, s]``), each from one layer's residuals and output
        cotangent read from the rings (and W from what B kept)."""
        lv, m, s = self.lv, self.m, self.s
        j, w = self.bwd[t, s], self.wgt[t, s]
        jc, wc = jnp.maximum(j, 0), jnp.maximum(w, 0)
        in_b, in_w = (q >= lv) & (q < 2 * lv), q >= 2 * lv
        b_on, w_on = (j >= 0) & in_b, (w >= 0) & in_w
        lb, lw = jnp.clip(2 * lv - 1 - q, 0, lv - 1), jnp.clip(q - 2 * lv, 0, lv - 1)
        read_mb, read_layer = jnp.where(in_w, wc, jc), jnp.where(in_w, lw, lb)
        res = _get(c.stash, read_mb % self.ss, read_layer)
        cot = _get(c.grads, read_mb % self.gs, read_layer)
        with tracing.runs(m, 3 * self.ticks):
            g, inter = lax.cond(
                b_on,
                lambda: self.saved.input_grad(take(self.params, lb), self.shared, res, cot),
                lambda: (c.g, self.no_inter),
            )
        kept = _get(c.inter, wc % self.gs, lw)

        def accumulate():  # W's gradients added to the carry's, only when W runs
            g_p, g_sh = self.saved.weight_grad(take(self.params, lw), self.shared, res, cot, kept)
            own = jax.tree.map(lambda a, d: a.at[lw].add(d), c.g_params[0], g_p)
            return own, add(c.g_params[1], g_sh)

        with tracing.runs(m, 3 * self.ticks):
            g_params = lax.cond(w_on, accumulate, lambda: c.g_params)
        g_x = self.prog.enter_t(g)
        g_xs = put(c.g_xs, jnp.where(b_on & (lb == 0) & self.is_first, jc, m), g_x)  # or spare
        return _BW(in_b, b_on, jc, lb, g, inter, g_params, g_xs)

    def file(self, c: _Carry, t, q, f: _F, bw: _BW) -> tuple[PyTree, list, PyTree, list]:
        """The rings after the iteration: one write to each (idle ones to the spare slot).

        The inbox gets, at the end of the tick, the activation that arrived from ``s-1``; the
        stash F's residuals; the cotangents the loss's (last stage, last F layer), B's output
        (``li > 0``) and, at the end of the tick, the cotangent that arrived from ``s+1``; the
        last ring what B keeps for W.
        """
        k, s, ss, gs = self.k, self.s, self.ss, self.gs
        end = q == 3 * self.lv - 1
        with tracing.runs(1, 3 * self.lv):  # after the tick's last W layer
            x_in, g_in = lax.cond(
                end,
                lambda: (shift(f.h, k, 1, ring=False), shift(bw.g, k, -1, ring=False)),
                lambda: (f.h, bw.g),
            )
        x_from = self.fwd[t, jnp.maximum(s - 1, 0)]
        x_got = end & ~self.is_first & (x_from >= 0)
        inbox = _set(c.inbox, jnp.where(x_got, jnp.maximum(x_from, 0) % ss, ss), None, x_in)
        stash = _set(c.stash, jnp.where(f.on, f.mb % ss, ss), f.layer, f.res)
        inter = _set(c.inter, jnp.where(bw.b_on, bw.mb % gs, gs), bw.layer, bw.inter)
        g_from = self.bwd[t, jnp.minimum(s + 1, k - 1)]
        g_got = end & ~self.is_last & (g_from >= 0)
        b_put = bw.b_on & (bw.layer > 0)
        slot = jnp.where(g_got, jnp.maximum(g_from, 0) % gs, gs)
        slot = jnp.where(f.loss_made, f.mb % gs, jnp.where(b_put, bw.mb % gs, slot))
        layer = jnp.where(bw.in_b, jnp.maximum(bw.layer - 1, 0), self.lv - 1)
        value = where(f.loss_made, f.dy, where(end, g_in, bw.g))
        return inbox, stash, _set(c.grads, slot, layer, value), inter
