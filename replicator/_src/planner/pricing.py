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
from replicator._src.planner.layouts import VIRTUAL, Layout, schedule_of
from replicator._src.planner.model_shape import TILE, ModelShape
from replicator._src.report.cost_model import SKIPS_IDLE, CollectiveCost, CompiledStep, model_time
from replicator._src.report.step_report import format_bytes
from replicator._src.sharded import embedding


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
    state, flops = _state_bytes(layout, shape), _flops(layout, shape)
    host = remats.host_memory(layout, shape, _tokens(layout, shape))
    return Price(layout, state, flops, tuple(_collectives(layout, shape)),
                 state + _working_bytes(layout, shape), _roofline(layout, shape, flops),
                 2 * host, host)  # fmt: skip


def _per_device_params(layout: Layout, m: ModelShape) -> float:
    """Parameters one device holds before ZeRO: its stage's layers, its ``model`` columns, its
    ``expert`` axis's experts (a mixture's layers: a router for the dense MLP)."""
    split, whole = m.block_params
    outer_split, outer_whole = m.outer_params
    layers = m.num_layers / layout.stage
    moe = m.moe_layers * (m.d_model * m.experts - sum(m.mlp_params) / layout.model)
    experts = m.expert_params / (layout.model * layout.expert)
    dense = layers * (split / layout.model + whole)
    return dense + moe + experts + outer_split / layout.model + outer_whole


def _state_bytes(layout: Layout, m: ModelShape) -> float:
    params = _per_device_params(layout, m)
    replicas = layout.replicas  # ZeRO splits over the data axes (not context's replicas)
    held = params / replicas if layout.zero_stage == 3 else params
    slots = m.opt_slots * params / (replicas if layout.zero_stage >= 1 else 1)
    return 4 * (held + slots)


def _working_bytes(layout: Layout, m: ModelShape) -> float:
    """What the step holds beside its state (bytes per device): the gradients, the activations
    the layers keep for their backward pass, the weights in the compute dtype, and the larger
    of the head's backward (the logits) and a layer's (what it computes again)."""
    params = _per_device_params(layout, m)
    zero, t, e = layout.zero_stage, layout.model, m.compute_bytes
    micro = layout.microbatches if layout.stage > 1 else layout.accumulate_steps
    tokens = _tokens(layout, m) / micro  # a micro-batch's, on this device
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
    grads = 4 * params / (layout.replicas if zero >= 2 else 1)
    if zero == 2 or (layout.accumulate_steps > 1 and zero < 2):
        grads += 4 * params  # a micro-step's whole, before ZeRO-2 scatters it or it is summed
    outer_split, outer_whole = m.outer_params
    block = params - outer_split / t - outer_whole  # the layers' parameters on this device
    weights = 0.0
    if e < 4:  # each layer's weights cast to the compute dtype (ZeRO-3: its own part), and
        # under ZeRO-3 without remat the gathered casts, kept for the backward (fp32 weights
        # are gathered again where they are used)
        weights += e * block / (layout.replicas if zero == 3 else 1)
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


def _tokens(layout: Layout, m: ModelShape) -> float:
    """Tokens one device's layers see per step."""
    return m.global_batch * m.seq_len / (layout.replicas * layout.context * layout.expert)


def _flops(layout: Layout, m: ModelShape) -> float:
    tokens = _tokens(layout, m)
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
    scores = 4 * m.seq_len * attention_width
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
    if m.moe_chunks > 1 and layout.remat is not True:  # each chunk's experts again in the
        # backward (full remat computes them again anyway: its pass again skips the mixture,
        # whose output no backward step reads)
        train += layers * tokens * 2 * (moe * m.expert_rows * m.mlp_params[0] / layout.model
                                        + router)  # fmt: skip
    train *= _computed_ticks(layout)
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
    tokens, t = _tokens(layout, m), layout.model
    layers = m.num_layers / layout.stage * _computed_ticks(layout)
    again = layout.remat is True or remats.is_named(layout.remat)  # attention's kernel again
    passes = 4 if again else 3  # forward, twice that backward, remat's again
    heads = m.num_heads / t
    attention = passes * layers * tokens * 4 * m.seq_len * heads * m.head_dim
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
    updated = _per_device_params(layout, m) / (layout.replicas if layout.zero_stage >= 1 else 1)
    memory = units + saved + logits + UPDATE_BYTES * updated
    return ((flops - attention, 0.0), (attention, blocks), (0.0, memory))


def _computed_ticks(layout: Layout) -> float:
    """Stage work done per useful unit: GPipe and circular compute through their idle ticks."""
    if layout.stage == 1 or layout.schedule not in ("gpipe", "circular"):
        return 1.0
    m, k = layout.microbatches, layout.stage
    v = layout.repeats if layout.schedule in VIRTUAL else 1
    return (m * v + k - 1) / (m * v)


