"""The modelled step time of pipeline plans: analytic bubbles, hand-computed cases, validation."""

import math
from fractions import Fraction

import numpy as np
import pytest

from replicator._src.pipeline import schedules as S
from replicator._src.pipeline import timing as T


def _costs(f, b_in, w, b):
    return T.StageCosts(forward=f, backward_input=b_in, backward_weight=w, backward=b)


@pytest.mark.parametrize("k", range(1, 9))
def test_gpipe_bubble_is_analytic(k):
    for m in range(1, 21):
        plan = S.GPipe().timetable(k, m)
        for f, b in [(1, 2), (1, 1), (0.5, 3), (2, 0)]:
            st = T.step_time(plan, T.StageCosts.equal(k, forward=f, backward=b))
            assert st.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))
            assert st.time == pytest.approx((m + k - 1) * (f + b))
            assert st.tick_times.shape == (2 * plan.num_ticks,)


@pytest.mark.parametrize("k", range(1, 9))
def test_one_f_one_b_bubble_is_analytic(k):
    for m in range(k, 3 * k + 4):
        plan = S.OneFOneB().timetable(k, m)
        for f, b in [(1, 2), (1, 1), (0.5, 3), (2, 1)]:
            st = T.step_time(plan, T.StageCosts.equal(k, forward=f, backward=b))
            assert st.bubble_fraction == pytest.approx((k - 1) / (m + k - 1)), (m, f, b)
            assert st.work.tolist() == pytest.approx([m * (f + b)] * k)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("k", range(1, 7))
def test_circular_bubble_is_analytic_when_k_divides_m(k, v):
    for m in range(k, 6 * k + 1, k):
        plan = S.Circular(repeats=v).timetable(k, m)
        for f, b in [(1, 2), (1, 1)]:
            st = T.step_time(plan, T.StageCosts.equal(v * k, forward=f, backward=b))
            assert st.bubble_fraction == pytest.approx((k - 1) / (v * m + k - 1))
            assert st.time == pytest.approx((v * m + k - 1) * (f + b))


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_interleaved_bubble_is_megatrons_when_costs_are_equal(k, v):
    # Lock-step, each tick costs its busiest device (tests/test_pipeline_schedules.py works the
    # tables out): V*K - 1 ticks of forwards only, V*M - V*K + K ticks where a device runs a
    # forward and a backward, V*K - 1 of backwards only: (V*M + K - 1)(f + b) in all, while each
    # device works V*M*(f + b). The bubble is (K-1)/(V*M + K-1): Circular's, and V times
    # smaller in M than 1F1B's (K-1)/(M + K-1).
    for m in range(k, 8 * k + 1, k):
        plan = S.Interleaved1F1B(repeats=v).timetable(k, m)
        for f, b in [(1, 2), (1, 1), (2, 1), (0.5, 3), (1, 0)]:
            st = T.step_time(plan, T.StageCosts.equal(v * k, forward=f, backward=b))
            assert st.time == pytest.approx((v * m + k - 1) * (f + b), rel=1e-12), (m, f, b)
            assert st.work.tolist() == pytest.approx([v * m * (f + b)] * k, rel=1e-12)
            assert st.bubble_fraction == pytest.approx((k - 1) / (v * m + k - 1), rel=1e-12)
            assert st.dataflow_time <= st.time + 1e-9
            assert st.dataflow_time >= max(st.work) - 1e-9
        # Integer costs: whole numbers, so the bubble is exactly (K-1)/(V*M + K-1).
        st = T.step_time(plan, T.StageCosts.equal(v * k, forward=1, backward=2))
        assert st.time == 3 * (v * m + k - 1) and st.work.tolist() == [3 * v * m] * k
        assert Fraction(int(k * st.time - st.work.sum()), int(k * st.time)) == Fraction(
            k - 1, v * m + k - 1
        )
        circ = S.Circular(repeats=v).timetable(k, m).bubble_fraction()
        assert plan.bubble_fraction() == pytest.approx(circ, rel=1e-12)


def test_interleaved_bubble_against_one_f_one_b_at_k4_m8():
    """Megatron-LM's example: K=4, M=8, two virtual stages: 3/19 = 0.158 against 3/11 = 0.273."""
    il, one = S.Interleaved1F1B(repeats=2).timetable(4, 8), S.OneFOneB().timetable(4, 8)
    assert Fraction(il.bubble_fraction()).limit_denominator(1000) == Fraction(3, 19)
    assert Fraction(one.bubble_fraction()).limit_denominator(1000) == Fraction(3, 11)
    assert round(il.bubble_fraction(), 3) == 0.158 and round(one.bubble_fraction(), 3) == 0.273
    st = T.step_time(il)  # equal costs: F = 1, the fused backward 2
    assert st.time == 3 * 19 and st.work.tolist() == [48] * 4 and st.dataflow_time <= st.time


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_zero_bubble_bubble_with_equal_passes(k):
    for m in (k, k + 1, 2 * k, 16):
        plan = S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(k, m)
        for c in (1.0, 2.5):
            st = T.step_time(
                plan, T.StageCosts.equal(k, forward=c, backward_input=c, backward_weight=c)
            )
            assert st.time == pytest.approx(c * (3 * m + k - 1))
            assert st.bubble_fraction == pytest.approx((k - 1) / (3 * m + k - 1))
            assert st.dataflow_time == pytest.approx(st.time)


