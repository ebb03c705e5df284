"""rp.plan: the layouts enumerated for a model, the pruning and search of each family, and the
time model, each against hand-worked cases; a real plan of the GPT, in this process and in
worker processes with another device count."""

import dataclasses
import types

import plan_jobs
import pytest

import replicator as rp
from replicator._src.report import cost_model
from replicator._src.report.cost_model import CollectiveCost, CompiledStep

# -- enumeration ----------------------------------------------------------------------------------


def meshes(families):
    return sorted({(f.layouts[0].data, f.layouts[0].stage, f.layouts[0].model) for f in families})


def test_enumeration_of_8_devices_for_4_layers_and_4_heads():
    """data x stage x model = 8 with model | 4 heads (not 8), stage | 4 layers, data | 16;
    worked by hand: 8 meshes."""
    families = rp.planner.enumerate_layouts(
        8, global_batch=16, num_layers=4, num_heads=4, hidden=16
    )
    assert meshes(families) == [
        (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1), (8, 1, 1)
    ]  # fmt: skip
    for f in families:
        assert {lay.num_devices for lay in f.layouts} == {8}
    by_mesh = {}
    for f in families:
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
    families = rp.planner.enumerate_layouts(
        8, global_batch=48, num_layers=12, schedules=("1f1b", "interleaved"), zero_stages=(0,),
        microbatches=(2, 3, 4, 6), max_model=1, remat=(False,),
    )  # fmt: skip
    piped = sorted(
        (lay.stage, lay.schedule, lay.microbatches, lay.repeats)
        for f in families for lay in f.layouts if lay.stage > 1
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
    families = rp.planner.enumerate_layouts(
        8, global_batch=12, num_layers=8, schedules=("1f1b", "interleaved"), zero_stages=(0,),
        max_model=1, remat=(False,),
    )  # fmt: skip
    piped = sorted((lay.stage, lay.schedule, lay.microbatches)
                   for f in families for lay in f.layouts if lay.stage > 1)  # fmt: skip
    assert piped == [(2, "1f1b", 3), (4, "1f1b", 6), (8, "1f1b", 12)]
    # repeats=4: K*V = 8 layers at stage 2 only (data=4, 4 a replica: M = 2K = 4; 4K = 8 does
    # not divide 4)
    families = rp.planner.enumerate_layouts(
        8, global_batch=16, num_layers=8, schedules=("interleaved",), repeats=4, max_model=1,
    )  # fmt: skip
    assert {(lay.stage, lay.microbatches, lay.repeats) for f in families for lay in f.layouts
            if lay.stage > 1} == {(2, 4, 4)}  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"interleaved schedule needs repeats >= 2.*got "
        r"repeats=1. Use repeats=2 or more, or leave 'interleaved' out",
    ):
        rp.planner.enumerate_layouts(8, global_batch=16, num_layers=8, repeats=1)
    assert rp.planner.enumerate_layouts(8, global_batch=16, num_layers=8, repeats=1,
                                schedules=("circular",))  # fmt: skip


def test_a_family_is_ordered_fastest_first():
    """No remat, then "dots", then full remat; within each, fewer accumulation steps first (2
    examples per replica: 1 or 2 steps); ZeRO-2 only with accumulation; pipelines of every
    schedule under each policy."""
    families = rp.planner.enumerate_layouts(8, global_batch=16, num_layers=4, num_heads=4)
    first = {str(f): f for f in families}
    assert first["data=8"].groups == tuple(
        (rp.planner.Layout(data=8, remat=r), rp.planner.Layout(data=8, accumulate_steps=2, remat=r))
        for r in (False, "dots", True)
    )
    assert first["data=8 zero=2 accum=2"].layouts == [
        rp.planner.Layout(data=8, zero_stage=2, accumulate_steps=2, remat=r)
        for r in (False, "dots", True)
    ]
    for schedule in ("1f1b", "interleaved", "zerobubble"):
        fams = [f for f in families if f.layouts[0].schedule == schedule]
        assert fams and all([lay.remat for lay in f.layouts] == [False, "dots", True] for f in fams)


