"""Pricing a layout without compiling it: the state per device, FLOPs and collective bytes of a
decoder-only transformer's training step, from its sizes and the layout alone.

The planner's first stage: every layout the search space holds is priced here in microseconds,
and only the front-runners are compiled (`planning.plan` with `PricingOptions`). The formulas
are the ones the library's programs are checked against (ZeRO's gathers and scatters,
Megatron's all-reduces, the pipeline's sends), written for the GPT of `replicator.models.gpt`;
`tests/test_pricing.py` keeps them within 10% of the compiled programs.

Counted per device and per step, as `Replicator.explain` reads a compiled program:

* state: the parameters (fp32), their optimizer slots (``opt_slots`` fp32 copies: Adam's two
  moments), split over ``model`` (the heads' and MLP's columns, and the vocabulary), over
  ``stage`` (the layers), and over the data axes by ZeRO (stage >= 1: the slots; 3: the
  parameters too);
* the peak: the state, the gradients (whole until ZeRO-2 or 3 scatters them), the activations
  each layer keeps for its backward pass (by the remat policy: its input; the matmuls'
  outputs; everything, the S x S scores included where attention is not blockwise) for the
  micro-batches in flight, the weights cast to the compute dtype, and the larger of the head's
  backward (the logits) and a layer's. The terms are the buffers read from the programs of
  `replicator.models.gpt` on XLA:CPU and on TPU;
* FLOPs: ``2`` per multiply-add of the matmuls, forward, and twice that backward; attention's
  scores and weighted sums over whole ``S x S`` blocks (the blockwise kernels compute every
  tile); full rematerialisation recomputes the forward of the products whose inputs the
  backward needs (not the output projections); a GPipe or circular pipeline computes through
  its idle ticks, and every stage computes the head (the program is the same on each);
* collectives: ring algorithms' bytes on the wire per device: an all-reduce ``2 (g-1)/g`` of
  its buffer, an all-gather or reduce-scatter ``(g-1)/g`` of the whole, a send its buffer.

This module is plain Python: no JAX, nothing compiled.
"""

from __future__ import annotations

import dataclasses
import functools

from replicator._src.planner import remats, search
from replicator._src.planner.layouts import VIRTUAL, Layout, chunks_at, schedule_of
from replicator._src.planner.model_shape import TILE, ModelShape
from replicator._src.planner.wire import collectives, computed_ticks, device_params, device_tokens
from replicator._src.report.cost_model import SKIPS_IDLE, CollectiveCost, CompiledStep, model_time
from replicator._src.report.step_report import format_bytes


