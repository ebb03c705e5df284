"""ZeroBubble and Interleaved1F1B: tables whose passes wait in ring buffers, in one scan.

A tick on a stage runs its phases in order: F (the forward of micro-batch ``fwd[t, s]`` through
virtual stage ``fwd_repeat[t, s]``), B (the backward of ``bwd[t, s]`` through virtual stage
``bwd_repeat[t, s]``) and, for ZeroBubble, W (the weight-gradient pass of ``wgt[t, s]``). Each
phase is Lv iterations of the scan, one layer each, under ``lax.cond`` so that an idle phase
costs nothing. At the end of a tick the F output goes to ``s+1`` and the B output (the
cotangent of the stage input) to ``s-1``: two stage transfers per tick, as in 1F1B; with V
virtual stages (Interleaved1F1B) both go around the ring, as in Circular.

F keeps each layer's residuals as the remat policy says (`residuals.SavedLayer`). ZeroBubble's
B runs the operations that the input's cotangent needs and keeps what W needs besides (the
cotangents of the products with parameters, and the activations it recomputed); W runs the
rest. So B and W together do one fused backward pass's work, as in the zero-bubble paper, and
with ``"none"`` nothing is recomputed at all. Interleaved1F1B's B is the fused backward.

Because a pass may run ticks after what it reads arrived, what it reads is kept in ring
buffers, one per virtual stage, written when it arrives and read when the tables say:

- the stage inputs ``[V, stash_slots + 1, b, ...]``: from the arrival from ``s-1`` to F;
- the residuals ``[V, stash_slots, Lv, ...]``: from F to W (or the fused B), written inside
  F's branch, so an idle iteration writes nothing;
- the output cotangents ``[V, grad_slots + 1, Lv, b, ...]``: entry ``[r, i % grad_slots, li]``
  is the cotangent of layer ``li``'s output, from its arrival from ``s+1`` (or the loss's, on
  the last logical stage) until W; with a fused backward only the stage output's (``Lv = 1``
  in this ring);
- what B hands to W ``[1, grad_slots + 1, Lv, ...]``: from B to W (ZeroBubble only).

The last slot of each other ring is a spare that idle iterations write to.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src.core import tracing
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.typing import PyTree
from replicator._src.pipeline import schedules as schedules_lib
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

    h: PyTree  # the F phase's activation after the layer just run
    g: PyTree  # the B phase's cotangent after the layer just run
    inbox: PyTree  # stage inputs from s-1 [V, stash_slots + 1, b, ...]; the last slot: a spare
    stash: list  # layer residuals [V, stash_slots, Lv, ...], written only when F runs
    grads: PyTree  # output cotangents [V, grad_slots + 1, Lv or 1, b, ...]; the last: a spare
    inter: list  # what B keeps for W [1, grad_slots + 1, Lv, ...]; the last: a spare
    g_params: PyTree  # (layer gradients [V, Lv, ...], shared parameters' [V, ...]), from W
    g_head: PyTree  # the head's gradient, accumulated (nonzero on the last stage)
    g_xs: PyTree  # input gradients [M + 1, b, ...]; row M is a spare (nonzero on stage 0)
    loss: jax.Array  # float32 scalar: this stage's share of the mean loss


def _ring(x0: PyTree, v: int, slots: int, lv: int | None = None, spare: bool = True) -> PyTree:
    layers = () if lv is None else (lv,)
    n = slots + 1 if spare else slots
    return jax.tree.map(lambda a: jnp.zeros((v, n, *layers, *a.shape), a.dtype), x0)


def _get(ring: PyTree, r, slot, layer=None) -> PyTree:
    """Entry ``[r, slot]`` (or ``[r, slot, layer]``) of every leaf: a dynamic slice."""
    lead = (r, slot) if layer is None else (r, slot, layer)
    return jax.tree.map(lambda a: entry(a, lead), ring)


def _set(ring: PyTree, r, slot, layer, value: PyTree) -> PyTree:
    """Every leaf with entry ``[r, slot]`` (or ``[r, slot, layer]``) set to ``value``'s leaf:
    a dynamic update slice, which XLA runs in place (an indexed ``.at[].set`` is a scatter that
    rewrites the whole ring)."""
    lead = (r, slot) if layer is None else (r, slot, layer)
    return jax.tree.map(lambda a, x: put_entry(a, lead, x), ring, value)


def value_and_grad(
    call: PipelineCall, loss_fn: LossFn, head_params: PyTree, remat: Remat
) -> tuple[jax.Array, PyTree, PyTree, PyTree]:
    """ZeroBubble or Interleaved1F1B with one layer per scan iteration, on this stage.

    A tick is Lv F iterations, then Lv B iterations in reverse layer order, then (ZeroBubble)
    Lv W iterations, each under ``lax.cond``. Equivalent to, on stage ``s`` (``S =
    stash_slots``, ``G = grad_slots``, ``L = Lv``; ZeroBubble has ``V = 1``)::

        for t in range(T):
            if (i := fwd[t, s]) >= 0:                       # F: micro-batch i, virtual stage r
                r = fwd_repeat[t, s]
                x = enter(xs[i]) if (r, s) == (0, 0) else inbox[r, i % S]
                for li in range(L):
                    x, stash[r, i % S, li] = forward(params[r, li], x)   # per the policy
                if (r, s) == (V - 1, K - 1):
                    loss += loss_fn(head, leave(x), ts[i]) / M;  grads[r, i % G, L-1] = dloss/dx
            if (j := bwd[t, s]) >= 0:                       # B of micro-batch j
                rb = bwd_repeat[t, s]
                if fused:                                   # Interleaved1F1B
                    g = grads[rb, j % G, L-1]
                    for li in reversed(range(L)):
                        dp, g = backward(params[rb, li], stash[rb, j % S, li], g)
                        g_params[rb, li] += dp
                else:                                       # ZeroBubble: input gradients only
                    for li in reversed(range(L)):
                        g, inter[j % G, li] = input_grad(params[li], stash[j % S, li],
                                                         grads[j % G, li])
                        if li > 0: grads[j % G, li - 1] = g
                if (rb, s) == (0, 0): g_xs[j] = enter_t(g)
            if (w := wgt[t, s]) >= 0:                       # W: weight gradients of w
                for li in range(L):
                    g_params[li] += weight_grad(params[li], stash[w % S, li], grads[w % G, li],
                                                inter[w % G, li])
            x_in, g_in = shift(x, +1), shift(g, -1)        # around the ring when V > 1
            if F ran on s-1 (micro-batch i', virtual stage r') and it was not the last logical:
                inbox[r' + (s == 0), i' % S] = x_in
            if B ran on s+1 (j', r') and it was not the first logical stage:
                grads[r' - (s == K-1), j' % G, L-1] = g_in

    Returns:
      ``(loss, g_rows, g_xs, g_head)``, as `one_f_one_b.value_and_grad` returns them. Integer
      leaves (of the inputs or the activation) get zero gradients.

    Raises:
      ValueError: if the plan's tables break a dependency or its rings are too small
        (`schedules.check_dependencies`).
    """
    st = _Stage(call, loss_fn, head_params, remat)
    x0, v = st.x0, st.v
    spare = jax.tree.map(lambda a: jnp.zeros((st.m + 1, *a.shape[1:]), a.dtype), call.xs)
    init = _Carry(
        x0, x0, _ring(x0, v, st.ss), _ring(st.no_res, v, st.ss, st.lv, spare=False),
        _ring(x0, v, st.gs, st.lv if st.split else 1), _ring(st.no_inter, 1, st.gs, st.lv),
        st.zeros(), zeros(head_params), spare, jnp.zeros((), jnp.float32),
    )  # fmt: skip
    c = run_ticks(st.iteration, init, st.ticks * st.phases * st.lv, call.unroll)
    g_layers, g_shared = c.g_params
    if st.whole:  # scatter_grads="step": the whole stage's gradients reduce-scattered once
        g_layers = whole_grads.scatter(g_layers, st.params)
    g_rows = call.layers_as_rows(g_layers, g_shared)  # [V, ...]
    return c.loss, g_rows, jax.tree.map(lambda a: a[: st.m], c.g_xs), c.g_head


class _F(NamedTuple):
    """The F phase of one iteration."""

    on: jax.Array  # bool: this iteration runs a forward layer
    mb: jax.Array  # its micro-batch (0 when idle)
    layer: jax.Array  # its layer
    stash: list  # the residual rings, with the layer's residuals filed (unchanged when idle)
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
    inter: list  # the ring of what B keeps for W, with this iteration's B written
    g_params: PyTree  # the stage's weight gradients, with W's (or the fused B's) layer added
    g_xs: PyTree  # the inputs' gradients, with stage 0's last B layer put


class _Stage:
    """This stage's plan, layers and loss: the scan's iteration and its phases."""

    def __init__(
        self, call: PipelineCall, loss_fn: LossFn, head_params: PyTree, remat: Remat
    ) -> None:
        plan = call.plan
        schedules_lib.check_dependencies(plan)  # the rings and orders the scan relies on
        self.call, self.loss_fn, self.head_params = call, loss_fn, head_params
        self.k, self.m, self.ticks = call.num_stages, call.num_microbatches, plan.num_ticks
        self.v = plan.repeats
        self.split = bool((plan.wgt >= 0).any())  # B and W apart (ZeroBubble), or fused
        self.phases = 3 if self.split else 2
        self.ss, self.gs = plan.stash_slots, max(plan.grad_slots, 1)
        self.fwd, self.frep, self.bwd, self.brep, self.wgt = (
            jnp.asarray(a) for a in (plan.fwd, plan.fwd_repeat, plan.bwd, plan.bwd_repeat, plan.wgt)
        )
        self.prog = call.program(call.rows)
        self.lv = self.prog.lv
        self.params = self.prog.layers  # this stage's layers, [V, Lv, ...]
        self.shared = self.prog.shared  # [V, ...]
        self.s = lax.axis_index(STAGE_AXIS)
        self.is_first, self.is_last = self.s == 0, self.s == self.k - 1
        self.x0 = zeros(self.prog.enter(take(call.xs, 0)))
        # scatter_grads="step": each layer gathered where it runs, its gradient whole
        self.whole = call.scatter_grads == "step" and whole_grads.has_split(self.params)
        one, sh = take(take(self.params, 0), 0), take(self.shared, 0)
        one = whole_grads.abstract(one) if self.whole else one
        self.saved = SavedLayer(self.prog.layer_fn, remat, one, sh, self.x0, self.s, jnp.int32(0))
        self.no_res = [jnp.zeros(r.shape, r.dtype) for r in self.saved.residuals]
        inter = self.saved.inter_shapes(one, sh, self.no_res, self.x0) if self.split else []
        self.no_inter = [jnp.zeros(r.shape, r.dtype) for r in inter]

    def layer(self, r, li) -> PyTree:
        """Layer ``li`` of virtual stage ``r``'s parameters (gathered, with ``whole``)."""
        p = take(take(self.params, r), li)
        return whole_grads.gathered(p) if self.whole else p

    def zeros(self) -> tuple[PyTree, PyTree]:
        """The gradients' accumulators: the layers' (whole, with ``whole``) and the shared
        parameters'."""
        layers = whole_grads.zeros(self.params) if self.whole else zeros(self.params)
        return layers, zeros(self.shared)

    def iteration(self, c: _Carry, u) -> tuple[_Carry, None]:
        """Iteration ``u``: layer ``q`` of phase F, B or W of tick ``t`` (``u = phases*Lv*t +
        q``)."""
        t, q = u // (self.phases * self.lv), u % (self.phases * self.lv)
        f = self.forward(c, t, q)
        # F files its residuals before B and W read theirs (never in the same iteration): a
        # ring read before it is written would make XLA copy the whole ring every iteration.
        stash = f.stash
        bw = self.backward(c, t, q, stash)
        inbox, grads, inter = self.file(c, t, q, f, bw)
        return _Carry(
            f.h, bw.g, inbox, stash, grads, inter, bw.g_params, add(c.g_head, f.g_head),
            bw.g_xs, c.loss + f.loss,
        ), None  # fmt: skip

    def forward(self, c: _Carry, t, q) -> _F:
        """F (``q < Lv``): layer ``q`` of micro-batch ``fwd[t, s]`` through virtual stage
        ``fwd_repeat[t, s]``, and on the last logical stage its loss and the loss's cotangent."""
        lv, m, call, k = self.lv, self.m, self.call, self.k
        i, r = self.fwd[t, self.s], self.frep[t, self.s]
        ic, lf = jnp.maximum(i, 0), jnp.minimum(q, lv - 1)
        on = (i >= 0) & (q < lv)
        arrived = where(
            self.is_first & (r == 0),
            self.prog.enter(take(call.xs, ic)),
            _get(c.inbox, r, ic % self.ss),
        )
        x = where(q == 0, arrived, c.h)
        # Each stage is busy in V*M of the T ticks' F phases, V*M of the B's (and M of the W's).

        def run():  # the layer, its residuals filed in the stash: an idle iteration writes none
            h, res = self.saved.forward(
                self.layer(r, lf), take(self.shared, r), x, r * k + self.s, lf
            )
            return h, _set(c.stash, r, ic % self.ss, lf, res)

        with tracing.runs(self.v * m, self.phases * self.ticks):
            h, stash = lax.cond(on, run, lambda: (c.h, c.stash))

        def grad_loss(head, y, t):
            loss, vjp = vjp_inexact(
                lambda hp, w: mean_loss(self.loss_fn, hp, self.prog.leave(w), t, m), head, y
            )
            return loss, vjp(jnp.ones((), jnp.float32))

        loss_made = on & (q == lv - 1) & self.is_last & (r == self.v - 1)
        with tracing.runs(m, self.phases * lv * self.ticks):  # once per micro-batch
            loss, (g_head, dy) = lax.cond(
                loss_made,
                lambda: grad_loss(self.head_params, h, take(call.ts, ic)),
                lambda: (jnp.zeros((), jnp.float32), (zeros(self.head_params), c.h)),
            )
        return _F(on, ic, lf, stash, h, loss_made, loss, g_head, dy)

    def backward(self, c: _Carry, t, q, stash: list) -> _BW:
        """B (``Lv <= q < 2Lv``: layer ``2Lv-1-q`` of micro-batch ``bwd[t, s]`` through virtual
        stage ``bwd_repeat[t, s]``) and W (``q >= 2Lv``: layer ``q-2Lv`` of ``wgt[t, s]``), each
        from one layer's residuals and output cotangent read from the rings (and W from what B
        kept)."""
        lv, m, s = self.lv, self.m, self.s
        j, rb, w = self.bwd[t, s], self.brep[t, s], self.wgt[t, s]
        jc, wc = jnp.maximum(j, 0), jnp.maximum(w, 0)
        in_b, in_w = (q >= lv) & (q < 2 * lv), q >= 2 * lv
        b_on, w_on = (j >= 0) & in_b, (w >= 0) & in_w
        lb, lw = jnp.clip(2 * lv - 1 - q, 0, lv - 1), jnp.clip(q - 2 * lv, 0, lv - 1)
        # Each pass reads its residuals and cotangent inside its branch: an idle iteration
        # slices nothing.
        read = lambda ring, slots, mb, layer, r=0: _get(ring, r, mb % slots, layer)
        runs = tracing.runs(self.v * m, self.phases * self.ticks)
        if not self.split:  # the fused backward: the cotangent comes down the layers

            def fused():  # the layer's gradients added to the carry's, only when B runs
                cot = where(q == lv, read(c.grads, self.gs, jc, 0, rb), c.g)
                res = read(stash, self.ss, jc, lb, rb)
                g_p, g_sh, g = self.saved.backward(self.layer(rb, lb), take(self.shared, rb),
                                                   res, cot)  # fmt: skip
                own = jax.tree.map(lambda a, d: add_entry(a, (rb, lb), d), c.g_params[0], g_p)
                sh = jax.tree.map(lambda a, d: add_entry(a, (rb,), d), c.g_params[1], g_sh)
                return (own, sh), g

            with runs:
                g_params, g = lax.cond(b_on, fused, lambda: (c.g_params, c.g))
            inter = c.inter
        else:
            sh = take(self.shared, 0)  # the layers are taken (or gathered) in the branches

            def input_grad():
                res, cot = read(stash, self.ss, jc, lb), read(c.grads, self.gs, jc, lb)
                return self.saved.input_grad(self.layer(0, lb), sh, res, cot)

            with runs:
                g, inter = lax.cond(b_on, input_grad, lambda: (c.g, self.no_inter))
            # B's output goes in before W reads (B and W never run in one iteration), so that
            # XLA updates the ring in place instead of copying it.
            inter_ring = _set(c.inter, 0, jnp.where(b_on, jc % self.gs, self.gs), lb, inter)

            def accumulate():  # W's gradients added to the carry's, only when W runs
                res, cot = read(stash, self.ss, wc, lw), read(c.grads, self.gs, wc, lw)
                kept = read(inter_ring, self.gs, wc, lw)
                g_p, g_sh = self.saved.weight_grad(self.layer(0, lw), sh, res, cot, kept)
                own = jax.tree.map(lambda a, d: add_entry(a, (0, lw), d), c.g_params[0], g_p)
                return own, jax.tree.map(lambda a, d: add_entry(a, (0,), d), c.g_params[1], g_sh)

            with tracing.runs(m, 3 * self.ticks):
                g_params = lax.cond(w_on, accumulate, lambda: c.g_params)
            inter = inter_ring
        g_x = self.prog.enter_t(g)
        first = b_on & (lb == 0) & self.is_first & (rb == 0)
        g_xs = put(c.g_xs, jnp.where(first, jc, m), g_x)  # or the spare row
        return _BW(in_b, b_on, jc, lb, g, inter, g_params, g_xs)

    def file(self, c: _Carry, t, q, f: _F, bw: _BW) -> tuple[PyTree, PyTree, list]:
        """The other rings after the iteration: one write to each (idle ones to the spare slot).

        The inbox gets, at the end of the tick, the activation that arrived from ``s-1``; the
        cotangents the loss's (last logical stage, last F layer),
        ZeroBubble's B output (``li > 0``) and, at the end of the tick, the cotangent that
        arrived from ``s+1``; the last ring what B keeps for W.
        """
        k, v, s, ss, gs = self.k, self.v, self.s, self.ss, self.gs
        end = q == self.phases * self.lv - 1
        with tracing.runs(1, self.phases * self.lv):  # after the tick's last layer
            x_in, g_in = lax.cond(
                end,
                lambda: (shift(f.h, k, 1, ring=v > 1), shift(bw.g, k, -1, ring=v > 1)),
                lambda: (f.h, bw.g),
            )
        # What arrives from s-1 (around the ring: device 0 from K-1, one virtual stage on).
        prev = (s - 1) % k
        x_from, x_rep = self.fwd[t, prev], self.frep[t, prev] + self.is_first
        x_got = end & (x_from >= 0) & (x_rep < v)
        inbox = _set(
            c.inbox, jnp.where(x_got, x_rep, 0), jnp.where(x_got, jnp.maximum(x_from, 0) % ss, ss),
            None, x_in,
        )  # fmt: skip
        inter = bw.inter  # B wrote its part before W read (`backward`)
        # What arrives from s+1 (around the ring: device K-1 from 0, one virtual stage back).
        nxt = (s + 1) % k
        g_from, g_rep = self.bwd[t, nxt], self.brep[t, nxt] - self.is_last
        g_got = end & (g_from >= 0) & (g_rep >= 0)
        top = (self.lv if self.split else 1) - 1  # the stage output's row in the ring
        slot = jnp.where(g_got, jnp.maximum(g_from, 0) % gs, gs)
        rep = jnp.where(g_got, g_rep, 0)
        layer = jnp.full((), top)
        if self.split:
            b_put = bw.b_on & (bw.layer > 0)
            slot = jnp.where(b_put, bw.mb % gs, slot)
            layer = jnp.where(bw.in_b, jnp.maximum(bw.layer - 1, 0), top)
        slot = jnp.where(f.loss_made, f.mb % gs, slot)
        rep = jnp.where(f.loss_made, v - 1, rep)
        layer = jnp.where(f.loss_made, top, layer)
        value = where(f.loss_made, f.dy, where(end, g_in, bw.g))
        return inbox, _set(c.grads, rep, slot, layer, value), inter
