"""rp.plan: the layouts enumerated for a model, the pruning and search of each ladder, and the
time model, each against hand-worked cases; the option records and the old keywords they
replace; a real plan of the GPT, in this process and in worker processes with another device
count."""

import dataclasses
import inspect
import types
import warnings

import plan_jobs
import pytest

import replicator as rp
from replicator._src.report import cost_model
from replicator._src.report.cost_model import CollectiveCost, CompiledStep
from replicator.planner import AxisLimits, ModelSizes, SearchOptions

# -- enumeration ----------------------------------------------------------------------------------


def meshes(ladders):
    return sorted({(f.layouts[0].data, f.layouts[0].stage, f.layouts[0].model) for f in ladders})


def layouts_of(n, search=None, limits=None, **sizes):
    """`enumerate_layouts` of ``n`` devices for the model of ``sizes`` (`ModelSizes`' fields)."""
    return rp.planner.enumerate_layouts(n, sizes=ModelSizes(**sizes), search=search, limits=limits)


def test_enumeration_of_8_devices_for_4_layers_and_4_heads():
    """data x stage x model = 8 with model | 4 heads (not 8), stage | 4 layers, data | 16;
    worked by hand: 8 meshes."""
    ladders = layouts_of(8, global_batch=16, num_layers=4, num_heads=4, hidden=16)
    assert meshes(ladders) == [
        (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)
    ]  # fmt: skip
    for f in ladders:
        assert {lay.num_devices for lay in f.layouts} == {8}
    by_mesh = {}
    for f in ladders:
        lay = f.layouts[0]
        by_mesh.setdefault((lay.data, lay.stage, lay.model), set()).add(
            (lay.schedule, lay.microbatches, lay.repeats, lay.zero_stage)
        )
    # data=2, stage=4: a replica's 8 examples; M = 2K = 8 (4K = 16 does not divide 8);
    # circular and interleaved need 4 layers to split into K*V = 8 virtual stages: not listed
    assert by_mesh[(2, 4, 1)] == {
        (s, 8, 1, z) for s in ("gpipe", "1f1b", "zerobubble") for z in (0, 1, 3)
    }  # ZeRO-2 is ZeRO-1's program without accumulation: not listed for pipelines
    # data=4, stage=2: 4 examples a replica: M = 2K = 4 (a multiple of K, for interleaved);
    # circular and interleaved with V=2 fit 4 layers (K*V = 4)
    assert by_mesh[(4, 2, 1)] == {
        (s, 4, 2 if s in ("circular", "interleaved") else 1, z)
        for s in ("gpipe", "1f1b", "circular", "interleaved", "zerobubble")
        for z in (0, 1, 3)
    }
    # no pipeline: ZeRO 0, 1, 3, and ZeRO-2 only with accumulation
    assert by_mesh[(8, 1, 1)] == {(None, 1, 1, z) for z in (0, 1, 2, 3)}


def test_interleaved_is_listed_where_its_micro_batches_and_layers_allow():
    """Interleaved 1F1B needs M a multiple of K (and M >= K) and the layers in K*V pieces.
    12 layers, 48 examples, model=1: stage 1, 2, 4 divide the layers (8 does not); K*V = 4
    divides 12 at stage 2, 8 does not at stage 4. stage=2 (data=4): 12 examples a replica, so
    of M in (2, 3, 4, 6) all divide it; 1F1B takes every M >= 2, interleaved the even ones.
    stage=4 (data=2): 24 a replica; 1F1B takes 4 and 6 (>= K), interleaved none (layers)."""
    search = SearchOptions(schedules=("1f1b", "interleaved"), zero_stages=(0,),
                           microbatches=(2, 3, 4, 6), remat=(False,))  # fmt: skip
    ladders = layouts_of(8, search, AxisLimits(max_model=1), global_batch=48, num_layers=12)
    piped = sorted(
        (lay.stage, lay.schedule, lay.microbatches, lay.repeats)
        for f in ladders for lay in f.layouts if lay.stage > 1
    )  # fmt: skip
    assert piped == [
        (2, "1f1b", 2, 1), (2, "1f1b", 3, 1), (2, "1f1b", 4, 1), (2, "1f1b", 6, 1),
        (2, "interleaved", 2, 2), (2, "interleaved", 4, 2), (2, "interleaved", 6, 2),
        (4, "1f1b", 4, 1), (4, "1f1b", 6, 1),
    ]  # fmt: skip
    # By default (2K, 4K, else the largest M allowed): 12 examples, 8 layers, V=2. stage=2
    # (data=4, 3 a replica): 1F1B falls back to M=3; no even M divides 3. stage=4 (data=2, 6
    # a replica): 1F1B M=6; no multiple of 4 divides 6. stage=8 (data=1, 12 examples): 1F1B
    # M=12; interleaved needs 16 layers. Interleaved has no layout at all.
    search = SearchOptions(schedules=("1f1b", "interleaved"), zero_stages=(0,), remat=(False,))
    ladders = layouts_of(8, search, AxisLimits(max_model=1), global_batch=12, num_layers=8)
    piped = sorted((lay.stage, lay.schedule, lay.microbatches)
                   for f in ladders for lay in f.layouts if lay.stage > 1)  # fmt: skip
    assert piped == [(2, "1f1b", 3), (4, "1f1b", 6), (8, "1f1b", 12)]
    # repeats=4: K*V = 8 layers at stage 2 only (data=4, 4 a replica: M = 2K = 4; 4K = 8 does
    # not divide 4)
    ladders = layouts_of(8, SearchOptions(schedules=("interleaved",), repeats=4),
                          AxisLimits(max_model=1), global_batch=16, num_layers=8)  # fmt: skip
    assert {(lay.stage, lay.microbatches, lay.repeats) for f in ladders for lay in f.layouts
            if lay.stage > 1} == {(2, 4, 4)}  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"SearchOptions: the interleaved schedule needs repeats >= 2.*got "
        r"repeats=1. Use repeats=2 or more, or leave 'interleaved' out",
    ):
        SearchOptions(repeats=1)
    assert layouts_of(8, SearchOptions(repeats=1, schedules=("circular",)), global_batch=16,
                      num_layers=8)  # fmt: skip