def _ring(g: int) -> float:
    return (g - 1) / g


def _collectives(layout: Layout, m: ModelShape):
    params = _per_device_params(layout, m)
    grads = 4 * params
    d, r = layout.data, layout.replicas
    a = layout.accumulate_steps
    if r > 1:
        if layout.zero_stage == 0:
            yield from _over_replicas("all-reduce", layout, grads, 1)
        else:  # ZeRO-2 and 3 scatter each micro-step's gradients, ZeRO-1 the sum once
            scatters = a if layout.zero_stage >= 2 else 1
            # ZeRO-3 gathers and scatters in its reduce dtype (bf16: half the fp32 bytes)
            sharded = grads * (m.reduce_bytes / 4 if layout.zero_stage == 3 else 1)
            yield from _over_replicas("reduce-scatter", layout, scatters * sharded, scatters)
            # ZeRO-3 gathers the parameters forward and backward each micro-step; 1 and 2
            # gather the updated ones once
            gathers = 2 * a if layout.zero_stage == 3 else 1
            yield from _over_replicas("all-gather", layout, gathers * sharded, gathers)
        tokens = _tokens(layout, m) / a  # a micro-step's
        if layout.zero_stage == 3 and tokens < m.vocab:  # each replica looks up in its columns
            lookup = 2 * a * tokens * m.d_model / layout.model * m.compute_bytes  # and back
            if d > 1:  # to the other replicas of its slice, and of the other slices
                yield CollectiveCost("all-to-all", ("data",), (d - 1) / r * lookup, 2 * a)
            if r > d:
                yield CollectiveCost("all-to-all", ("dcn_data",), (r - d) / r * lookup, 2 * a)
    table, summed, gathers = _token_table(layout, m)
    yield from gathers
    n = layout.expert
    if n > 1:  # each mixture sends its experts' rows to their devices and back, forward and
        # backward (and forward again under full remat); the tokens' replicas sum the rest
        count = (6 if layout.remat else 4) * m.moe_layers  # dots: the experts' rows again
        buffer = _tokens(layout, m) * m.expert_rows * m.d_model * m.compute_bytes
        yield CollectiveCost("all-to-all", ("expert",), count * _ring(n) * buffer, count)
        shared = 4 * (params - m.expert_params / (layout.model * n)) - table + summed
        yield CollectiveCost("all-reduce", ("expert",), 2 * _ring(n) * shared, 1)
    c = layout.context
    if c > 1:  # the gradients summed over the context's replicas too
        yield CollectiveCost("all-reduce", ("context",), 2 * _ring(c) * (grads - table + summed), 1)
        yield from _context(layout, m)
    t = layout.model
    micro = layout.microbatches if layout.stage > 1 else 1
    activation = _tokens(layout, m) / micro * m.d_model * m.compute_bytes  # a micro-batch's
    if t > 1:  # Megatron: two all-reduces of the activations forward and two backward a layer,
        # and the vocabulary-parallel embedding's forward and the head's input gradient (an
        # MLP's of each of its rows: a mixture's of each expert's slots)
        layers = m.num_layers / layout.stage
        count = (4 * layers + 2) * micro
        rows = (2 * layers * (1 + m.mlp_rows) + 2) * micro
        yield CollectiveCost("all-reduce", ("model",), rows * activation * 2 * _ring(t), count)
    k = layout.stage
    if k > 1:  # each tick sends a micro-batch's activations forward and a gradient back
        ticks = 2 * _ticks(layout.schedule, k, layout.microbatches, layout.repeats)
        yield CollectiveCost("collective-permute", ("stage",), ticks * activation / t, ticks)
        # the embedding's and head's gradients summed over the stages that hold them
        outer = 4 * sum(m.outer_params) / t
        yield CollectiveCost("all-reduce", ("stage",), 2 * _ring(k) * outer, 1)


def _over_replicas(kind: str, layout: Layout, buffer: float, count: int):
    """A gradient reduction or ZeRO gather of ``buffer`` bytes (all executions) over the
    replicas, as XLA lays one out over slices: over ``data`` inside each slice on the whole
    buffer, then over ``dcn_data`` across the slices on a slice replica's ``1 / data`` of it
    (an all-reduce: a reduce-scatter inside, an all-reduce across, an all-gather inside).

    >>> [(c.axes, c.wire_bytes) for c in _over_replicas("all-reduce", Layout(dcn_data=2,
    ...                                                  data=4), 800.0, 1)]
    [(('data',), 1200.0), (('dcn_data',), 200.0)]
    """
    twice = 2 if kind == "all-reduce" else 1
    d, s = layout.data, layout.dcn_data
    if d > 1:
        yield CollectiveCost(kind, ("data",), twice * _ring(d) * buffer, count)
    if s > 1:
        yield CollectiveCost(kind, ("dcn_data",), twice * _ring(s) * buffer / d, count)


