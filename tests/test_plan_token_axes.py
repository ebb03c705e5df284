"""rp.plan with the context and expert axes: the layouts enumerated for a long-sequence GPT and
for a mixture of experts (and none the library refuses), the layouts' names and meshes, the
time model's rule for their collectives, and compiled plans whose ring, all-to-all and expert
all-to-all bytes are those of the formulas and of `repl.explain`."""

import dataclasses
import math

import plan_jobs
import pytest

import replicator as rp
from replicator._src.report import cost_model
from replicator._src.report.cost_model import CollectiveCost, CompiledStep

HEADS = 4


def splits(ladders):
    """The (expert, context, attention) splits of the ladders' layouts."""
    return sorted({(lay.expert, lay.context, lay.attention or "") for f in ladders
                   for lay in f.layouts})  # fmt: skip


def long_gpt(n=8, **options):
    """The ladders of a 512-token GPT on ``n`` devices, ``options`` the records' fields."""
    defaults = dict(global_batch=16, num_layers=4, num_heads=HEADS, hidden=128, seq_len=512)
    return plan_jobs.ladders(n, **{**defaults, **options})


# -- enumeration ----------------------------------------------------------------------------------


def test_a_long_sequence_gets_context_axes_with_each_attention_its_heads_allow():
    """seq_len 512 on 8 devices: C = 2, 4, 8 divide 8 and keep >= 64 tokens a device; the ring
    at each (512 divides into 2C zigzag chunks), all-to-all where the 4 heads per model device
    divide by C (C = 2, 4 at model=1; C = 2 at model=2; none at model=4)."""
    ladders = long_gpt()
    assert splits(ladders) == [
        (1, 1, ""), (1, 2, "all_to_all"), (1, 2, "ring"), (1, 4, "all_to_all"), (1, 4, "ring"),
        (1, 8, "ring"),
    ]  # fmt: skip
    lays = [lay for f in ladders for lay in f.layouts]
    assert all(lay.num_devices == 8 and lay.expert == 1 for lay in lays)
    a2a = {(lay.context, lay.model) for lay in lays if lay.attention == "all_to_all"}
    assert a2a == {(2, 1), (2, 2), (4, 1)}
    assert {(lay.context, lay.model) for lay in lays if lay.attention == "ring"} == {
        (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)
    }  # fmt: skip
    # the refused combination: a ring under a schedule of per-stage conds
    gated = ("1f1b", "interleaved", "zerobubble")
    assert not [lay for lay in lays if lay.attention == "ring" and lay.schedule in gated]
    assert {lay.schedule for lay in lays if lay.attention == "ring" and lay.stage > 1} == {
        "gpipe", "circular"
    }  # fmt: skip
    assert {lay.schedule for lay in lays if lay.attention == "all_to_all" and lay.stage > 1} == {
        "gpipe", "1f1b", "circular", "interleaved", "zerobubble"
    }  # fmt: skip
    # each split is a mesh of its own: the layouts of the plain split are those without seq_len
    plain = [str(f) for f in ladders if f.layouts[0].context == 1]
    assert plain == [str(f) for f in long_gpt(seq_len=None)]


def test_the_context_rule_sequence_length_chunks_zigzag_and_limits():
    assert splits(long_gpt(seq_len=256)) == [(1, 1, "")]  # shorter than min_context_seq
    assert splits(long_gpt(seq_len=None)) == [(1, 1, "")]
    # a sequence shorter than the model is wide: the 7.5B GPT (2048 tokens, d_model 4096) gets
    # none, as before there were context axes; 4096 tokens would
    seven = dict(
        num_layers=36,
        num_heads=32,
        hidden=4 * 4096,
        global_batch=512,
        max_model=8,
        zero_stages=(1,),
        remat=(False,),
    )
    assert splits(long_gpt(64, seq_len=2048, d_model=4096, **seven)) == [(1, 1, "")]
    assert (1, 8, "ring") in splits(long_gpt(64, seq_len=4096, d_model=4096, **seven))
    assert splits(long_gpt(seq_len=256, min_context_seq=256)) == [
        (1, 1, ""), (1, 2, "all_to_all"), (1, 2, "ring"), (1, 4, "all_to_all"), (1, 4, "ring")
    ]  # 256 / 8 = 32 tokens a device: fewer than 64  # fmt: skip
    # 520 = 8 x 65: C = 8 splits it, but the zigzag ring needs 2C = 16 chunks
    assert (1, 8, "ring") not in splits(long_gpt(seq_len=520, num_heads=8))
    assert (1, 8, "all_to_all") in splits(long_gpt(seq_len=520, num_heads=8))
    assert (1, 8, "ring") in splits(long_gpt(seq_len=520, num_heads=8, zigzag=False))
    assert splits(long_gpt(max_context=2, attention=("ring",))) == [(1, 1, ""), (1, 2, "ring")]
    with pytest.raises(ValueError, match=r"SearchOptions: attention=\['flash'\]; choose"):
        long_gpt(attention=("flash",))