@dataclasses.dataclass(frozen=True)
class Price:
    """A layout's figures from the formulas (per device, per step).

    Attributes:
      layout: the layout.
      state_bytes: parameters and optimizer slots held.
      flops: FLOPs, idle ticks a schedule computes through included.
      collectives: `CollectiveCost` by kind and axes.
      peak_bytes: the state plus what the step holds beside it (`_working_bytes`): the
        gradients, the activations the layers keep for their backward pass (by the remat
        policy, for the micro-batches a schedule keeps in flight), the weights in the compute
        dtype, and the larger of the head's backward and a layer's. GPipe and circular keep
        more a tick than is modelled: for them it is a floor (`FLOOR`).
      roofline: ``(FLOPs, HBM bytes)`` of the step's kernels by kind (the matmuls, attention,
        the memory-bound rest), as `cost_model.kernel_time` reads a compiled program's.
      host_bytes: bytes moved between host and device a step (activations a remat policy
        offloads: written forward, read back backward).
      host_memory: bytes kept in host memory (those activations).

    >>> shape = ModelShape(num_layers=4, d_model=256, num_heads=8, kv_heads=8, head_dim=32,
    ...                    hidden=1024, vocab=256, seq_len=128, global_batch=32)
    >>> p = price(Layout(data=8, zero_stage=3), shape)
    >>> p.state_bytes < p.peak_bytes and p.bytes_by("all-gather", "data") > 0
    True
    """

    layout: Layout
    state_bytes: float
    flops: float
    collectives: tuple[CollectiveCost, ...]
    peak_bytes: float = 0.0
    roofline: tuple[tuple[float, float], ...] = ()
    host_bytes: float = 0.0
    host_memory: float = 0.0

    def step(self) -> CompiledStep:
        """These figures as a compiled program's, for `cost_model.model_time`.

        A schedule that skips its idle ticks idles for its bubble's share.
        """
        lay = self.layout
        bubble = idle = 0.0
        if lay.stage > 1:
            v = lay.repeats if lay.schedule in VIRTUAL else 1
            bubble = (lay.stage - 1) / (lay.microbatches * v + lay.stage - 1)
            if lay.schedule in SKIPS_IDLE:
                idle = self.flops * bubble / (1 - bubble)
        return CompiledStep(
            mesh=dict(lay.mesh_shape), flops=self.flops,
            memory={"peak": int(self.peak_bytes),
                    "temporaries": int(self.peak_bytes - self.state_bytes)},
            collectives=self.collectives, idle_flops=idle, bubble=bubble, roofline=self.roofline,
            host_bytes=self.host_bytes,
        )  # fmt: skip

    def to_dict(self) -> dict:
        """The figures as a dict (``collective_bytes``: all kinds and axes together)."""
        return {"state_bytes": self.state_bytes, "peak_bytes": self.peak_bytes,
                "flops": self.flops, "collective_bytes": self.bytes_by()}  # fmt: skip

    def bytes_by(self, kind: str | None = None, axis: str | None = None) -> float:
        """Bytes on the wire per device of the collectives of ``kind`` over ``axis`` (None:
        any)."""
        return sum(c.wire_bytes for c in self.collectives
                   if (kind is None or c.kind == kind) and (axis is None or axis in c.axes))  # fmt: skip


def price(layout: Layout, shape: ModelShape) -> Price:
    """The figures of ``layout`` for the model ``shape`` (see the module docstring).

    >>> m = ModelShape(num_layers=4, d_model=256, num_heads=8, kv_heads=8, head_dim=32,
    ...                hidden=1024, vocab=256, seq_len=128, global_batch=32)
    >>> p = price(Layout(data=8, zero_stage=3), m)
    >>> round(p.state_bytes / 1e6, 2), round(p.flops / 1e9, 2)
    (4.99, 10.67)
    >>> sorted({(c.kind, c.axes) for c in p.collectives})
    [('all-gather', ('data',)), ('reduce-scatter', ('data',))]
    """
    shape = _chunked(layout, shape)
    state, flops = _state_bytes(layout, shape), _flops(layout, shape)
    host = remats.host_memory(layout, shape, device_tokens(layout, shape))
    return Price(layout, state, flops, tuple(collectives(layout, shape)),
                 state + _working_bytes(layout, shape), _roofline(layout, shape, flops),
                 2 * host, host)  # fmt: skip


def _state_bytes(layout: Layout, m: ModelShape) -> float:
    params = device_params(layout, m)
    replicas = layout.zero_shards  # ZeRO splits over the data axes (not context's replicas)
    held = params / replicas if layout.zero_stage == 3 else params
    slots = m.opt_slots * params / (replicas if layout.zero_stage >= 1 else 1)
    return 4 * (held + slots)