def test_a_ladder_is_ordered_fastest_first():
    """No remat, then "dots", then full remat; within each, fewer accumulation steps first (2
    examples per replica: 1 or 2 steps); ZeRO-2 only with accumulation; pipelines of every
    schedule under each policy."""
    ladders = layouts_of(8, global_batch=16, num_layers=4, num_heads=4)
    first = {str(f): f for f in ladders}
    assert first["data=8"].groups == tuple(
        (rp.planner.Layout(data=8, remat=r), rp.planner.Layout(data=8, accumulate_steps=2, remat=r))
        for r in (False, "dots", True)
    )
    assert first["data=8 zero=2 accum=2"].layouts == [
        rp.planner.Layout(data=8, zero_stage=2, accumulate_steps=2, remat=r)
        for r in (False, "dots", True)
    ]
    for schedule in ("1f1b", "interleaved", "zerobubble"):
        some = [f for f in ladders if f.layouts[0].schedule == schedule]
        assert some and all([lay.remat for lay in f.layouts] == [False, "dots", True] for f in some)


def test_enumeration_options_and_refusals():
    search = SearchOptions(schedules=("1f1b",), zero_stages=(1,), microbatches=(4, 8),
                           remat=(True,))  # fmt: skip
    limits = AxisLimits(max_model=2, max_stage=2)
    ladders = layouts_of(8, search, limits, global_batch=16, num_layers=8, num_heads=8)
    assert meshes(ladders) == [(2, 2, 2), (4, 1, 2), (4, 2, 1), (8, 1, 1)]
    assert {f.layouts[0].microbatches for f in ladders if f.layouts[0].stage > 1} == {4, 8}
    assert all(lay.remat for f in ladders for lay in f.layouts)
    with pytest.raises(ValueError, match=r"SearchOptions: schedules=\['zb'\]; choose"):
        SearchOptions(schedules=("zb",))
    with pytest.raises(ValueError, match=r"ModelSizes: global_batch must be an int >= 1"):
        ModelSizes(global_batch=0, num_layers=4)
    with pytest.raises(ValueError, match=r"enumerate_layouts: num_devices must be an int >= 1"):
        layouts_of(0, global_batch=8, num_layers=4)
    with pytest.raises(TypeError, match=r"enumerate_layouts\(\) missing the keyword argument "
                       r"'sizes'"):  # fmt: skip
        rp.planner.enumerate_layouts(8)
    with pytest.raises(TypeError, match=r"enumerate_layouts: search must be an "
                       r"rp.planner.SearchOptions"):  # fmt: skip
        layouts_of(8, limits, global_batch=8, num_layers=4)


def test_the_cli_config_knows_the_planners_schedules():
    """The CLI's config keeps its own lists (importing the planner imports jax): the same
    schedules, and the same that cannot run a ring over a context axis."""
    from replicator._src.planner import layouts
    from replicator.cli.config import constants

    assert sorted(constants.SCHEDULES) == sorted(layouts.SCHEDULES)
    assert constants.RING_IN_ONE_COND == layouts.GATED


def test_layout_checks_and_names():
    lay = rp.planner.Layout(data=2, stage=4, schedule="1f1b", microbatches=8)
    assert not lay.remat and str(lay) == "data=2 stage=4 1f1b M=8"  # 1F1B keeps residuals
    assert str(rp.planner.Layout(data=8, remat="full")) == "data=8 remat"
    with pytest.raises(ValueError, match=r"Layout: remat must be False \('none'\), 'dots', 'save_"):
        rp.planner.Layout(data=8, remat="some")
    assert lay.mesh_shape == {"data": 2, "stage": 4} and lay.num_devices == 8
    assert rp.planner.Layout(data=2, model=4).mesh_shape == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match=r"stage=4 needs a schedule"):
        rp.planner.Layout(data=2, stage=4)
    with pytest.raises(ValueError, match=r"use microbatches, not accumulate_steps"):
        rp.planner.Layout(data=2, stage=2, schedule="gpipe", accumulate_steps=2)
    with pytest.raises(ValueError, match=r"Layout: zero_stage must be 0, 1, 2 or 3"):
        rp.planner.Layout(zero_stage=4)
    inter = rp.planner.Layout(data=2, stage=4, schedule="interleaved", microbatches=8, repeats=2)
    assert str(inter) == "data=2 stage=4 interleaved V=2 M=8"
    assert str(dataclasses.replace(inter, schedule="circular")) == "data=2 stage=4 circular V=2 M=8"
    with pytest.raises(ValueError, match=r"Layout: the interleaved schedule needs repeats >= 2"):
        rp.planner.Layout(data=2, stage=4, schedule="interleaved", microbatches=8)
    with pytest.raises(
        ValueError,
        match=r"repeats \(virtual stages\) are for the circular and "
        r"interleaved schedules; got repeats=2 with schedule='1f1b'",
    ):
        rp.planner.Layout(data=2, stage=4, schedule="1f1b", microbatches=8, repeats=2)