def test_enumeration_options_and_refusals():
    families = rp.planner.enumerate_layouts(
        8, global_batch=16, num_layers=8, num_heads=8, schedules=("1f1b",), zero_stages=(1,),
        microbatches=(4, 8), max_model=2, max_stage=2, remat=(True,),
    )  # fmt: skip
    assert meshes(families) == [(2, 2, 2), (4, 1, 2), (4, 2, 1), (8, 1, 1)]
    assert {f.layouts[0].microbatches for f in families if f.layouts[0].stage > 1} == {4, 8}
    assert all(lay.remat for f in families for lay in f.layouts)
    with pytest.raises(ValueError, match=r"enumerate_layouts: schedules=\['zb'\]; choose"):
        rp.planner.enumerate_layouts(8, global_batch=8, num_layers=4, schedules=("zb",))
    with pytest.raises(ValueError, match=r"enumerate_layouts: global_batch must be an int >= 1"):
        rp.planner.enumerate_layouts(8, global_batch=0, num_layers=4)


def test_layout_checks_and_names():
    lay = rp.planner.Layout(data=2, stage=4, schedule="1f1b", microbatches=8)
    assert not lay.remat and str(lay) == "data=2 stage=4 1f1b M=8"  # 1F1B keeps residuals
    assert str(rp.planner.Layout(data=8, remat="full")) == "data=8 remat"
    with pytest.raises(ValueError, match=r"Layout: remat must be False \('none'\), 'dots' or"):
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


def test_a_family_is_searched_by_bisection_and_stops_at_the_first_fit():
    """Fake compiled programs whose peak is 1000 / accumulate_steps (+500 without remat) and
    whose state is 100 bytes: with a budget of 260, no-remat layouts never fit (>= 562);
    remat fits from 4 accumulation steps (250). Compiled: the most frugal of each group first,
    then the bisection; everything else is skipped with the reason."""
    plan_jobs.COMPILED.clear()
    family = rp.planner.Ladder(tuple(
        tuple(rp.planner.Layout(data=8, accumulate_steps=a, remat=r) for a in (1, 2, 4, 8, 16))
        for r in (False, True)
    ))  # fmt: skip
    report = rp.plan(plan_jobs.fake_build, [family], hardware=HW, memory=260, workers=0)
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


def test_a_family_whose_state_alone_is_too_big_is_not_compiled():
    plan_jobs.COMPILED.clear()
    family = rp.planner.Ladder(
        ((rp.planner.Layout(data=8), rp.planner.Layout(data=8, accumulate_steps=2)),)
    )
    report = rp.plan(plan_jobs.fake_build, [family], hardware=HW, memory=99, workers=0)
    assert plan_jobs.COMPILED == [] and report.best is None
    assert {c.outcome.status for c in report.rejected} == {"state too big"}
    assert report.rejected[0].outcome.reason == "its state alone is 100 B per device"
    assert "no layout fits 99 B per device" in str(report)


def test_remat_is_tried_only_with_fewer_accumulation_steps_than_the_fit_without_it():
    """Without remat the fit is at 2 steps (peak 1000); remat does more work, so only its
    1-step layout may be faster, and it is the only remat layout compiled."""
    plan_jobs.COMPILED.clear()
    family = rp.planner.Ladder(tuple(
        tuple(rp.planner.Layout(data=8, accumulate_steps=a, remat=r) for a in (1, 2, 4))
        for r in (False, True)
    ))  # fmt: skip
    report = rp.plan(plan_jobs.fake_build, [family], hardware=HW, memory=1000, workers=0)
    compiled = [(lay.accumulate_steps, lay.remat) for lay in plan_jobs.COMPILED]
    assert compiled == [(4, False), (2, False), (1, False), (1, True)]
    assert [str(c.layout) for c in report.ranked] == [
        "data=8 accum=2",
        "data=8 accum=4",
        "data=8 remat",
    ]
    skipped = {str(c.layout): c.outcome.reason for c in report.rejected}
    assert skipped["data=8 accum=2 remat"] == "data=8 accum=2 fits and does less work"


def test_a_refused_layout_is_rejected_with_the_librarys_reason():
    plan_jobs.COMPILED.clear()
    report = rp.plan(plan_jobs.refusing_build, [rp.planner.Layout(data=8)], hardware=HW, workers=0)
    (c,) = report.rejected
    assert c.outcome.status == "error" and "ValueError: no such layout here" in c.outcome.reason


def test_a_worker_that_dies_takes_only_its_family_with_it():
    """The process compiling data=4 x model=2 dies; that family is an error saying so, and a
    new worker plans the families after it."""
    layouts = [
        rp.planner.Layout(data=8),
        rp.planner.Layout(data=4, model=2),
        rp.planner.Layout(data=2, model=4),
    ]
    report = rp.plan(plan_jobs.crashing_build, layouts, hardware=HW, memory=2000, workers=1)
    assert [str(c.layout) for c in report.ranked] == ["data=8", "data=2 model=4"]
    (dead,) = report.rejected
    assert str(dead.layout) == "data=4 model=2" and dead.outcome.status == "error"
    assert "worker process died (exit code 7)" in dead.outcome.reason


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