def test_a_mixture_of_experts_gets_expert_axes_and_no_pipeline_or_context():
    """4 experts on 8 devices: expert = 1, 2, 4 (8 does not divide the experts); no stage axis
    (the MoE GPT has no pipeline layout), no context axis even at seq_len 512 (context and
    expert do not go together), and every micro-batch of a replica splits over the expert
    axis."""
    ladders = long_gpt(num_experts=4)
    assert splits(ladders) == [(1, 1, ""), (2, 1, ""), (4, 1, "")]
    lays = [lay for f in ladders for lay in f.layouts]
    assert all(lay.stage == 1 and lay.context == 1 for lay in lays)
    for lay in lays:
        micro = 16 // lay.data // lay.accumulate_steps
        assert micro % lay.expert == 0, lay
    # data=2 expert=4: 8 sequences a replica, accumulation 1 or 2 (4 would leave 2 per step)
    accums = {lay.accumulate_steps for lay in lays if (lay.data, lay.expert) == (2, 4)}
    assert accums == {1, 2}
    # a global batch of 4: data=2 expert=4 leaves 2 sequences a replica for 4 devices: skipped
    small = long_gpt(num_experts=4, global_batch=4)
    assert (2, 4) not in {(lay.data, lay.expert) for f in small for lay in f.layouts}
    assert splits(long_gpt(num_experts=6)) == [(1, 1, ""), (2, 1, "")]  # 6 experts split by 2
    assert splits(long_gpt(num_experts=8, max_expert=4)) == [(1, 1, ""), (2, 1, ""), (4, 1, "")]
    with pytest.raises(ValueError, match=r"ModelSizes: num_experts must be an int >= 0"):
        long_gpt(num_experts=-1)


def test_layouts_with_context_and_expert_axes():
    ring = rp.planner.Layout(data=2, context=4)
    assert ring.attention == "ring" and str(ring) == "data=2 context=4 ring"
    assert ring.mesh_shape == {"data": 2, "context": 4} and ring.num_devices == 8
    a2a = rp.planner.Layout(data=1, stage=2, schedule="1f1b", microbatches=4, context=2,
                    attention="all_to_all", model=2, zero_stage=1)  # fmt: skip
    assert str(a2a) == "data=1 stage=2 1f1b M=4 context=2 all_to_all model=2 zero=1"
    assert list(a2a.mesh_shape) == ["data", "stage", "context", "model"]  # the mesh's order
    moe = rp.planner.Layout(data=2, expert=4, accumulate_steps=2)
    assert repr(moe) == "Layout(data=2 expert=4 accum=2)" and moe.attention is None
    assert moe.mesh_shape == {"data": 2, "expert": 4}
    assert rp.planner.Layout(**a2a.to_dict()) == a2a  # what worker processes send back
    with pytest.raises(ValueError, match=r"attention='ring' is how attention crosses a context"):
        rp.planner.Layout(data=8, attention="ring")
    with pytest.raises(ValueError, match=r"attention must be one of 'ring', 'all_to_all'"):
        rp.planner.Layout(data=2, context=4, attention="flash")
    with pytest.raises(ValueError, match=r"Layout: context must be an int >= 1"):
        rp.planner.Layout(context=0)