# -- the option records, and the keywords they replace ------------------------------------------

OLD_ENUMERATION = dict(  # a keyword for every field of the three records, as before them
    global_batch=48, num_layers=12, num_heads=4, hidden=16, seq_len=512, d_model=32,
    num_experts=0, zigzag=False, schedules=("1f1b", "circular"), zero_stages=(1, 3),
    microbatches=(2, 4), repeats=3, accumulate_steps=(1, 2), remat=("full", "none"),
    attention=("ring",), max_model=2, max_stage=4, max_context=4, max_expert=2,
    min_context_seq=256,
)  # fmt: skip


def test_the_records_hold_every_old_keyword_once():
    """Each keyword `enumerate_layouts` took is a field of exactly one record, and the records
    have no other fields; `plan`'s old keywords are `TimingOptions`' and `PricingOptions`'."""
    fields = [f.name for cls in (ModelSizes, SearchOptions, AxisLimits)
              for f in dataclasses.fields(cls)]  # fmt: skip
    assert sorted(fields) == sorted(OLD_ENUMERATION)
    plan_fields = [f.name for cls in (rp.planner.TimingOptions, rp.planner.PricingOptions)
                   for f in dataclasses.fields(cls)]  # fmt: skip
    assert sorted(plan_fields) == [
        "compile_top",
        "model",
        "model_flops",
        "overlap",
        "skip_slower",
        "time_limit",
    ]  # (the last two newer than the keywords)
    for fn in (rp.planner.enumerate_layouts, rp.plan):
        assert len(inspect.signature(fn).parameters) <= 10, fn