def _working_bytes(layout: Layout, m: ModelShape) -> float:
    """What the step holds beside its state (bytes per device): the gradients, the activations
    the layers keep for their backward pass, the weights in the compute dtype, and the larger
    of the head's backward (the logits) and a layer's (what it computes again)."""
    params = device_params(layout, m)
    zero, t, e = layout.zero_stage, layout.model, m.compute_bytes
    micro = layout.microbatches if layout.stage > 1 else layout.accumulate_steps
    tokens = device_tokens(layout, m) / micro  # a micro-batch's, on this device
    layers = m.num_layers / layout.stage
    in_flight = 1
    if layout.stage > 1:
        in_flight = _in_flight(layout.schedule, layout.stage, layout.microbatches, layout.repeats)
    everything = _kept(layout, m, False)
    if m.experts and m.moe_chunks > 1:  # a mixture's rows a chunk's at a time
        rows = m.expert_rows * m.moe_layers / m.num_layers
        everything -= (1 - 1 / m.moe_chunks) * e * rows * (6 * m.hidden / t + 2 * m.d_model)
    activations = tokens * _kept(layout, m, layout.remat) * layers * in_flight
    if layout.stage > 1:  # every micro-batch's input to the stages and output of the last
        activations += (2 * layout.microbatches + 1) * tokens * m.d_model * e
    grads = 4 * params / (layout.zero_shards if zero >= 2 else 1)
    if zero == 2 or (layout.accumulate_steps > 1 and zero < 2):
        grads += 4 * params  # a micro-step's whole, before ZeRO-2 scatters it or it is summed
    outer_split, outer_whole = m.outer_params
    block = params - outer_split / t - outer_whole  # the layers' parameters on this device
    weights = 0.0
    if e < 4:  # each layer's weights cast to the compute dtype (ZeRO-3: its own part), and
        # under ZeRO-3 without remat the gathered casts, kept for the backward (fp32 weights
        # are gathered again where they are used)
        weights += e * block / (layout.zero_shards if zero == 3 else 1)
        if zero == 3 and layout.remat is False:
            weights += e * block
    outer_split = outer_split / t
    # the logits (a chunk's of them, in chunks): two fp32 copies in an fp32 program; in bf16
    # the head's product is written in fp32 itself, one copy (Llama 3.1 8B and 70B on v6e-256:
    # f32[tokens, vocab] is the largest buffer of their TPU programs)
    head = tokens / m.loss_chunks * m.vocab / t * (4 + (e if e >= 4 else 0))
    if zero >= 2:  # the embedding's and head's gradients whole, before they are scattered
        head += 4 * outer_split
    layer = tokens * (everything - _kept(layout, m, layout.remat) if layout.remat else everything)
    if zero == 3:  # a layer's gradients before the scatter, and its cast weights gathered again
        layer += (4 + (e if layout.remat and e < 4 else 0)) * block / layers
    return grads + activations + weights + max(head, layer)


def _kept(layout: Layout, m: ModelShape, remat) -> float:
    """Bytes a layer keeps per token for its backward pass, by remat policy (read from the
    programs of `replicator.models.gpt`): its input (full remat); the matmuls' outputs
    (``dots``); without remat, also the norms (RMSNorm's in fp32), the rotated queries and
    keys, the MLP's units, and attention's S x S scores and probabilities where its kernel is
    not blockwise (else a log-sum-exp a head)."""
    t, d, e = layout.model, m.d_model, m.compute_bytes
    if remat is True:  # (split over `model` by its width with residual_split)
        return e * d / (t if m.residual_split else 1)
    if remats.is_named(remat):
        return e * remats.device_and_host(m, t, remat)[0]
    gates, rows = (2 if m.gated else 1), m.mlp_rows  # an expert's slots: rows of its own
    if remat == "dots":  # (the experts' products have a batch axis: they keep nothing)
        dense = 1 - m.moe_layers / m.num_layers
        return e * ((m.qkv_columns + gates * dense * m.hidden) / t + d + dense * d)
    heads = m.num_heads / t
    hidden = 6 * rows * m.hidden / t + (2 * rows * d if m.experts else 0)  # experts' in, out
    if m.layer_norm:
        kept = e * (9 * d + m.qkv_columns / t + hidden)
    else:
        q, kv = m.num_heads * m.head_dim, m.kv_heads * m.head_dim
        kept = 4 * 4 * d + e * (3 * d + 2 * (q + 2 * kv) / t + hidden)
    if layout.context == 1 and (m.attention == "dot_product" or m.seq_len <= TILE):
        return kept + 2 * e * heads * m.seq_len
    return kept + 4 * heads