# -- the time model -------------------------------------------------------------------------------

HW = rp.planner.Hardware("toy", peak_flops=1e12, memory_bytes="1GiB", ici_bandwidth=1e10,
                 dcn_bandwidth=1e9, island_size=4, collective_latency=1e-3)  # fmt: skip


def test_token_axis_collectives_are_priced_by_the_link_their_groups_cross():
    """data=2 x context=4 on islands of 4: the ring's groups are 4 neighbours (ICI), the data
    axis's stride 4 and spans 8 (DCN). A context or expert axis of 8 spans two islands (DCN);
    expert pairs of data=4 x expert=2 are neighbours (ICI)."""
    step = CompiledStep(
        mesh={"data": 2, "context": 4}, memory={}, flops=1e12,
        collectives=(
            CollectiveCost("collective-permute", ("context",), 1e8, 10),
            CollectiveCost("all-to-all", ("context",), 2e8, 4),
            CollectiveCost("all-reduce", ("data",), 1e9, 1),
        ),
    )  # fmt: skip
    t = cost_model.model_time(step, HW)
    assert t.ici == pytest.approx(3e8 / 1e10 + 14 * 1e-3)
    assert t.dcn == pytest.approx(1e9 / 1e9 + 1e-3)
    wide = dataclasses.replace(step, mesh={"data": 1, "context": 8})
    assert cost_model.model_time(wide, HW).dcn > 3e8 / 1e9
    assert not cost_model.crosses_dcn(("expert",), {"data": 4, "expert": 2}, 4)
    assert cost_model.crosses_dcn(("expert",), {"data": 1, "expert": 8}, 4)


def test_overlap_hides_gradient_reductions_over_token_axes_not_their_activations():
    """The all-reduce over context sums the gradients of each device's tokens (hideable, as the
    data axis's); the ring's sends and the expert all-to-alls carry activations (exposed)."""
    mk = lambda kind, axes: CollectiveCost(kind, axes, 1e9, 1)
    assert cost_model.hideable(mk("all-reduce", ("context",)))
    assert cost_model.hideable(mk("reduce-scatter", ("data", "expert")))
    assert cost_model.hideable(mk("all-gather", ("data",)))  # ZeRO's gathers
    assert not cost_model.hideable(mk("all-gather", ("context",)))
    assert not cost_model.hideable(mk("all-to-all", ("expert",)))
    assert not cost_model.hideable(mk("collective-permute", ("context",)))
    assert not cost_model.hideable(mk("all-reduce", ("model",)))
    assert not cost_model.hideable(mk("all-reduce", ("data", "model")))
    step = CompiledStep(
        mesh={"data": 1, "context": 4}, memory={}, flops=10e12,
        collectives=(mk("all-reduce", ("context",)), mk("collective-permute", ("context",))),
    )  # fmt: skip
    t = cost_model.model_time(step, HW, overlap=1.0)
    assert t.hidden == pytest.approx(1e9 / 1e10 + 1e-3)
    assert t.total == pytest.approx(10 + 1e9 / 1e10 + 1e-3)


# -- compiled plans -------------------------------------------------------------------------------