def test_old_enumeration_keywords_work_with_a_warning_each_at_the_callers_line():
    """Every old keyword gives the ladders the records give, with a DeprecationWarning per
    keyword that names the record to use, attributed to this file and line."""
    sizes = ModelSizes(**{k: OLD_ENUMERATION[k] for k in
                          [f.name for f in dataclasses.fields(ModelSizes)]})  # fmt: skip
    search = SearchOptions(**{k: OLD_ENUMERATION[k] for k in
                              [f.name for f in dataclasses.fields(SearchOptions)]})  # fmt: skip
    limits = AxisLimits(**{k: OLD_ENUMERATION[k] for k in
                           [f.name for f in dataclasses.fields(AxisLimits)]})  # fmt: skip
    new = rp.planner.enumerate_layouts(8, sizes=sizes, search=search, limits=limits)
    assert {lay.context for f in new for lay in f.layouts} == {1, 2, 4}  # the options count
    assert {lay.schedule for f in new for lay in f.layouts} == {None, "1f1b", "circular"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        old = rp.planner.enumerate_layouts(8, **OLD_ENUMERATION)
    assert old == new
    assert len(caught) == len(OLD_ENUMERATION)
    for w, key in zip(caught, OLD_ENUMERATION, strict=True):
        record = "sizes=rp.planner.ModelSizes" if key in sizes.__dataclass_fields__ else (
            "search=rp.planner.SearchOptions" if key in search.__dataclass_fields__
            else "limits=rp.planner.AxisLimits")  # fmt: skip
        assert w.category is DeprecationWarning
        assert str(w.message) == (
            f"enumerate_layouts({key}=...) is deprecated and will be removed in the next "
            f"release; use {record}({key}=...)."
        )
        assert (w.filename, w.lineno) == (__file__, line)


def test_old_keywords_refused_when_misspelt_or_given_with_their_record():
    with pytest.raises(TypeError, match=r"enumerate_layouts\(\) got an unexpected keyword "
                       r"argument 'shedules'"):  # fmt: skip
        rp.planner.enumerate_layouts(8, global_batch=8, num_layers=4, shedules=("1f1b",))
    with pytest.raises(ValueError, match=r"enumerate_layouts: max_model= is the old spelling "
                       r"of limits=rp.planner.AxisLimits\(max_model=...\), and limits= is "
                       r"given too; give max_model in limits= only."):  # fmt: skip
        rp.planner.enumerate_layouts(8, sizes=ModelSizes(global_batch=8, num_layers=4),
                                     limits=AxisLimits(max_stage=1), max_model=2)  # fmt: skip
    with pytest.raises(TypeError, match=r"rp.plan\(\) got an unexpected keyword argument "
                       r"'overlapp'"):  # fmt: skip
        rp.plan(plan_jobs.fake_build, [rp.planner.Layout(data=8)], hardware=HW, overlapp=0.5)
    with pytest.raises(ValueError, match=r"rp.plan: overlap= is the old spelling of "
                       r"timing=rp.planner.TimingOptions\(overlap=...\)"):  # fmt: skip
        rp.plan(plan_jobs.fake_build, [rp.planner.Layout(data=8)], hardware=HW,
                timing=rp.planner.TimingOptions(), overlap=0.5)  # fmt: skip


def test_old_plan_keywords_give_the_same_plan_with_a_warning_each():
    """``model_flops=`` and ``overlap=`` (`TimingOptions`), ``model=`` and ``compile_top=``
    (`PricingOptions`): the same report as the records give, a warning each at this line."""
    shape = rp.planner.ModelShape(num_layers=1, d_model=8, num_heads=1, kv_heads=1, head_dim=8,
                                  hidden=32, vocab=16, seq_len=8, global_batch=8)  # fmt: skip
    layouts = [rp.planner.Layout(data=8, accumulate_steps=a) for a in (1, 2)]
    timing = rp.planner.TimingOptions(overlap=0.5, model_flops=1e12)
    pricing = rp.planner.PricingOptions(model=shape, compile_top=1)

    def figures(report):
        return [(str(c.layout), c.outcome.status, c.time, c.priced_time)
                for c in (*report.ranked, *report.rejected)]  # fmt: skip

    new = rp.plan(plan_jobs.fake_build, layouts, hardware=HW, memory="1MiB", workers=0,
                  timing=timing, pricing=pricing)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        old = rp.plan(plan_jobs.fake_build, layouts, hardware=HW, memory="1MiB", workers=0,
                      overlap=0.5, model_flops=1e12, model=shape, compile_top=1)  # fmt: skip
    assert figures(old) == figures(new) and old.priced == new.priced == 2
    assert (old.overlap, old.model_flops) == (0.5, 1e12) and new.ranked[0].time.mfu
    assert new.compiled == 1  # compile_top=1: the other layout priced, not compiled
    assert [str(w.message).split(" is ")[0] for w in caught] == [
        "rp.plan(overlap=...)", "rp.plan(model_flops=...)", "rp.plan(model=...)",
        "rp.plan(compile_top=...)",
    ]  # fmt: skip
    assert "use pricing=rp.planner.PricingOptions(compile_top=...)." in str(caught[-1].message)
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unpriced = rp.plan(plan_jobs.fake_build, layouts, hardware=HW, memory="1MiB",
                           workers=0, model=None, compile_top=1)  # fmt: skip
    assert unpriced.priced == 0 and unpriced.compiled == 2  # model=None: nothing priced
    assert [str(w.message).split(" is ")[0] for w in caught] == [
        "rp.plan(model=...)", "rp.plan(compile_top=...)"
    ]  # fmt: skip


def test_the_records_check_their_fields():
    assert SearchOptions(remat=["full", "dots", "none", False]).remat == (False, "dots", True)
    assert SearchOptions(schedules="1f1b").schedules == ("1f1b",)  # one choice, given bare
    for make, match in [
        (lambda: SearchOptions(zero_stages=(4,)), r"SearchOptions: zero_stages=\[4\]; choose"),
        (lambda: SearchOptions(remat=()), r"SearchOptions: remat must hold False, 'dots' or"),
        (lambda: SearchOptions(remat=("some",)), r"SearchOptions: remat must be False"),
        (lambda: SearchOptions(attention=("flash",)), r"SearchOptions: attention=\['flash'\]"),
        (lambda: ModelSizes(global_batch=8, num_layers=2, num_heads=0),
         r"ModelSizes: num_heads must be an int >= 1 or None; got 0"),
        (lambda: ModelSizes(global_batch=8, num_layers=2, num_experts=-1),
         r"ModelSizes: num_experts must be an int >= 0"),
        (lambda: AxisLimits(max_model=0), r"AxisLimits: max_model must be an int >= 1 or None"),
        (lambda: rp.planner.TimingOptions(overlap=2), r"overlap must be between 0 and 1"),
        (lambda: rp.planner.TimingOptions(model_flops=0), r"model_flops must be a number > 0"),
        (lambda: rp.planner.PricingOptions(model="gpt"), r"model must be an rp.planner.Model"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        AxisLimits().max_model = 2


# -- the time model -------------------------------------------------------------------------------

HW = rp.planner.Hardware("toy", peak_flops=1e12, memory_bytes="1GiB", ici_bandwidth=1e10,
                 dcn_bandwidth=1e9, island_size=4, collective_latency=1e-3)  # fmt: skip


def test_collectives_cross_the_dcn_when_their_groups_leave_an_island():
    """Mesh data=4 x model=2 with islands of 4 devices: model groups are 2 neighbours (ICI);
    data groups stride 2 and span 8 devices (DCN)."""
    mesh = {"data": 4, "model": 2}
    assert not cost_model.crosses_dcn(("model",), mesh, 4)
    assert cost_model.crosses_dcn(("data",), mesh, 4)
    assert not cost_model.crosses_dcn(("data",), {"data": 2, "model": 2}, 4)
    assert cost_model.crosses_dcn(("data", "model"), mesh, 4)
    assert not cost_model.crosses_dcn((), mesh, 4)


def test_modelled_time_worked_by_hand():
    """8 devices (data 4 x model 2), islands of 4. Per device: 3e12 FLOPs -> 3 s at 1e12;
    a model all-reduce sending 2e10 bytes 10 times over ICI at 1e10 B/s -> 2 s + 10 ms latency;
    a data all-reduce sending 1e9 bytes once over DCN at 1e9 B/s -> 1 s + 1 ms. With overlap
    0.5, half the data-axis second hides behind compute."""
    step = CompiledStep(
        mesh={"data": 4, "model": 2},
        memory={},
        flops=3e12,
        collectives=(
            CollectiveCost("all-reduce", ("model",), 2e10, 10),
            CollectiveCost("all-reduce", ("data",), 1e9, 1),
        ),
    )
    t = cost_model.model_time(step, HW, model_flops=8 * 2e12)
    assert t.compute == 3.0 and t.bubble == 0
    assert t.ici == pytest.approx(2.010) and t.dcn == pytest.approx(1.001)
    assert t.total == pytest.approx(6.011) and t.hidden == 0
    assert t.mfu == pytest.approx(16e12 / (8e12 * 6.011))
    half = cost_model.model_time(step, HW, overlap=0.5)
    assert half.hidden == pytest.approx(0.5005) and half.total == pytest.approx(6.011 - 0.5005)
    with pytest.raises(ValueError, match="overlap must be between 0 and 1"):
        cost_model.model_time(step, HW, overlap=2)


def test_shared_devices_add_up_their_work_and_wait_in_no_bubble():
    """Emulated devices share one machine: 8 devices of 1e9 FLOPs each take 8e9 / peak, and a
    1F1B bubble (idle FLOPs) costs nothing, since another device uses the cores."""
    shared = dataclasses.replace(HW, shared=True, collective_latency=0.0, island_size=8)
    step = CompiledStep(
        mesh={"data": 8}, memory={}, flops=1e9, idle_flops=5e8,
        collectives=(CollectiveCost("all-reduce", ("data",), 1e8, 1),),
    )  # fmt: skip
    t = cost_model.model_time(step, shared)
    assert t.compute == pytest.approx(8e-3) and t.bubble == 0
    assert t.ici == pytest.approx(8 * 1e8 / 1e10)
    alone = cost_model.model_time(step, HW)
    assert alone.bubble == pytest.approx(5e-4) and alone.compute == pytest.approx(1e-3)


def note(schedule, bubble, **kw):
    return types.SimpleNamespace(
        schedule=schedule, modelled_bubble=bubble, modelled_time=kw.get("time", 0.0),
        cost_unit=kw.get("unit", "units"),
    )  # fmt: skip


def fake_report(flops, pipelines=()):
    memory = types.SimpleNamespace(arguments=1, outputs=2, aliased=1, temporaries=3, peak=5)
    return types.SimpleNamespace(
        mesh={"data": 2, "stage": 4}, memory=memory, flops=flops, collectives=(),
        pipelines=pipelines, compile_seconds=0.5,
    )  # fmt: skip


def test_pipeline_idle_time_only_where_the_schedule_skips_its_bubble():
    """1F1B (and interleaved 1F1B, ZeroBubble) skip idle ticks: with measured FLOPs the idle
    time is time x bubble; with equal costs it is the device's FLOPs x b / (1 - b). GPipe (and
    circular) compute through their bubble: their FLOPs already hold it."""
    measured = CompiledStep.from_report(
        fake_report(1e9, [note("1f1b", 0.25, time=8e8, unit="flops")])
    )
    assert measured.idle_flops == pytest.approx(2e8) and measured.bubble == 0.25
    equal = CompiledStep.from_report(fake_report(3e9, [note("1f1b", 0.25)]))
    assert equal.idle_flops == pytest.approx(1e9)
    gpipe = CompiledStep.from_report(fake_report(3e9, [note("gpipe", 0.25)]))
    assert gpipe.idle_flops == 0 and gpipe.bubble == 0.25
    # Interleaved 1F1B and ZeroBubble skip their idle ticks as 1F1B does; circular computes
    # through its bubble as GPipe does.
    for skips in ("interleaved", "zerobubble"):
        step = CompiledStep.from_report(fake_report(3e9, [note(skips, 0.25)]))
        assert step.idle_flops == pytest.approx(1e9) and step.bubble == 0.25
    circular = CompiledStep.from_report(fake_report(3e9, [note("circular", 0.25)]))
    assert circular.idle_flops == 0 and circular.bubble == 0.25
    assert CompiledStep.from_dict(equal.to_dict()) == equal


# -- hardware profiles ----------------------------------------------------------------------------


def test_hardware_profiles_have_sources_and_load_from_files(tmp_path):
    for name in ("tpu-v4", "tpu-v5e", "tpu-v5p", "h100", "a100"):
        profile = rp.planner.hardware_profile(name)
        assert profile.source and profile.peak_flops >= 1.9e14 and profile.island_size >= 8
    assert rp.planner.hardware_profile("tpu-v5e").memory_bytes == 16 * 2**30
    path = tmp_path / "mine.yaml"
    path.write_text(
        "name: mine\npeak_flops: 1.0e+15\nmemory_bytes: 96GB\nici_bandwidth: 4.5e+11\n"
        "dcn_bandwidth: 5.0e+10\nisland_size: 8\nsource: my datasheet\n"
    )
    mine = rp.planner.hardware_profile(str(path))
    assert mine.memory_bytes == 96 * 10**9 and mine.island_size == 8
    with pytest.raises(ValueError, match=r"hardware='tpu-v9' is neither a known profile"):
        rp.planner.hardware_profile("tpu-v9")
    path.write_text("name: mine\npeak_flops: 1.0e+15\n")
    with pytest.raises(ValueError, match=r"missing key\(s\) dcn_bandwidth, ici_bandwidth"):
        rp.planner.hardware_profile(str(path))
    with pytest.raises(ValueError, match=r"memory='16 gigs' is not a size"):
        rp.plan(plan_jobs.fake_build, [rp.planner.Layout(data=8)], hardware=HW, memory="16 gigs")


def test_the_cpu_profile_is_measured_once():
    cpu = rp.planner.hardware_profile("cpu")
    assert cpu.shared and cpu.peak_flops > 1e9 and cpu.ici_bandwidth > 1e8
    assert rp.planner.hardware_profile("cpu") is cpu


# -- the search -----------------------------------------------------------------------------------


def test_a_ladder_is_searched_by_bisection_and_stops_at_the_first_fit():
    """Fake compiled programs whose peak is 1000 / accumulate_steps (+500 without remat) and
    whose state is 100 bytes: with a budget of 260, no-remat layouts never fit (>= 562);
    remat fits from 4 accumulation steps (250). Compiled: the most frugal of each group first,
    then the bisection; everything else is skipped with the reason."""
    plan_jobs.COMPILED.clear()
    ladder = rp.planner.Ladder(tuple(
        tuple(rp.planner.Layout(data=8, accumulate_steps=a, remat=r) for a in (1, 2, 4, 8, 16))
        for r in (False, True)
    ))  # fmt: skip
    report = rp.plan(plan_jobs.fake_build, [ladder], hardware=HW, memory=260, workers=0)
    compiled = [(lay.accumulate_steps, lay.remat) for lay in plan_jobs.COMPILED]
    assert compiled == [(16, False), (16, True), (4, True), (2, True)]
    # accum=16 remat was compiled (to learn the group fits) and fits too; it ranks second
    assert [str(c.layout) for c in report.ranked] == [
        "data=8 accum=4 remat",
        "data=8 accum=16 remat",
    ]
    assert report.best == rp.planner.Layout(data=8, accumulate_steps=4, remat=True)
    status = {str(c.layout): (c.outcome.status, c.outcome.reason) for c in report.rejected}
    assert status["data=8 accum=16"][0] == "too big"
    assert status["data=8 accum=2 remat"] == ("too big", "compiled peak 500 B per device")
    assert status["data=8 remat"][0] == "skipped"
    assert "does not fit" in status["data=8 accum=4"][1]
    assert status["data=8 accum=8 remat"] == (
        "skipped",
        "data=8 accum=4 remat fits with fewer accumulation steps",
    )


def test_a_ladder_whose_state_alone_is_too_big_is_not_compiled():
    plan_jobs.COMPILED.clear()
    ladder = rp.planner.Ladder(
        ((rp.planner.Layout(data=8), rp.planner.Layout(data=8, accumulate_steps=2)),)
    )
    report = rp.plan(plan_jobs.fake_build, [ladder], hardware=HW, memory=99, workers=0)
    assert plan_jobs.COMPILED == [] and report.best is None
    assert {c.outcome.status for c in report.rejected} == {"state too big"}
    assert report.rejected[0].outcome.reason == "its state alone is 100 B per device"
    assert "no layout fits 99 B per device" in str(report)


def test_remat_is_tried_only_with_fewer_accumulation_steps_than_the_fit_without_it():
    """Without remat the fit is at 2 steps (peak 1000); remat does more work, so only its
    1-step layout may be faster, and it is the only remat layout compiled."""
    plan_jobs.COMPILED.clear()
    ladder = rp.planner.Ladder(tuple(
        tuple(rp.planner.Layout(data=8, accumulate_steps=a, remat=r) for a in (1, 2, 4))
        for r in (False, True)
    ))  # fmt: skip
    report = rp.plan(plan_jobs.fake_build, [ladder], hardware=HW, memory=1000, workers=0)
    compiled = [(lay.accumulate_steps, lay.remat) for lay in plan_jobs.COMPILED]
    assert compiled == [(4, False), (2, False), (1, False), (1, True)]
    assert [str(c.layout) for c in report.ranked] == [
        "data=8 accum=2",
        "data=8 accum=4",
        "data=8 remat",
    ]
    skipped = {str(c.layout): c.outcome.reason for c in report.rejected}
    assert skipped["data=8 accum=2 remat"] == "data=8 accum=2 fits and comes first in its ladder"


def test_the_table_fits_120_columns_and_the_wide_one_and_the_json_have_every_figure():
    """The default table: the columns to pick a layout by (peak, step, MFU), no line over 120
    characters, with the longest layout names and reasons; ``wide=True``: the step's parts and
    the priced figures too; `to_json` carries every figure of the wide table."""
    import json

    shape = rp.planner.ModelShape(num_layers=4, d_model=64, num_heads=4, kv_heads=4, head_dim=16,
                                  hidden=256, vocab=256, seq_len=64, global_batch=16)  # fmt: skip
    layouts = [
        rp.planner.Layout(data=1, stage=2, schedule="interleaved", microbatches=4, repeats=2,
                          context=2, attention="all_to_all", model=2, zero_stage=1,
                          remat="dots"),
        rp.planner.Layout(data=2, stage=2, schedule="zerobubble", microbatches=8, model=2,
                          zero_stage=3, remat=True),
        rp.planner.Layout(data=8, zero_stage=2, accumulate_steps=16),
        rp.planner.Layout(data=8),  # refused, with a long reason
    ]  # fmt: skip
    why = "the reason a layout is refused, " * 6

    def build(layout):
        if layout == layouts[-1]:
            raise ValueError(why)
        return plan_jobs.fake_build(layout)

    report = rp.plan(build, layouts, hardware=HW, memory="1GiB", workers=0,
                     timing=rp.planner.TimingOptions(model_flops=1e12),
                     pricing=rp.planner.PricingOptions(model=shape, compile_top=4,
                                                       skip_slower=None))  # fmt: skip
    narrow, wide = report.table(), report.table(wide=True)
    assert max(map(len, narrow.splitlines())) <= 120, narrow
    assert max(map(len, wide.splitlines())) > 120
    header = lambda text: next(line for line in text.splitlines() if "peak/device" in line)
    names = lambda text: [c.strip() for c in header(text).split("┃")[1:-1]]
    assert names(narrow) == ["#", "layout", "peak/device", "step", "MFU"]
    assert names(wide) == ["#", "layout", "peak/device", "step", "compute", "bubble", "ICI",
                           "DCN", "MFU", "priced peak", "priced step"]  # fmt: skip
    assert "table(wide=True) or --wide" in narrow and "--wide" not in wide
    words = narrow.replace("│", " ").split()
    for name in layouts[:3]:  # wrapped in its cell where it is long
        assert str(name) in wide and all(word in words for word in str(name).split())
    assert str(layouts[-1]) in narrow and "ValueError: the reason a layout" in narrow
    assert why.strip() in " ".join(" ".join(wide.split("│")).split())  # wrapped, whole
    data = json.loads(report.to_json())
    assert data["compiled"] == report.compiled == 3 and len(data["ranked"]) == 3
    for c, raw in zip(report.ranked, data["ranked"], strict=True):
        t, p = c.time, c.priced
        assert raw["compiled"]["memory"]["peak"] == c.peak_bytes
        assert raw["time"] == dataclasses.asdict(t)  # total, compute, bubble, ICI, DCN, MFU
        assert raw["priced"]["peak_bytes"] == p.peak_bytes
        assert raw["priced_time"]["total"] == c.priced_time.total


def test_a_refused_layout_is_rejected_with_the_librarys_reason():
    plan_jobs.COMPILED.clear()
    report = rp.plan(plan_jobs.refusing_build, [rp.planner.Layout(data=8)], hardware=HW, workers=0)
    (c,) = report.rejected
    assert c.outcome.status == "error" and "ValueError: no such layout here" in c.outcome.reason


def test_a_worker_that_dies_takes_only_its_ladder_with_it():
    """The process compiling data=4 x model=2 dies; that ladder is an error saying so, its
    ZeRO-1 sibling (searched by the same process) is searched again on its own, and a new
    worker plans the ladders after it."""
    layouts = [
        rp.planner.Layout(data=8),
        rp.planner.Layout(data=4, model=2),
        rp.planner.Layout(data=4, model=2, zero_stage=1),
        rp.planner.Layout(data=2, model=4),
    ]
    report = rp.plan(plan_jobs.crashing_build, layouts, hardware=HW, memory=2000, workers=1)
    ranked = sorted(str(c.layout) for c in report.ranked)
    assert ranked == ["data=2 model=4", "data=4 model=2 zero=1", "data=8"]
    (dead,) = report.rejected
    assert str(dead.layout) == "data=4 model=2" and dead.outcome.status == "error"
    assert "worker process died (exit code 7)" in dead.outcome.reason


def test_a_compile_that_a_fit_found_since_makes_needless_is_stopped():
    """Two worker processes: one compiles data=8 (it fits, 1 s a step by ``score``), the other
    data=4 x model=2, priced 2 s (over 1.1 x 1 s) and still compiling, is stopped (its process
    ended) with the reason, long before its build ends; data=2 x model=4, priced as fast, is
    compiled by a new worker."""
    import time

    from replicator._src.planner import search, workers

    lays = [rp.planner.Layout(data=8), rp.planner.Layout(data=4, model=2),
            rp.planner.Layout(data=2, model=4)]  # fmt: skip
    ladders = [rp.planner.Ladder(((lay,),)) for lay in lays]
    price = {lays[0]: 0.9, lays[1]: 2.0, lays[2]: 1.0}.get
    start = time.perf_counter()
    out = workers.run("plan_jobs:slow_build", ladders, 2000, 8, 2, False, lambda o: 1.0, price, 1.1)
    took = time.perf_counter() - start
    status = {str(o.layout): (o.status, o.reason) for o in out}
    assert status["data=8"][0] == search.FITS
    assert status["data=4 model=2"] == (
        search.SKIPPED,
        "stopped: priced 2000 ms, over 1.1 x the 1000 ms of data=8, compiled and fits",
    )
    assert status["data=2 model=4"][0] == search.FITS  # compiled by a worker started after
    assert took < 300, took  # the 10-minute build was not waited for


def test_plan_refuses_mixed_device_counts_and_bad_workers():
    with pytest.raises(ValueError, match=r"the layouts use \[4, 8\] devices"):
        rp.plan(
            plan_jobs.fake_build,
            [rp.planner.Layout(data=8), rp.planner.Layout(data=4)],
            hardware=HW,
        )
    with pytest.raises(ValueError, match=r"workers=0 compiles in this process, which has 8"):
        rp.plan(plan_jobs.fake_build, [rp.planner.Layout(data=4)], hardware=HW, workers=0)
    with pytest.raises(ValueError, match=r"layouts is empty"):
        rp.plan(plan_jobs.fake_build, [], hardware=HW)


# -- real plans -----------------------------------------------------------------------------------


RANKED = [  # test_a_real_plan_ranks_the_compiled_gpt's
    rp.planner.Layout(data=8),
    rp.planner.Layout(data=4, model=2),
    rp.planner.Layout(data=2, stage=4, schedule="1f1b", microbatches=4),
    rp.planner.Layout(data=2, stage=4, schedule="gpipe", microbatches=4),
]
INTERLEAVED = [  # test_a_real_plan_models_interleaved_1f1b_as_1f1b_with_a_smaller_bubble's
    rp.planner.Layout(data=4, stage=2, schedule="interleaved", microbatches=4, repeats=2),
    rp.planner.Layout(data=4, stage=2, schedule="1f1b", microbatches=4),
]


@pytest.fixture(scope="module")
def gpt_plan():
    """One plan of the GPT (4 blocks, d_model 32) on 8 devices, compiled from shapes here, of
    the layouts the tests below read: each compiled once."""
    return rp.plan(plan_jobs.gpt_build, [*RANKED, *INTERLEAVED], hardware="tpu-v5e",
                   memory="1GiB", workers=0)  # fmt: skip


@pytest.mark.slow
def test_a_real_plan_ranks_the_compiled_gpt(gpt_plan):
    """The GPT on 8 devices, four layouts, compiled from shapes: the ranking follows the
    modelled time; tensor parallelism moves bytes over `model`; 1F1B waits in its bubble (3/7
    at K=4, M=4) while GPipe computes through it (in its FLOPs)."""
    report = gpt_plan
    assert report.compiled == len(RANKED) + len(INTERLEAVED) == len(report.ranked)
    ranked = [c for c in report.ranked if c.layout in RANKED]
    assert len(ranked) == 4
    times = [c.time.total for c in report.ranked]
    assert times == sorted(times)
    assert all(0 < c.peak_bytes <= 2**30 for c in ranked)
    by_name = {str(c.layout): c for c in ranked}
    tp = by_name["data=4 model=2"]
    assert any(c.axes == ("model",) for c in tp.outcome.compiled.collectives)
    assert tp.time.ici > 0 and by_name["data=8"].time.ici > 0
    one_f = by_name["data=2 stage=4 1f1b M=4"]
    assert one_f.time.bubble > 0 and one_f.outcome.compiled.bubble == pytest.approx(3 / 7)
    assert by_name["data=2 stage=4 gpipe M=4"].time.bubble == 0
    assert "best: " in str(report) and report.to_json()


@pytest.mark.slow
def test_a_real_plan_models_interleaved_1f1b_as_1f1b_with_a_smaller_bubble(gpt_plan):
    """K=2, M=4, V=2: interleaved 1F1B's modelled bubble is Megatron-LM's (K-1)/(VM+K-1) = 1/9
    against 1F1B's (K-1)/(M+K-1) = 1/5, and, as 1F1B, it waits in it (idle time, not FLOPs);
    the GPT's stages are equal, so its idle FLOPs are about half of 1F1B's."""
    by_name = {str(c.layout): c for c in gpt_plan.ranked if c.layout in INTERLEAVED}
    inter = by_name["data=4 stage=2 interleaved V=2 M=4"]
    one_f = by_name["data=4 stage=2 1f1b M=4"]
    assert inter.outcome.compiled.bubble == pytest.approx(1 / 9)
    assert one_f.outcome.compiled.bubble == pytest.approx(1 / 5)
    assert inter.time.bubble > 0 and one_f.time.bubble > 0
    ratio = inter.outcome.compiled.idle_flops / one_f.outcome.compiled.idle_flops
    assert 0.4 < ratio < 0.6, ratio


@pytest.mark.slow
def test_plan_in_worker_processes_with_another_device_count(gpt_plan):
    """4 devices, planned from this 8-device process by a worker that starts with 4 emulated
    devices; the results equal the same plan made in a process of 4 devices."""
    layouts = [rp.planner.Layout(data=4), rp.planner.Layout(data=2, model=2)]
    report = rp.plan(plan_jobs.gpt_build, layouts, hardware="tpu-v5e", memory="1GiB", workers=1)
    assert report.workers == 1 and len(report.ranked) == 2
    by_name = {str(c.layout): c for c in report.ranked}
    assert by_name["data=2 model=2"].outcome.compiled.mesh == {"data": 2, "model": 2}
    (here,) = [c for c in gpt_plan.ranked if c.layout == rp.planner.Layout(data=8)]
    assert gpt_plan.workers == 0  # compiled in this process
    # a quarter of the batch per device instead of an eighth: about twice the FLOPs
    ratio = by_name["data=4"].outcome.compiled.flops / here.outcome.compiled.flops
    assert 1.8 < ratio < 2.05, ratio


def test_bytes_accessed_per_kernel_worked_by_hand():
    """A loop of 4 trips whose fusion slices one row [1,8] of a stacked [4,8] operand and
    multiplies it by a [8] vector, and whose in-place update writes one row back: per trip the
    fusion reads 32 + 32 bytes and writes 32, the update reads and writes 32; the slice is
    counted as the slice and the update in place, not the whole [4,8] buffer."""
    from replicator._src.report import hlo

    text = """
%fused (param_0: f32[4,8], param_1: f32[8], param_2: s32[]) -> f32[1,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %ds = f32[1,8]{1,0} dynamic-slice(%param_0, %param_2, %c), dynamic_slice_sizes={1,8}
  %param_1 = f32[8]{0} parameter(1)
  %b = f32[1,8]{1,0} broadcast(%param_1), dimensions={1}
  ROOT %m = f32[1,8]{1,0} multiply(%ds, %b)
}

%body (p: (f32[4,8], f32[8], s32[])) -> (f32[4,8], f32[8], s32[]) {
  %p = (f32[4,8]{1,0}, f32[8]{0}, s32[]) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=0
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %i = s32[] get-tuple-element(%p), index=2
  %f = f32[1,8]{1,0} fusion(%x, %v, %i), kind=kLoop, calls=%fused
  %z = s32[] constant(0)
  %u = f32[4,8]{1,0} dynamic-update-slice(%x, %f, %i, %z)
  ROOT %t = (f32[4,8]{1,0}, f32[8]{0}, s32[]) tuple(%u, %v, %i)
}

%cond (q: (f32[4,8], f32[8], s32[])) -> pred[] {
  %q = (f32[4,8]{1,0}, f32[8]{0}, s32[]) parameter(0)
  ROOT %r = pred[] constant(true)
}

ENTRY %main (a: f32[4,8], w: f32[8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %w = f32[8]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (f32[4,8]{1,0}, f32[8]{0}, s32[]) tuple(%a, %w, %zero)
  %loop = (f32[4,8]{1,0}, f32[8]{0}, s32[]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=0
}
"""
    costs = hlo.analyze(text, {"data": 1})
    fusion = 32 + 32 + 4 + 32  # the slice, the vector, the index, the output
    update = 2 * 32
    assert costs.flops == 4 * 8  # the multiply, 4 trips
    assert costs.bytes_accessed == 4 * (fusion + update)
    assert sum(f for f, _ in costs.roofline) == 32