def _flops(layout: Layout, m: ModelShape) -> float:
    tokens = device_tokens(layout, m)
    layers = m.num_layers / layout.stage
    d = m.d_model
    attention_width = m.num_heads * m.head_dim / layout.model
    # per layer and token, forward: the matmuls' 2 per multiply-add
    # (the MLP's for each of its rows: an expert's slots), and the scores and weighted sums of
    # each query against the whole sequence
    rows = m.mlp_rows
    attention = m.block_matmul_params - m.mlp_params[0]
    router = m.d_model * m.experts * m.moe_layers / m.num_layers
    matmul = 2 * ((attention + rows * m.mlp_params[0]) / layout.model + router)
    scores = 4 * m.attended_keys * attention_width
    forward = layers * tokens * (matmul + scores)
    train = 3 * forward
    moe = m.moe_layers / m.num_layers
    if layout.remat is True:  # the layer again, less its output projections (not needed back;
        # an expert's is: its gate's gradient reads it)
        dense = (1 - moe) * m.hidden * d
        out_proj = 2 * (m.num_heads * m.head_dim * d + dense) / layout.model
        train += layers * tokens * (matmul - out_proj + scores)
    elif layout.remat == "dots":  # the experts' products have a batch axis: computed again
        train += layers * tokens * 2 * moe * m.expert_rows * m.mlp_params[0] / layout.model
    elif remats.is_named(layout.remat):  # what it does not keep, and attention's kernel
        again = remats.recomputed_params(m, layout.model, layout.remat)
        train += layers * tokens * (2 * again + scores)
    if (m.moe_chunks > 1 and layout.remat is not True) or remats.is_named(layout.remat):
        # the experts again in the backward: each chunk's, or what a policy by name does not
        # keep (full remat computes them again anyway: its pass again skips the mixture, whose
        # output no backward step reads)
        train += layers * tokens * 2 * (moe * m.expert_rows * m.mlp_params[0] / layout.model
                                        + router)  # fmt: skip
    train *= computed_ticks(layout)
    head = 6 * tokens * m.vocab * d / layout.model  # on every stage's device (in chunks too:
    # each chunk's gradient is taken in the forward pass, `decoder.head_loss`)
    return train + head


# HBM bytes, read from the TPU programs of Llama 3 8B and Llama 2 70B (`Price.roofline`): the
# blockwise kernel's per head and pair of 64-token tiles, forward and backward (ring attention's,
# and over whole sequences: all-to-all's and one device's); the norms',
# activations' and residuals' per unit of a layer (``d_model + hidden``) and token; the
# optimizer's per parameter it updates (fp32 parameter, gradient, two slots, read and written).
TILE_PAIR_BYTES = {"ring": 1.0e6, "whole": 1.35e6}
UNIT_BYTES = 28
UPDATE_BYTES = 36


def _roofline(layout: Layout, m: ModelShape, flops: float) -> tuple[tuple[float, float], ...]:
    """``(FLOPs, HBM bytes)`` of the step's kernels by kind, as `cost_model.kernel_time` reads
    a compiled program's: the matmuls (at the chip's peak), attention (the blockwise kernel's
    tiles read and written; splash and one-block attention at the peak), and what is only
    memory: the layers' element-wise work, the logits, the optimizer's update."""
    tokens, t = device_tokens(layout, m), layout.model
    layers = m.num_layers / layout.stage * computed_ticks(layout)
    again = layout.remat is True or remats.is_named(layout.remat)  # attention's kernel again
    passes = 4 if again else 3  # forward, twice that backward, remat's again
    heads = m.num_heads / t
    attention = passes * layers * tokens * 4 * m.attended_keys * heads * m.head_dim
    blocks = 0.0
    if m.attention == "blockwise" and (layout.context > 1 or m.seq_len > TILE):
        pairs = tokens / TILE * (m.seq_len / 2 / TILE) * heads  # causal: half the keys
        ring = layout.context > 1 and layout.attention == "ring"
        blocks = layers * pairs * TILE_PAIR_BYTES["ring" if ring else "whole"]
    units = UNIT_BYTES * (1.4 if layout.remat is True else 1) * layers * tokens
    units *= m.d_model + m.hidden / t
    # what a layer keeps beyond its input (which full remat keeps), written in the forward and
    # read in the backward: without remat the norms, the MLP's units and the scores as well
    beyond = _kept(layout, m, layout.remat) - _kept(layout, m, True)
    saved = 2 * layers * tokens * max(0.0, beyond)
    logits = 6 * 4 * tokens * m.vocab / t
    updated = device_params(layout, m) / (layout.zero_shards if layout.zero_stage >= 1 else 1)
    memory = units + saved + logits + UPDATE_BYTES * updated
    return ((flops - attention, 0.0), (attention, blocks), (0.0, memory))


