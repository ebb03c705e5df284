"""A layout's collectives from formulas, and the per-device quantities they and the rest of
the pricing (`pricing`) start from: the parameters a device holds before ZeRO, the tokens its
layers see.

Ring algorithms' bytes on the wire per device, per step: an all-reduce ``2 (g-1)/g`` of its
buffer, an all-gather or reduce-scatter ``(g-1)/g`` of the whole, a send its buffer. Over
slices, the replicas' reductions and gathers are hierarchical, as XLA lays them out: over
``data`` inside each slice on the whole buffer, over ``dcn_data`` across the slices on
``1 / data`` of it (`_over_replicas`).

This module is plain Python: no JAX, nothing compiled.
"""

from __future__ import annotations

import functools

from replicator._src.planner.layouts import VIRTUAL, Layout, schedule_of
from replicator._src.planner.model_shape import ModelShape
from replicator._src.report.cost_model import CollectiveCost
from replicator._src.sharded import embedding


def device_params(layout: Layout, m: ModelShape) -> float:
    """Parameters one device holds before ZeRO: its stage's layers, its ``model`` columns, its
    ``expert`` axis's experts (a mixture's layers: a router for the dense MLP)."""
    split, whole = m.block_params
    outer_split, outer_whole = m.outer_params
    layers = m.num_layers / layout.stage
    moe = m.moe_layers * (m.d_model * m.experts - sum(m.mlp_params) / layout.model)
    experts = m.expert_params / (layout.model * layout.expert)
    dense = layers * (split / layout.model + whole)
    return dense + moe + experts + outer_split / layout.model + outer_whole


def device_tokens(layout: Layout, m: ModelShape) -> float:
    """Tokens one device's layers see per step."""
    return m.global_batch * m.seq_len / (layout.replicas * layout.context * layout.expert)


def _ring(g: int) -> float:
    return (g - 1) / g


def collectives(layout: Layout, m: ModelShape):
    params = device_params(layout, m)
    grads = 4 * params
    d, r = layout.data, layout.replicas
    a = layout.accumulate_steps
    sent = grads * m.reduce_bytes / 4  # the gradients summed in the reduce dtype (bf16: half)
    if r > 1:
        if layout.zero_stage == 0:
            yield from _over_replicas("all-reduce", layout, sent, 1)
        elif layout.zero_stage == 3 and layout.stage > 1:
            yield from _pipelined_zero3(layout, m, sent)
        elif layout.hybrid:
            yield from _hybrid(layout, m, sent, grads)
        else:  # ZeRO-2 and 3 scatter each micro-step's gradients, ZeRO-1 the sum once
            scatters = a if layout.zero_stage >= 2 else 1
            yield from _over_replicas("reduce-scatter", layout, scatters * sent, scatters)
            # ZeRO-3 gathers the parameters forward and backward each micro-step, in the
            # reduce dtype; 1 and 2 gather the updated ones once, in fp32
            gathers = 2 * a if layout.zero_stage == 3 else 1
            gathered = sent if layout.zero_stage == 3 else grads
            yield from _over_replicas("all-gather", layout, gathers * gathered, gathers)
        tokens = device_tokens(layout, m) / a  # a micro-step's
        if layout.zero_stage == 3 and tokens < m.vocab:  # each replica looks up in its columns
            lookup = 2 * a * tokens * m.d_model / layout.model * m.compute_bytes  # and back
            z = layout.zero_shards  # the replicas holding the table's columns
            if d > 1:  # to the other replicas of its slice, and of the other slices
                yield CollectiveCost("all-to-all", ("data",), (d - 1) / z * lookup, 2 * a)
            if z > d:
                yield CollectiveCost("all-to-all", ("dcn_data",), (z - d) / z * lookup, 2 * a)
    table, summed, gathers = _token_table(layout, m)
    yield from gathers
    n = layout.expert
    if n > 1:  # each mixture sends its experts' rows to their devices and back, forward and
        # backward (and forward again under full remat); the tokens' replicas sum the rest
        count = (6 if layout.remat else 4) * m.moe_layers  # dots: the experts' rows again
        buffer = device_tokens(layout, m) * m.expert_rows * m.d_model * m.compute_bytes
        yield CollectiveCost("all-to-all", ("expert",), count * _ring(n) * buffer, count)
        shared = 4 * (params - m.expert_params / (layout.model * n)) - table + summed
        yield CollectiveCost("all-reduce", ("expert",), 2 * _ring(n) * shared, 1)
    c = layout.context
    if c > 1:  # the gradients summed over the context's replicas too
        yield CollectiveCost("all-reduce", ("context",), 2 * _ring(c) * (grads - table + summed), 1)
        yield from _context(layout, m)
    t = layout.model
    micro = layout.microbatches if layout.stage > 1 else 1
    activation = device_tokens(layout, m) / micro * m.d_model * m.compute_bytes  # a micro-batch's
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