def _token_table(layout: Layout, m: ModelShape):
    """The token table's gradient over the token axes (``context``, ``expert``), as
    `embedding.lookup` chooses: ``(table, summed, gathers)``, the bytes of its gradient in the
    parameters' and in their sums over the token axes (its part, where each device scatters
    its own tokens; where the cotangents are gathered instead, none but a tied head's), and the
    all-gathers of the cotangents, each micro-step's."""
    table = 4 * m.vocab * m.d_model / layout.model
    part = m.vocab * m.d_model / (layout.replicas if layout.zero_stage == 3 else 1)
    a, g = layout.accumulate_steps, layout.context * layout.expert
    tokens = m.global_batch * m.seq_len / (layout.replicas * a)  # a data replica's micro-step's
    cotangent = 4 if m.learned_positions else m.compute_bytes  # `gpt.embed` casts after adding
    if g == 1 or embedding.scatters_locally(
        part=part, tokens=tokens, width=m.d_model, cotangent_bytes=cotangent
    ):
        return table, 4 * part / layout.model, ()
    axes = tuple(name for name in ("expert", "context") if getattr(layout, name) > 1)
    wire = a * _ring(g) * tokens * m.d_model * cotangent
    return table, table if m.tied else 0.0, (CollectiveCost("all-gather", axes, wire, a),)


def _context(layout: Layout, m: ModelShape):
    """Attention across ``context``: the ring passes K/V blocks, ``2 (C-1)`` a layer forward
    and ``2 (C-1) + 2 C`` backward (the ring again, and dK, dV home); Ulysses' all-to-alls
    turn four projections' activations, forward and backward (`replicator.attention`)."""
    c, t = layout.context, layout.model
    tokens = _tokens(layout, m)  # over the step's micro-batches
    layers = m.num_layers / layout.stage
    if layout.attention == "ring":
        block = tokens * m.kv_heads * m.head_dim / t * m.compute_bytes
        blocks = (6 * c - 4) * layers
        yield CollectiveCost("collective-permute", ("context",), blocks * block, blocks)
    else:
        activation = tokens * m.d_model / t * m.compute_bytes
        count = 8 * layers
        yield CollectiveCost("all-to-all", ("context",), count * _ring(c) * activation, count)


@functools.cache
def _in_flight(schedule: str, stages: int, microbatches: int, repeats: int) -> int:
    """The micro-batches whose residuals a stage keeps at once: its table's ring buffer (one a
    virtual stage), or every tick's (GPipe's and circular's scans keep them all)."""
    plan = schedule_of(schedule, repeats).timetable(stages, microbatches)
    return plan.stash_slots or int(plan.fwd.shape[0])


@functools.cache
def _ticks(schedule: str, stages: int, microbatches: int, repeats: int) -> int:
    """The ticks of a schedule's table (GPipe's and circular's backward replays them)."""
    plan = schedule_of(schedule, repeats).timetable(stages, microbatches)
    return int(plan.fwd.shape[0])


# The lowest a compiled program's peak has been against its priced one (`Price.peak_bytes`):
# a ladder is dropped only where every layout's priced peak times this is over the budget.
MARGIN = 0.8
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
    In each other ladder the layouts to try are, at most `TRIES`: the priced fastest of those
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
        fits = [lay for lay in ladder.layouts if peak(lay) * MARGIN <= budget
                and (host is None or prices[lay].host_memory <= host)]  # fmt: skip
        if not fits:
            least = min(peak(lay) for lay in ladder.layouts)
            times = "" if scale == 1 else f" (priced x {scale:.2f}, as the compiled peaks were)"
            reason = f"priced: {format_bytes(least)} per device{times}"
            dropped += [search.Outcome(lay, search.PRICED_TOO_BIG, reason,
                                       int(prices[lay].state_bytes))
                        for lay in ladder.layouts]  # fmt: skip
            continue
        priced = {lay: model_time(prices[lay].step(), profile, **timing).total for lay in fits}
        fits.sort(key=priced.__getitem__)
        first = [lay for lay in fits if likely(lay) <= budget]
        # the fastest that may fit first, where it is faster than the fastest likely to
        bolder = [lay for lay in fits[:1] if not first or priced[lay] < priced[first[0]]]
        tries = list(dict.fromkeys(bolder + first + fits))[:TRIES]
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


def _floor_only(layout: Layout) -> bool:
    """Whether the priced peak is only a floor: GPipe's and circular's scans (`FLOOR`)."""
    return layout.stage > 1 and layout.schedule in ("gpipe", "circular")