@functools.cache
def _in_flight(schedule: str, stages: int, microbatches: int, repeats: int) -> int:
    """The micro-batches whose residuals a stage keeps at once: its table's ring buffer (one a
    virtual stage), or every tick's (GPipe's and circular's scans keep them all)."""
    plan = schedule_of(schedule, repeats).timetable(stages, microbatches)
    return plan.stash_slots or int(plan.fwd.shape[0])


# The lowest a compiled program's peak has been against its priced one (`Price.peak_bytes`):
# a ladder is dropped only where every layout's priced peak times this is over the budget.
# (Mixtral 8x22B on v6e-256 with its layer input and projections offloaded: 0.72-0.78 of the
# prices, read as the HBM libtpu allocates.)
MARGIN = 0.7
# The share of the compiled peak that the priced one has been for GPipe and circular, whose
# scans keep more a tick than is modelled: their priced peak is a floor.
FLOOR = 0.5
TRIES = search.TRIES
ROUNDS = 4  # rounds of ``compile_top`` ladders compiled at most while none fits


def front_runners(ladders, model, budget, profile, timing, scale=1.0, prices=None):
    """``(ranked, dropped, prices)``: the ladders that may fit, each as ``(modelled seconds,
    ladder, layouts to try)``, fastest first; the outcomes of the layouts of those that cannot;
    every layout's price.

    A ladder is dropped where even `MARGIN` of every layout's priced peak (times ``scale``:
    what compiled programs have shown of the prices) is over ``budget``.
    In each other ladder the layouts to try are, at most twice `TRIES` (of which `TRIES` may
    compile; the compiler's refusals do not count): the priced fastest of those
    that may fit; then those whose priced peak fits (GPipe's and circular's: over `FLOOR`),
    priced fastest first (recomputing more can be faster where it moves fewer bytes); then the
    others that may. The
    ladders are ordered by the modelled time of their first layout to try, each kind's
    fastest first (with a pipeline or not, with a ``model``, ``context`` or ``expert`` axis or
    not)."""
    prices = {} if prices is None else prices
    prices.update({lay: price(lay, model) for ladder in ladders for lay in ladder.layouts
                   if lay not in prices})  # fmt: skip
    peak = lambda lay: prices[lay].peak_bytes * scale
    likely = lambda lay: peak(lay) / (FLOOR if _floor_only(lay) else 1)
    dropped, ranked = [], []
    for ladder in ladders:
        host = profile.host_memory_bytes
        wrong = {lay: why for lay in ladder.layouts if (why := unbuildable(lay, model))}
        dropped += [search.Outcome(lay, search.ERROR, why, int(prices[lay].state_bytes))
                    for lay, why in wrong.items()]  # fmt: skip
        layouts = [lay for lay in ladder.layouts if lay not in wrong]
        if not layouts:
            continue
        fits = [lay for lay in layouts if peak(lay) * MARGIN <= budget
                and (host is None or prices[lay].host_memory <= host)]  # fmt: skip
        if not fits:
            least = min(peak(lay) for lay in layouts)
            times = "" if scale == 1 else f" (priced x {scale:.2f}, as the compiled peaks were)"
            reason = f"priced: {format_bytes(least)} per device{times}"
            dropped += [search.Outcome(lay, search.PRICED_TOO_BIG, reason,
                                       int(prices[lay].state_bytes))
                        for lay in layouts]  # fmt: skip
            continue
        priced = {lay: model_time(prices[lay].step(), profile, **timing).total for lay in fits}
        fits.sort(key=priced.__getitem__)
        first = _fewest_steps_first([lay for lay in fits if likely(lay) <= budget])
        # the fastest that may fit first, where it is faster than the fastest likely to
        bolder = [lay for lay in fits[:1] if not first or priced[lay] < priced[first[0]]]
        tries = list(dict.fromkeys(bolder + first + fits))[: 2 * TRIES]  # TRIES compiled
        seconds = priced[tries[0]]
        ranked.append((seconds, len(ranked), ladder, tries))
    ranked.sort(key=lambda r: r[:2])
    # each kind of layout's fastest ladder first (pipelined or not, with a model, context or
    # expert axis or not), then the others, fastest first: the prices rank the ladders of one
    # kind better than they rank the kinds, so the first ladders compiled span the kinds
    kind = lambda ladder: ladder.layouts[0].kind
    firsts = {}
    for r in ranked:
        firsts.setdefault(kind(r[2]), r)
    order = [*firsts.values(), *(r for r in ranked if firsts[kind(r[2])] is not r)]
    return [(seconds, ladder, tries) for seconds, _, ladder, tries in order], dropped, prices