def test_gpipe_with_unequal_stages_by_hand():
    # K=2, M=3; stage 1 twice as slow. Forward ticks: max(F) of the active stages = 1, 2, 2, 2;
    # backward ticks (the forward replayed): 4, 4, 4, 2. Stage 0 works 3*(1+2), stage 1 3*(2+4).
    plan = S.GPipe().timetable(2, 3)
    st = T.step_time(plan, _costs((1, 2), (1, 1), (1, 1), (2, 4)))
    assert st.tick_times.tolist() == [1, 2, 2, 2, 4, 4, 4, 2]
    assert st.start.tolist() == [0, 1, 3, 5, 7, 11, 15, 19]
    assert st.time == 21 and st.work.tolist() == [9, 18]
    assert st.bubble_fraction == pytest.approx(1 - 27 / 42)
    assert st.dataflow_time == 21  # stage 1 is the critical path either way
    assert st.phase_times.shape == (3, 8, 2) and (st.phase_times[2] == 0).all()


def test_one_f_one_b_with_unequal_stages_by_hand():
    # K=2, M=2: tick 0 stage 0 F0 (1); tick 1 stage 0 F1 (1), stage 1 F0+B0 (2+3);
    # tick 2 stage 0 B0 (2), stage 1 F1+B1 (5); tick 3 stage 0 B1 (2).
    plan = S.OneFOneB().timetable(2, 2)
    st = T.step_time(plan, _costs((1, 2), (9, 9), (9, 9), (2, 3)))  # B/W unused: fused
    assert st.tick_times.tolist() == [1, 5, 5, 2]
    assert st.time == 13 and st.work.tolist() == [6, 10]
    assert st.bubble_fraction == pytest.approx(1 - 16 / 26)
    assert st.dataflow_time == 13


def test_circular_with_unequal_logical_stages_by_hand():
    # K=2, V=2, M=2: logical stages 0..3 = (device 0, a), (1, a), (0, b), (1, b), forward costs
    # 1..4. Forward ticks: 1, max(1,2), max(3,2), max(3,4), 4 = 14; 5 backward ticks of 2.
    plan = S.Circular(repeats=2).timetable(2, 2)
    st = T.step_time(plan, _costs((1, 2, 3, 4), (1,) * 4, (1,) * 4, (2,) * 4))
    assert st.tick_times.tolist() == [1, 2, 3, 4, 4, 2, 2, 2, 2, 2]
    assert st.time == 24 and st.work.tolist() == [16, 20]
    assert st.bubble_fraction == pytest.approx(0.25)
    assert st.dataflow_time == 24


def test_zero_bubble_with_a_slow_input_gradient_by_hand():
    # K=2, M=2 tables: stage 0: F0 F1 . B0 W0 B1 W1; stage 1: . F0 B0 F1 B1 W0 W1.
    # With B = 2: ticks 1 1 2 2 2 2 1 = 11. Without barriers stage 1 runs F0 1-2, B0 2-4, F1 4-5,
    # B1 5-7, W0 7-8, W1 8-9; stage 0 F0 0-1, F1 1-2, B0 4-6, W0 6-7, B1 7-9, W1 9-10: 10.
    plan = S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(2, 2)
    st = T.step_time(plan, _costs((1, 1), (2, 2), (1, 1), (3, 3)))
    assert st.tick_times.tolist() == [1, 1, 2, 2, 2, 2, 1]
    assert st.time == 11 and st.work.tolist() == [8, 8]
    assert st.bubble_fraction == pytest.approx(1 - 16 / 22)
    assert st.dataflow_time == 10
    # W's cost counts where W runs: a slow W on stage 0 stretches ticks 4 and 6.
    st = T.step_time(plan, _costs((1, 1), (1, 1), (3, 1), (4, 2)))
    assert st.tick_times.tolist() == [1, 1, 1, 1, 3, 1, 3]
    assert st.work.tolist() == [10, 6]