@pytest.mark.slow
def test_a_real_plan_ranks_the_compiled_gpt():
    """The GPT (4 blocks, d_model 32) on 8 devices, four layouts, compiled from shapes: the
    ranking follows the modelled time; tensor parallelism moves bytes over `model`; 1F1B
    waits in its bubble (3/7 at K=4, M=4) while GPipe computes through it (in its FLOPs)."""
    layouts = [
        rp.planner.Layout(data=8),
        rp.planner.Layout(data=4, model=2),
        rp.planner.Layout(data=2, stage=4, schedule="1f1b", microbatches=4),
        rp.planner.Layout(data=2, stage=4, schedule="gpipe", microbatches=4),
    ]
    report = rp.plan(plan_jobs.gpt_build, layouts, hardware="tpu-v5e", memory="1GiB", workers=0)
    assert report.compiled == 4 and len(report.ranked) == 4
    times = [c.time.total for c in report.ranked]
    assert times == sorted(times)
    assert all(0 < c.peak_bytes <= 2**30 for c in report.ranked)
    by_name = {str(c.layout): c for c in report.ranked}
    tp = by_name["data=4 model=2"]
    assert any(c.axes == ("model",) for c in tp.outcome.compiled.collectives)
    assert tp.time.ici > 0 and by_name["data=8"].time.ici > 0
    one_f = by_name["data=2 stage=4 1f1b M=4"]
    assert one_f.time.bubble > 0 and one_f.outcome.compiled.bubble == pytest.approx(3 / 7)
    assert by_name["data=2 stage=4 gpipe M=4"].time.bubble == 0
    assert "best: " in str(report) and report.to_json()


@pytest.mark.slow
def test_a_real_plan_models_interleaved_1f1b_as_1f1b_with_a_smaller_bubble():
    """K=2, M=4, V=2: interleaved 1F1B's modelled bubble is Megatron-LM's (K-1)/(VM+K-1) = 1/9
    against 1F1B's (K-1)/(M+K-1) = 1/5, and, as 1F1B, it waits in it (idle time, not FLOPs);
    the GPT's stages are equal, so its idle FLOPs are about half of 1F1B's."""
    layouts = [
        rp.planner.Layout(data=4, stage=2, schedule="interleaved", microbatches=4, repeats=2),
        rp.planner.Layout(data=4, stage=2, schedule="1f1b", microbatches=4),
    ]
    report = rp.plan(plan_jobs.gpt_build, layouts, hardware="tpu-v5e", memory="1GiB", workers=0)
    by_name = {str(c.layout): c for c in report.ranked}
    inter = by_name["data=4 stage=2 interleaved V=2 M=4"]
    one_f = by_name["data=4 stage=2 1f1b M=4"]
    assert inter.outcome.compiled.bubble == pytest.approx(1 / 9)
    assert one_f.outcome.compiled.bubble == pytest.approx(1 / 5)
    assert inter.time.bubble > 0 and one_f.time.bubble > 0
    ratio = inter.outcome.compiled.idle_flops / one_f.outcome.compiled.idle_flops
    assert 0.4 < ratio < 0.6, ratio


@pytest.mark.slow
def test_plan_in_worker_processes_with_another_device_count():
    """4 devices, planned from this 8-device process by a worker that starts with 4 emulated
    devices; the results equal the same plan made in a process of 4 devices."""
    layouts = [rp.planner.Layout(data=4), rp.planner.Layout(data=2, model=2)]
    report = rp.plan(plan_jobs.gpt_build, layouts, hardware="tpu-v5e", memory="1GiB", workers=1)
    assert report.workers == 1 and len(report.ranked) == 2
    by_name = {str(c.layout): c for c in report.ranked}
    assert by_name["data=2 model=2"].outcome.compiled.mesh == {"data": 2, "model": 2}
    here = rp.plan(plan_jobs.gpt_build, [rp.planner.Layout(data=8)], hardware="tpu-v5e", workers=0)
    # a quarter of the batch per device instead of an eighth: about twice the FLOPs
    ratio = by_name["data=4"].outcome.compiled.flops / here.ranked[0].outcome.compiled.flops
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