def _chunked(layout: Layout, m: ModelShape) -> ModelShape:
    """``m`` with its chunks as ``layout`` takes them (`layouts.chunks_at`)."""
    moe, loss = chunks_at(layout, m.moe_chunks, m.loss_chunks)
    if (moe, loss) == (m.moe_chunks, m.loss_chunks):
        return m
    return dataclasses.replace(m, moe_chunks=moe, loss_chunks=loss)


def unbuildable(layout: Layout, m: ModelShape) -> str | None:
    """Why the model cannot be built on ``layout``, or None: the chunks its config asks for
    (``moe_chunks``, ``loss_chunks``) must divide what a device's micro-batch gives them, as
    `GPTConfig` checks when the step is traced (with accumulation, in as many fewer chunks:
    `layouts.chunks_at`). Such layouts are not compiled.

    >>> shape = ModelShape(num_layers=2, d_model=64, num_heads=4, kv_heads=4, head_dim=16,
    ...                    hidden=128, vocab=64, seq_len=32, global_batch=48, experts=4,
    ...                    top_k=2, moe_chunks=4)
    >>> print(unbuildable(Layout(data=8), shape))
    moe_chunks=4 does not divide the 6 sequences a device's mixture takes a micro-batch
    >>> unbuildable(Layout(data=4), shape), unbuildable(Layout(data=4, accumulate_steps=2), shape)
    (None, None)
    """
    if m.whole_sequences and layout.context > 1:
        return "sliding-window or soft-capped attention takes whole sequences: no context axis"
    if m.mixed_layers and layout.stage > 1:
        return "a pipeline's stages take one kind of attention layer, and the model mixes two"
    m = _chunked(layout, m)
    micro = layout.accumulate_steps if layout.stage == 1 else layout.microbatches
    seqs = m.global_batch / (layout.replicas * micro)  # a device's (the mixture splits them)
    if m.experts and m.moe_chunks > 1 and seqs % (m.moe_chunks * layout.expert):
        split = f" in chunks split over expert={layout.expert}" if layout.expert > 1 else ""
        return (f"moe_chunks={m.moe_chunks} does not divide the {seqs:g} sequences a device's "
                f"mixture takes a micro-batch{split}")  # fmt: skip
    tokens = seqs / layout.expert * m.seq_len / layout.context
    if m.loss_chunks > 1 and tokens % m.loss_chunks:
        return (f"loss_chunks={m.loss_chunks} does not divide the {tokens:g} tokens a device's "
                f"head takes a micro-batch")  # fmt: skip
    return None


def _fewest_steps_first(layouts: list[Layout]) -> list[Layout]:
    """``layouts`` (priced fastest first) with each remat policy's fewest accumulation steps
    ahead of its others: the same FLOPs in fewer pieces is no slower where both fit, so more
    steps of a policy must not take a ladder's tries (`TRIES`) from its fewest. (Mixtral 8x22B
    on v6e-256: the recipe's policy at 2 steps, priced 1% faster than at 1, took the last try,
    and at 1, 0.7% faster compiled, was not tried.)"""
    fewest: dict = {}
    for lay in layouts:
        if lay.remat not in fewest or lay.accumulate_steps < fewest[lay.remat].accumulate_steps:
            fewest[lay.remat] = lay
    heads = [lay for lay in layouts if fewest[lay.remat] is lay]
    return heads + [lay for lay in layouts if fewest[lay.remat] is not lay]


def _floor_only(layout: Layout) -> bool:
    """Whether the priced peak is only a floor: GPipe's and circular's scans (`FLOOR`)."""
    return layout.stage > 1 and layout.schedule in ("gpipe", "circular")