def _pipelined_zero3(layout: Layout, m: ModelShape, sent: float):
    """ZeRO-3 in a pipeline: each tick a stage computes gathers its layers (forward and
    backward) and scatters their gradients (`pipeline.scatter_grads="microbatch"`, the
    default): once a micro-batch, and under GPipe and circular, which compute through their
    idle ticks, once a tick; the embedding and head once a step. (Read from the XLA:CPU
    programs of a small GPT: 1F1B on 4 stages with 8 micro-batches gathers 5.9 times what
    one pass would, GPipe on 2 with 4 micro-batches 4.3 times: `tests/test_pricing.py`.)"""
    outer = m.outer_params[0] / layout.model + m.outer_params[1]
    outer *= m.reduce_bytes  # the embedding's and head's part of `sent`
    passes = layout.microbatches * computed_ticks(layout)
    once = passes * (sent - outer) + outer
    yield from _over_replicas("reduce-scatter", layout, once, passes)
    yield from _over_replicas("all-gather", layout, 2 * once, 2 * passes)


def _hybrid(layout: Layout, m: ModelShape, sent: float, grads: float):
    """Hybrid ZeRO: the scatters and gathers as ZeRO's, over ``data`` inside each slice, and
    across the slices only the mean of each replica's reduced part (`zero.Zero.across`), once
    a step: an all-reduce of ``1 / data`` of the gradients, in the reduce dtype."""
    d, s, a = layout.data, layout.dcn_data, layout.accumulate_steps
    scatters = a if layout.zero_stage >= 2 else 1
    gathers = 2 * a if layout.zero_stage == 3 else 1
    gathered = sent if layout.zero_stage == 3 else grads
    if d > 1:
        yield CollectiveCost("reduce-scatter", ("data",), scatters * _ring(d) * sent, scatters)
        yield CollectiveCost("all-gather", ("data",), gathers * _ring(d) * gathered, gathers)
    yield CollectiveCost("all-reduce", ("dcn_data",), 2 * _ring(s) * sent / d, 1)


def computed_ticks(layout: Layout) -> float:
    """Stage work done per useful unit: GPipe and circular compute through their idle ticks."""
    if layout.stage == 1 or layout.schedule not in ("gpipe", "circular"):
        return 1.0
    m, k = layout.microbatches, layout.stage
    v = layout.repeats if layout.schedule in VIRTUAL else 1
    return (m * v + k - 1) / (m * v)


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
    part = m.vocab * m.d_model / (layout.zero_shards if layout.zero_stage == 3 else 1)
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
    tokens = device_tokens(layout, m)  # over the step's micro-batches
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
def _ticks(schedule: str, stages: int, microbatches: int, repeats: int) -> int:
    """The ticks of a schedule's table (GPipe's and circular's backward replays them)."""
    plan = schedule_of(schedule, repeats).timetable(stages, microbatches)
    return int(plan.fwd.shape[0])