@pytest.mark.parametrize(
    ("sched", "k", "m"),
    [
        (S.GPipe(), 3, 5),
        (S.Circular(2), 3, 6),
        (S.OneFOneB(), 4, 7),
        (S.ZeroBubble(), 4, 7),
        (S.Interleaved1F1B(2), 4, 8),
        (S.Interleaved1F1B(3), 3, 6),
    ],
)
def test_dataflow_is_a_lower_bound_and_work_adds_up(sched, k, m):
    rng = np.random.default_rng(0)
    plan = sched.timetable(k, m)
    n = k * sched.repeats
    for _ in range(5):
        f, b_in, w = (tuple(rng.uniform(0.2, 3.0, n)) for _ in range(3))
        b = tuple(np.add(b_in, w))
        st = T.step_time(plan, _costs(f, b_in, w, b))
        assert st.dataflow_time <= st.time + 1e-9
        assert st.dataflow_time >= max(st.work) - 1e-9  # a device cannot overlap its own passes
        assert st.start == pytest.approx(np.cumsum(st.tick_times) - st.tick_times)
        assert st.tick_times == pytest.approx(st.phase_times.sum(axis=0).max(axis=1))
        per_stage = np.add(f, b).reshape(sched.repeats, k).sum(axis=0) * m
        assert st.work == pytest.approx(per_stage)
        assert st.bubble_fraction == pytest.approx(1 - st.work.sum() / (k * st.time))


@pytest.mark.parametrize(
    "plan",
    [
        S.GPipe().timetable(3, 4),
        S.Circular(3).timetable(2, 5),
        S.OneFOneB().timetable(3, 5),
        S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(3, 5),
        S.Interleaved1F1B(2).timetable(3, 6),
    ],
    ids=["gpipe", "circular", "1f1b", "zb", "interleaved"],
)
def test_plan_bubble_fraction_is_the_modelled_one(plan):
    n = plan.num_stages * plan.repeats
    assert plan.bubble_fraction() == T.step_time(plan).bubble_fraction
    for f, b in [(1, 2), (1, 1), (0, 1), (3, 0.5)]:
        costs = T.StageCosts.equal(n, forward=f, backward_input=b / 2, backward_weight=b / 2)
        assert plan.bubble_fraction(f, b) == pytest.approx(T.step_time(plan, costs).bubble_fraction)


def test_stage_costs_equal_and_fields():
    c = T.StageCosts.equal(3, forward=2, backward_input=1.5, backward_weight=0.5, unit="seconds")
    assert c.forward == (2.0,) * 3 and c.backward == (2.0,) * 3 and c.num_stages == 3
    assert c.unit == "seconds"
    assert T.StageCosts.equal(np.int64(2), backward=5).backward == (5.0, 5.0)
    c = _costs(np.array([1, 2]), [1, 1], (0, 0), (1, 1))
    assert c.forward == (1.0, 2.0) and isinstance(c.backward_weight, tuple)
    assert T.step_time(S.GPipe().timetable(2, 2), c).unit == "units"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: _costs((1, 2), (1,), (1, 1), (1, 1)), r"StageCosts: backward_input has 1 entries but forward has 2; give every field one entry per logical stage"),
        (lambda: _costs((1, -1), (1, 1), (1, 1), (1, 1)), r"StageCosts: forward\[1\] must be a finite number >= 0; got -1"),
        (lambda: _costs((1, 1), (1, math.nan), (1, 1), (1, 1)), r"backward_input\[1\] must be a finite number >= 0; got nan"),
        (lambda: _costs((1, 1), (1, 1), (math.inf, 1), (1, 1)), r"backward_weight\[0\] must be a finite number >= 0; got inf"),
        (lambda: _costs((1, 1), (1, 1), (1, 1), ("x", 1)), r"backward\[0\] must be a finite number >= 0; got 'x'"),
        (lambda: _costs((), (), (), ()), r"StageCosts: forward must be a non-empty sequence of numbers.*StageCosts.equal\(num_stages\)"),
        (lambda: _costs(1.0, (1,), (1,), (1,)), r"forward must be a non-empty sequence"),
        (lambda: T.StageCosts((1,), (1,), (1,), (1,), unit="ms"), r"StageCosts: unit must be one of 'units', 'flops', 'seconds'; got 'ms'"),
        (lambda: T.StageCosts.equal(0), r"StageCosts.equal: num_stages must be an int >= 1; got 0"),
        (lambda: T.StageCosts.equal(2, forward=-1), r"forward\[0\] must be a finite number >= 0"),
        (lambda: T.step_time(S.Circular(2).timetable(2, 2), T.StageCosts.equal(2)), r"step_time: costs describe 2 logical stages but the plan has 4 \(num_stages=2 x repeats=2\).*StageCosts.equal\(4\)"),
        (lambda: T.step_time(S.GPipe().timetable(2, 2), T.StageCosts.equal(2, forward=0, backward=0)), r"step_time: the step takes no time"),
        (lambda: S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(2, 2).bubble_fraction(0, 0), r"Timetable.bubble_fraction: costs must be >= 0 and not both 0"),
        (lambda: S.GPipe().timetable(2, 2).bubble_fraction(math.nan), r"Timetable.bubble_fraction: costs must be >= 0"),
    ],
)  # fmt: skip
def test_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_step_time_refuses_other_cost_objects():
    with pytest.raises(TypeError, match=r"step_time: costs must be a StageCosts or None; got dict"):
        T.step_time(S.GPipe().timetable(2, 2), {"forward": (1, 1)})