def block_bytes(config, batch, data, context):
    """One device's K (or V) block: [B / data, S / C, H, Dh] in fp32."""
    return (batch // data) * (config.seq_len // context) * config.d_model * 4


def by_kind(outcome, kind, axes):
    found = [c for c in outcome.compiled.collectives if c.kind == kind and c.axes == axes]
    return sum(c.wire_bytes for c in found), sum(c.count for c in found)


RING = rp.planner.Layout(data=2, context=4)
ALL_TO_ALL = rp.planner.Layout(data=2, context=4, attention="all_to_all")


@pytest.fixture(scope="module")
def context_plan():
    """The GPT (2 layers, seq 128, 4 heads) on data=2 x context=4, ring and all-to-all, planned
    here: each compiled once for the tests below."""
    return rp.plan(plan_jobs.context_gpt_build, [RING, ALL_TO_ALL], hardware="tpu-v5e",
                   memory="1GiB", workers=0)  # fmt: skip


@pytest.mark.slow
def test_a_plan_prices_the_ring_and_the_all_to_all_of_a_context_layout(context_plan):
    """The ring sends 2 (C-1) K/V blocks a layer forward and 2 (C-1) + 2 C backward (K, V,
    dK, dV and their trip home), the all-to-all 4 local activation blocks a layer forward and
    4 backward, each (C-1)/C of it on the wire; the modelled time spends them at the ICI
    bandwidth."""
    config, batch, c = plan_jobs.CONTEXT, plan_jobs.CONTEXT_BATCH, 4
    layers = config.num_layers
    ring, a2a = RING, ALL_TO_ALL
    report = context_plan
    assert report.compiled == 2 and len(report.ranked) == 2
    got = {str(cand.layout): cand for cand in report.ranked}
    block = block_bytes(config, batch, 2, c)
    blocks = layers * (2 * (c - 1) + 2 * (c - 1) + 2 * c)
    permute, count = by_kind(got[str(ring)].outcome, "collective-permute", ("context",))
    assert (permute, count) == (blocks * block, blocks)  # each block a send of its own
    all_to_all, count = by_kind(got[str(a2a)].outcome, "all-to-all", ("context",))
    assert all_to_all == pytest.approx(layers * 8 * block * (c - 1) / c)
    assert count == layers * 8
    hw = report.hardware
    for cand, sent in ((got[str(ring)], permute), (got[str(a2a)], all_to_all)):
        assert cand.time.ici >= sent / hw.ici_bandwidth and cand.time.dcn == 0
    assert not by_kind(got[str(ring)].outcome, "all-to-all", ("context",))[1]
    assert not by_kind(got[str(a2a)].outcome, "collective-permute", ("context",))[1]


@pytest.mark.slow
def test_the_plans_collective_bytes_are_those_of_repl_explain(context_plan):
    """A ring layout's collectives as the plan holds them (what it prices) against
    `repl.explain`'s report of the same layout, kind by kind and axes by axes, within 5%."""
    layout = RING
    (planned,) = [c for c in context_plan.ranked if c.layout == layout]
    mine: dict = {}
    for col in planned.outcome.compiled.collectives:
        mine[col.kind, col.axes] = mine.get((col.kind, col.axes), 0.0) + col.wire_bytes
    repl, step_fn, state, *args = plan_jobs.context_gpt_build(layout)
    theirs: dict = {}
    for g in repl.explain(step_fn, state, *args, stage_costs=False).collective_summary():
        key = (g["kind"], tuple(g["axes"]))
        theirs[key] = theirs.get(key, 0.0) + g["wire_bytes"]
    assert ("collective-permute", ("context",)) in mine
    assert mine.keys() == theirs.keys()
    for key, value in mine.items():
        assert value == pytest.approx(theirs[key], rel=0.05), key


@pytest.mark.slow
def test_a_plan_prices_the_expert_all_to_alls_of_a_mixture_of_experts():
    """The MoE GPT (2 MoE layers of 4 experts, seq 16, batch 16) on data=2 x expert=4: each MoE
    layer sends its capacity buffer [G_local, E, C_cap, D] to the experts and back, forward and
    backward (4 all-to-alls), (N-1)/N of it leaving each device, priced at the ICI bandwidth."""
    config = plan_jobs.MOE
    n, data = 4, 2
    groups = plan_jobs.BATCH // data // n
    capacity = math.ceil(
        config.capacity_factor * config.seq_len * config.top_k / config.num_experts
    )
    buffer = groups * config.num_experts * capacity * config.d_model * 4
    layout = rp.planner.Layout(data=data, expert=n)
    report = rp.plan(plan_jobs.moe_gpt_build, [layout], hardware="tpu-v5e", memory="1GiB",
                     workers=0)  # fmt: skip
    (cand,) = report.ranked
    sent, count = by_kind(cand.outcome, "all-to-all", ("expert",))
    assert count == 4 * config.num_moe_layers
    assert sent == pytest.approx(4 * config.num_moe_layers * buffer * (n - 1) / n)
    assert cand.time.ici >= sent / report.hardware.ici_bandwidth
