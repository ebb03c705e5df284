"""Pipeline schedules: the tick tables, their invariants, bubbles, validation and pictures."""

import dataclasses
import itertools
import re
from fractions import Fraction

import numpy as np
import pytest

from replicator._src.pipeline import pictures as P
from replicator._src.pipeline import schedules as S
from replicator._src.pipeline import timing as T

SIZES = [(1, 1), (1, 4), (2, 1), (2, 4), (2, 6), (4, 1), (4, 4), (4, 6), (4, 16), (3, 7)]
CASES = (
    [("gpipe", S.GPipe(), k, m) for k, m in SIZES]
    + [(f"circular{v}", S.Circular(v), k, m) for v in (1, 2, 3) for k, m in SIZES if m >= k]
    + [("1f1b", S.OneFOneB(), k, m) for k, m in SIZES if m >= k]
)
IDS = [f"{name}-K{k}-M{m}" for name, _, k, m in CASES]


def _forward_ticks(plan):
    """{(i, r, s): tick} of every forward in the plan."""
    out = {}
    for t, s in zip(*np.nonzero(plan.fwd >= 0)):
        key = (int(plan.fwd[t, s]), int(plan.fwd_repeat[t, s]), int(s))
        assert key not in out, f"forward {key} runs twice"
        out[key] = int(t)
    return out


@pytest.mark.parametrize(("name", "sched", "k", "m"), CASES, ids=IDS)
def test_forward_visits_every_logical_stage_once_along_the_ring(name, sched, k, m):
    plan = sched.timetable(k, m)
    v = sched.repeats
    assert (plan.num_stages, plan.num_microbatches, plan.repeats) == (k, m, v)
    assert plan.schedule == sched.name
    for table in (plan.fwd, plan.fwd_repeat, plan.bwd):
        assert table.dtype == np.int32 and table.shape == (plan.num_ticks, k)
    assert ((plan.fwd_repeat >= 0) & (plan.fwd_repeat < v)).all()
    assert (plan.fwd_repeat[plan.fwd < 0] == 0).all()
    ticks = _forward_ticks(plan)
    assert set(ticks) == {(i, r, s) for i in range(m) for r in range(v) for s in range(k)}
    for i in range(m):
        order = [ticks[i, j // k, j % k] for j in range(v * k)]  # logical stage j = r*K + s
        assert all(b == a + 1 for a, b in itertools.pairwise(order)), (i, order)
    # The ring invariant: hop j -> j+1 goes to device (s+1) % K exactly one tick later.
    for (i, r, s), t in ticks.items():
        j = r * k + s + 1
        if j < v * k:
            nxt = (t + 1, (s + 1) % k)
            assert (plan.fwd[nxt], plan.fwd_repeat[nxt]) == (i, j // k)
    # Each device has exactly V*M busy forward slots, and the last tick is used.
    assert ((plan.fwd >= 0).sum(axis=0) == v * m).all()
    assert (plan.fwd[-1] >= 0).any() or (plan.bwd[-1] >= 0).any()
    assert plan.busy().shape == (plan.num_ticks, k)


@pytest.mark.parametrize(("k", "m"), SIZES)
def test_gpipe_tables_and_bubble(k, m):
    plan = S.GPipe().timetable(k, m)
    assert plan.num_ticks == m + k - 1 and plan.stash_slots == 0
    t, s = np.indices(plan.fwd.shape)
    assert np.array_equal(plan.fwd, np.where((t - s >= 0) & (t - s < m), t - s, -1))
    assert (plan.bwd == -1).all() and (plan.fwd_repeat == 0).all()
    assert plan.bubble_fraction() == pytest.approx((k - 1) / (m + k - 1))
    assert plan.bubble_fraction(1.0, 1.0) == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 2), (2, 6), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_circular_ticks_and_bubble(k, m, v):
    plan = S.Circular(repeats=v).timetable(k, m)
    for (i, r, s), t in _forward_ticks(plan).items():
        assert t == s + (i // k) * k * v + r * k + i % k
    last = (k - 1) + ((m - 1) // k) * k * v + (v - 1) * k + (m - 1) % k
    assert plan.num_ticks == last + 1
    assert plan.bubble_fraction() == pytest.approx(1 - v * m / plan.num_ticks)
    if m % k == 0:
        assert plan.num_ticks == v * m + k - 1
        assert plan.bubble_fraction() == pytest.approx((k - 1) / (v * m + k - 1))
    assert (plan.bwd == -1).all() and plan.stash_slots == 0


@pytest.mark.parametrize(("k", "m"), [(1, 3), (2, 2), (2, 6), (4, 4), (4, 16), (3, 7)])
def test_circular_with_one_repeat_is_gpipe(k, m):
    a, b = S.Circular(repeats=1).timetable(k, m), S.GPipe().timetable(k, m)
    for name in ("fwd", "fwd_repeat", "bwd"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.bubble_fraction() == pytest.approx(b.bubble_fraction())


@pytest.mark.parametrize(("k", "m"), [(1, 1), (1, 5), (2, 2), (2, 5), (3, 3), (4, 4), (4, 16)])
def test_one_f_one_b_backward_and_stash(k, m):
    plan = S.OneFOneB().timetable(k, m)
    assert plan.num_ticks == m + 2 * k - 2
    assert plan.stash_slots == 2 * k - 1 == S.OneFOneB().timetable(k, 5 * m).stash_slots
    fwd = _forward_ticks(plan)
    bwd = {}
    for t, s in zip(*np.nonzero(plan.bwd >= 0)):
        bwd[int(plan.bwd[t, s]), int(s)] = int(t)
        assert t == plan.bwd[t, s] + 2 * (k - 1) - s
    assert set(bwd) == {(i, s) for i in range(m) for s in range(k)}
    for i in range(m):
        for s in range(k):
            # Same tick allowed only on the last stage, where the forward runs first.
            assert bwd[i, s] >= fwd[i, 0, s] + (0 if s == k - 1 else 1)
            if s > 0:
                assert bwd[i, s - 1] == bwd[i, s] + 1  # backwards go K-1 -> 0, one tick apart
    # Replay the stash: a forward stores its input, its backward consumes it (forward first).
    for s in range(k):
        ring, live, peak = [None] * plan.stash_slots, set(), 0
        for t in range(plan.num_ticks):
            i, j = int(plan.fwd[t, s]), int(plan.bwd[t, s])
            if i >= 0:
                assert ring[i % plan.stash_slots] not in live, "overwrote a live stash entry"
                ring[i % plan.stash_slots] = i
                live.add(i)
            peak = max(peak, len(live))
            if j >= 0:
                assert ring[j % plan.stash_slots] == j and j in live
                live.remove(j)
        assert not live
        assert peak <= 2 * (k - 1 - s) + 1 <= plan.stash_slots
        if m >= 2 * k:
            assert peak == 2 * (k - 1 - s) + 1


def test_one_f_one_b_bubble():
    plan = S.OneFOneB().timetable(4, 16)
    assert Fraction(plan.bubble_fraction()).limit_denominator(1000) == Fraction(9, 57)
    assert plan.bubble_fraction() == pytest.approx(S.GPipe().timetable(4, 16).bubble_fraction())
    # With equal costs every tick costs its busiest stage's work: recompute by hand.
    f, b = 1.0, 1.0
    time = sum(
        max(f * (x >= 0) + b * (y >= 0) for x, y in zip(*row)) for row in zip(plan.fwd, plan.bwd)
    )
    assert plan.bubble_fraction(f, b) == pytest.approx(1 - 16 * (f + b) / time)
    assert S.OneFOneB().timetable(1, 3).bubble_fraction() == 0.0


def test_plan_is_read_only():
    plan = S.GPipe().timetable(2, 2)
    with pytest.raises(ValueError):
        plan.fwd[0, 0] = 5
    with pytest.raises(AttributeError):
        plan.num_stages = 3


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: S.Circular().timetable(4, 2),
            r"num_microbatches.*got num_microbatches=2.*num_microbatches >= 4, or GPipe\(\)",
        ),
        (
            lambda: S.OneFOneB().timetable(4, 3),
            r"OneFOneB.timetable: num_microbatches.*>= 4, or GPipe\(\)",
        ),
        (lambda: S.Circular(repeats=0), r"Circular: repeats must be an int >= 1; got 0"),
        (lambda: S.Circular(repeats=1.5), r"repeats must be an int >= 1; got 1.5"),
        (lambda: S.Circular(repeats=True), r"repeats must be an int >= 1; got True"),
        (
            lambda: S.GPipe().timetable(4, 0),
            r"timetable: num_microbatches must be an int >= 1; got 0",
        ),
        (
            lambda: S.GPipe().timetable(0, 4),
            r"GPipe.timetable: num_stages must be an int >= 1; got 0",
        ),
        (lambda: S.OneFOneB().timetable(2.0, 4), r"num_stages must be an int >= 1; got 2.0"),
        (
            lambda: S.Circular().timetable(2, -1),
            r"Circular.timetable: num_microbatches must be an int >= 1",
        ),
        (lambda: S.get("pipedream"), r"unknown schedule 'pipedream'.*'gpipe', 'circular', '1f1b'"),
        (
            lambda: S.Interleaved1F1B(2).timetable(4, 6),
            r"Interleaved1F1B.timetable: num_microbatches must be a multiple of num_stages .*got "
            r"num_microbatches=6 with num_stages=4. Use num_microbatches=8, or OneFOneB\(\)",
        ),
        (
            lambda: S.Interleaved1F1B(3).timetable(4, 2),
            r"Interleaved1F1B.timetable: num_microbatches must be >= num_stages; got "
            r"num_microbatches=2 with num_stages=4.*num_microbatches >= 4",
        ),
        (
            lambda: S.Interleaved1F1B(repeats=1),
            r"Interleaved1F1B: repeats must be an int >= 2 \(virtual stages per device\); got 1. "
            r"Use Interleaved1F1B\(repeats=2\) or more, or OneFOneB\(\) for one stage per device",
        ),
        (
            lambda: S.Interleaved1F1B(0),
            r"Interleaved1F1B: repeats must be an int >= 2 .*got 0\..*repeats=2\) or more",
        ),
        (
            lambda: S.Interleaved1F1B(2.0),
            r"Interleaved1F1B: repeats must be an int.*got 2.0.*repeats=2\) or more",
        ),
        (lambda: S.Interleaved1F1B(True), r"Interleaved1F1B: repeats must be an int.*got True"),
        (lambda: S.Interleaved1F1B("2"), r"Interleaved1F1B: repeats must be an int.*got '2'"),
        (
            lambda: S.Interleaved1F1B(2).timetable(2.0, 4),
            r"Interleaved1F1B.timetable: num_stages must be an int >= 1; got 2.0",
        ),
        (lambda: S.GPipe().timetable(2, 2).bubble_fraction(-1.0), r"costs must be >= 0"),
        (lambda: P.render("gpipe"), r"render: pass num_stages and num_microbatches"),
        (lambda: P.render(S.GPipe().timetable(2, 2), 3), r"num_stages=3 does not match"),
    ],
)
def test_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_get():
    assert S.get("gpipe") == S.GPipe() and S.get(" 1F1B ") == S.OneFOneB()
    assert S.get("circular") == S.Circular(repeats=2)
    sched = S.Circular(repeats=3)
    assert S.get(sched) is sched
    assert S.GPipe().timetable(np.int64(2), np.int32(3)).num_ticks == 4
    with pytest.raises(TypeError, match="got int"):
        S.get(3)
    assert [S.get(n).name for n in ("gpipe", "circular", "1f1b")] == ["gpipe", "circular", "1f1b"]
    assert S.get("interleaved") == S.get(" Interleaved1F1B ") == S.Interleaved1F1B(repeats=2)
    assert S.get("interleaved").name == "interleaved" and S.get("interleaved").repeats == 2
    sched = S.Interleaved1F1B(repeats=3)
    assert S.get(sched) is sched and sched != S.Interleaved1F1B(repeats=2)
    assert S.Interleaved1F1B(2).timetable(np.int64(2), np.int32(2)).num_ticks == 8


def _grid(text, k):
    lines = text.splitlines()
    header = lines[0].split()
    assert header[0] == "tick"
    rows = [line.split() for line in lines[1 : k + 1]]
    assert [r[:2] for r in rows] == [["stage", str(s)] for s in range(k)]
    return [int(x) for x in header[1:]], [r[2:] for r in rows], lines[k + 1 :]


@pytest.mark.parametrize(
    ("sched", "k", "m", "columns"),
    [
        ("gpipe", 4, 6, 2 * 9),
        (S.Circular(2), 2, 4, 2 * 9),
        ("1f1b", 4, 6, 12),
        ("gpipe", 1, 1, 2),
        ("interleaved", 2, 4, 12),  # V*M + V*K + K - 2 ticks (see the Interleaved1F1B tests)
        (S.Interleaved1F1B(3), 2, 2, 6 + 6 + 0),
    ],
)
def test_render_ascii(sched, k, m, columns):
    text = P.render(sched, k, m)
    ticks, cells, rest = _grid(text, k)
    assert ticks == list(range(columns))
    assert all(len(row) == columns for row in cells)  # "." fills idle cells, so columns align
    flat = " ".join(" ".join(row) for row in cells)
    v = S.get(sched).repeats
    for i in range(m):
        assert len(re.findall(rf"F{i}(?![0-9])", flat)) == k * v
        assert len(re.findall(rf"B{i}(?![0-9])", flat)) == k * v
    assert rest[0].startswith("legend:")
    plan = S.get(sched).timetable(k, m)
    assert rest[1] == (
        f"schedule={plan.schedule} K={k} M={m} V={v} ticks={plan.num_ticks} "
        f"bubble={plan.bubble_fraction():.4f} (f=1, b=2)"
    )
    assert P.render(plan) == text
    lengths = {len(line) for line in text.splitlines()[: k + 1]}
    assert max(lengths) - min(lengths) <= max(len(c) for row in cells for c in row)


def test_render_cells():
    cells = _grid(P.render("1f1b", 2, 3), 2)[1]
    assert cells[1] == [".", "F0B0", "F1B1", "F2B2", "."]
    cells = _grid(P.render(S.Circular(2), 2, 2), 2)[1]
    assert cells[0][:4] == ["F0a", "F1a", "F0b", "F1b"]
    assert cells[0][-4:] == ["B1b", "B0b", "B1a", "B0a"]


def test_render_wraps_to_width():
    plan = S.Circular(3).timetable(4, 8)
    text = P.render(plan, width=60)
    blocks = text.split("\n\n")
    assert len(blocks) > 1
    ticks = []
    for block in blocks:
        lines = block.splitlines()
        assert all(len(line) <= 60 for line in lines[:5])
        ticks += [int(x) for x in lines[0].split()[1:]]
    assert ticks == list(range(2 * plan.num_ticks))
    assert text.endswith(P.render(plan).splitlines()[-1])


def test_render_png(tmp_path):
    pytest.importorskip("matplotlib")
    for name, sched in [("s", "gpipe"), ("c", S.Circular(2)), ("o", "1f1b")]:
        path = tmp_path / f"{name}.png"
        text = P.render(sched, 4, 8, path=str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "bubble=" in text


# -- ZeroBubble, ring slots and the dependency checker ------------------------------------------

ZB_SIZES = [(k, m) for k in (1, 2, 3, 4, 5, 8) for m in sorted({k, k + 1, 2 * k, 8, 16, 2 * k + 3})]
ZB_SIZES = [(k, m) for k, m in ZB_SIZES if m >= k]


def _pass_ticks(table, m):
    """{(i, s): tick} of a table whose passes run once each."""
    out = {}
    for t, s in zip(*np.nonzero(table >= 0)):
        key = (int(table[t, s]), int(s))
        assert key not in out, f"{key} runs twice"
        out[key] = int(t)
    assert len(out) == m * table.shape[1]
    return out


@pytest.mark.parametrize(("k", "m"), ZB_SIZES)
def test_zero_bubble_tables_follow_the_engine_contract(k, m):
    plan = S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(k, m)
    assert (plan.schedule, plan.num_stages, plan.num_microbatches, plan.repeats) == (
        "zerobubble", k, m, 1,
    )  # fmt: skip
    for table in (plan.fwd, plan.fwd_repeat, plan.bwd, plan.wgt):
        assert table.dtype == np.int32 and table.shape == (plan.num_ticks, k)
    assert (plan.fwd_repeat == 0).all()
    f, b, w = (_pass_ticks(x, m) for x in (plan.fwd, plan.bwd, plan.wgt))
    for i in range(m):
        for s in range(k):
            assert s == 0 or f[i, s] > f[i, s - 1]
            assert b[i, s] >= f[i, s] and (s == k - 1 or b[i, s] > b[i, s + 1])
            assert w[i, s] >= b[i, s]
            if i:  # micro-batch order per stage
                assert f[i, s] > f[i - 1, s] and b[i, s] > b[i - 1, s] and w[i, s] > w[i - 1, s]
    # One pass per stage per tick, the last tick used, and W really apart from B.
    busy = (plan.fwd >= 0).astype(int) + (plan.bwd >= 0) + (plan.wgt >= 0)
    assert busy.max() == 1 and busy[-1].any()
    assert any(w[key] > b[key] for key in w) or k == 1
    S.check_dependencies(plan)


@pytest.mark.parametrize(("k", "m"), ZB_SIZES)
def test_zero_bubble_ticks_bubble_and_memory(k, m):
    plan = S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(k, m)
    assert plan.num_ticks == 3 * m + k - 1  # ZB-H1: one unit of bubble per stage boundary
    assert plan.bubble_fraction() == pytest.approx((k - 1) / (3 * m + k - 1))
    assert plan.bubble_fraction() <= S.OneFOneB().timetable(k, m).bubble_fraction()
    assert (plan.stash_slots, plan.grad_slots) == (k, k)  # 2K, like 1F1B's 2K - 1 (+1 spare)
    assert (plan.stash_slots, plan.grad_slots) == S.ring_slots(plan.fwd, plan.bwd, plan.wgt)


def test_zero_bubble_targets_at_k4_m8():
    zb, one = S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(4, 8), S.OneFOneB().timetable(4, 8)
    assert zb.bubble_fraction() <= 0.5 * one.bubble_fraction()
    assert Fraction(zb.bubble_fraction()).limit_denominator(1000) == Fraction(3, 27)
    assert zb.stash_slots + zb.grad_slots <= 1.5 * (2 * 4)


def test_zero_bubble_cells_and_wait_rule():
    plan = S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(2, 3)
    cells = _grid(P.render(plan), 2)[1]
    assert cells[0] == ["F0", "F1", ".", "B0", "W0", "F2", "B1", "W1", "B2", "W2"]
    assert cells[1] == [".", "F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "W2"]
    # Stage 1 defers one W (at most s pending); stage 0 runs each W right after its B.


def _replay_rings(plan, stash_slots, grad_slots):
    """Runs the rings as the engine does; False if a live entry would be overwritten."""
    k = plan.num_stages
    wgt = plan.bwd if (plan.wgt < 0).all() else plan.wgt
    stash = [[None] * stash_slots for _ in range(k)]
    grads = [[None] * grad_slots for _ in range(k)]
    arrive_x, arrive_g = {}, {}  # (tick, stage) -> micro-batch arriving at the tick's start
    for t in range(plan.num_ticks):
        for s in range(k):
            writes = []
            if s == 0 and plan.fwd[t, 0] >= 0:
                writes.append((stash, int(plan.fwd[t, 0]), stash_slots))
            if (t, s) in arrive_x:
                writes.append((stash, arrive_x[t, s], stash_slots))
            if (t, s) in arrive_g:
                writes.append((grads, arrive_g[t, s], grad_slots))
            if s == k - 1 and plan.fwd[t, s] >= 0:  # the loss makes the last stage's cotangent
                writes.append((grads, int(plan.fwd[t, s]), grad_slots))
            for ring, i, n in writes:
                if ring[s][i % n] is not None:
                    return False
                ring[s][i % n] = i
            for ring, n in ((stash, stash_slots), (grads, grad_slots)):
                i = int(plan.fwd[t, s]) if ring is stash else int(plan.bwd[t, s])
                if i >= 0:
                    assert ring[s][i % n] == i, "read an entry that is not there"
            i = int(wgt[t, s])
            if i >= 0:
                assert stash[s][i % stash_slots] == i and grads[s][i % grad_slots] == i
                stash[s][i % stash_slots] = grads[s][i % grad_slots] = None
            if plan.fwd[t, s] >= 0 and s + 1 < k:
                arrive_x[t + 1, s + 1] = int(plan.fwd[t, s])
            if plan.bwd[t, s] >= 0 and s > 0:
                arrive_g[t + 1, s - 1] = int(plan.bwd[t, s])
    return all(x is None for ring in (stash, grads) for row in ring for x in row)


@pytest.mark.parametrize(
    ("sched", "k", "m"),
    [(S.ZeroBubble(), k, m) for k, m in [(2, 2), (3, 7), (4, 8), (5, 11)]]
    + [(S.OneFOneB(), k, m) for k, m in [(2, 5), (4, 8), (3, 3)]],
)
def test_ring_slots_are_enough_and_tight(sched, k, m):
    plan = sched.timetable(k, m)
    stash, grad = S.ring_slots(plan.fwd, plan.bwd, plan.wgt)
    if sched.name == "1f1b":
        assert (stash, grad) == (min(2 * k - 1, m), 1) and plan.stash_slots >= stash
    assert _replay_rings(plan, stash, grad)
    if stash > 1:
        assert not _replay_rings(plan, stash - 1, grad)
    if grad > 1:
        assert not _replay_rings(plan, stash, grad - 1)


GPT_PASSES = (4.424, 4.774, 4.036)  # the library's GPT block: F, B, W GFLOP (explain, M=8)


def _measured(k, f, b, w):
    """Equal stages with passes F, B, W (1F1B's fused backward: B + W)."""
    return T.StageCosts.equal(k, forward=f, backward_input=b, backward_weight=w)


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_zero_bubble_with_unequal_passes_is_never_slower_than_1f1b(k):
    """With the GPT's passes (B > F > W), the one-pass table mixes F, B and W across stages in
    the steady state, so each tick lasts a B: at large M it was slower than 1F1B. The chosen
    table keeps every stage on F, B and W in the same ticks there."""
    f, b, w = GPT_PASSES
    costs = _measured(k, f, b, w)
    for m in (k, 2 * k, 4 * k, 16 * k):
        plan = S.ZeroBubble(pass_costs=GPT_PASSES).timetable(k, m)
        S.check_dependencies(plan)
        one = T.step_time(S.OneFOneB().timetable(k, m), costs)  # its fused backward: B + W
        zb = T.step_time(plan, costs)
        assert zb.time < one.time, (k, m)
        f1, b1, w1 = S._zero_bubble_tables(k, m)
        one_pass = S.Timetable("zerobubble", k, m, 1, f1, np.zeros_like(f1), b1, stash_slots=k,
                          wgt=w1, grad_slots=k)  # fmt: skip
        assert zb.time <= T.step_time(one_pass, costs).time  # the better of the two
    one_pass_64 = T.step_time(one_pass, costs).time / one.time
    assert one_pass_64 > 1  # the defect the choice mends: ZB-H1 slower than 1F1B at M = 16K
    assert zb.time / one.time < 1


def test_zero_bubble_aligned_table_by_hand():
    """K = 2, M = 4, F = 1, B = 1.2, W = 0.8. 1F1B's F and B ticks (stage 0: F at i, B at
    i + 2; stage 1: F and B at i + 1). A W joins a tick where its stage ends no later than the
    tick's busiest stage (more than 2K = 4 waiting never happens here):

    tick 0: s0 F0 (1)                         length 1
    ticks 1-3: both stages F + B (2.2): no room for a W (3.0 > 2.2)
    tick 4: s0 B2 (1.2) + W0 = 2.0 <= s1's F3 + B3 = 2.2: W0 joins
    tick 5: s0 B3 (1.2); s1 idle: its W0 (0.8 <= 1.2) joins
    ticks 6-8: W1, W2, W3 on both stages (0.8 each)
    time 1 + 4 x 2.2 + 1.2 + 3 x 0.8 = 13.4; 1F1B (fused backward 2.0): 1 + 4 x 3 + 2 = 15.
    """
    f, b, w = S._aligned_tables(2, 4, 1.0, 1.2, 0.8)
    assert f.T.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1, -1], [-1, 0, 1, 2, 3, -1, -1, -1, -1]]
    assert b.T.tolist() == [[-1, -1, 0, 1, 2, 3, -1, -1, -1], [-1, 0, 1, 2, 3, -1, -1, -1, -1]]
    assert w.T.tolist() == [[-1, -1, -1, -1, 0, -1, 1, 2, 3], [-1, -1, -1, -1, -1, 0, 1, 2, 3]]
    stash, grad = S.ring_slots(f, b, w)
    plan = S.Timetable("zerobubble", 2, 4, 1, f, np.zeros_like(f), b, stash_slots=stash, wgt=w,
                  grad_slots=grad)  # fmt: skip
    S.check_dependencies(plan)
    costs = _measured(2, 1.0, 1.2, 0.8)
    assert T.step_time(plan, costs).time == pytest.approx(13.4)
    one = T.step_time(S.OneFOneB().timetable(2, 4), dataclasses.replace(costs, backward=(2.0, 2.0)))
    assert one.time == pytest.approx(15.0)


def test_zero_bubble_meets_its_target_at_k4_m8_with_the_gpts_passes():
    f, b, w = GPT_PASSES
    costs = _measured(4, f, b, w)
    zb = T.step_time(S.ZeroBubble().timetable(4, 8), costs).time
    one = T.step_time(S.OneFOneB().timetable(4, 8), costs)  # the fused backward: B + W
    assert zb / one.time <= 0.85  # 0.833: the ZB-H1 optimum with these passes


def test_zero_bubble_rings_stay_flat_in_m():
    for k in (2, 4, 8):
        slots = {m: S.ZeroBubble().timetable(k, m) for m in (4 * k, 8 * k, 16 * k)}
        assert len({(p.stash_slots, p.grad_slots) for p in slots.values()}) == 1
        assert slots[4 * k].stash_slots <= 3 * k  # 1F1B's 2K - 1, and at most 2K W's waiting


@pytest.mark.parametrize("bad", [(1, 1), (1, 0, 1), (1, -1, 1), "fast", (1, float("nan"), 1)])
def test_zero_bubble_refuses_bad_pass_costs(bad):
    with pytest.raises(ValueError, match=r"ZeroBubble: pass_costs must be three numbers > 0"):
        S.ZeroBubble(pass_costs=bad)


def _tables(plan, **change):
    tables = {"fwd": plan.fwd, "bwd": plan.bwd, "wgt": plan.wgt, **change}
    kw = dict(stash_slots=plan.stash_slots, grad_slots=plan.grad_slots)
    kw.update({n: change.pop(n) for n in list(change) if n.endswith("_slots")})
    return S.Timetable(
        plan.schedule, plan.num_stages, plan.num_microbatches, 1, tables["fwd"],
        plan.fwd_repeat, tables["bwd"], wgt=tables["wgt"], **kw,
    )  # fmt: skip


def test_check_dependencies_refuses_each_broken_rule():
    plan = S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(3, 4)
    for good in (
        plan,
        S.OneFOneB().timetable(3, 4),
        S.GPipe().timetable(3, 2),
        S.Circular(2).timetable(2, 4),
    ):
        S.check_dependencies(good)
    f, b, w = plan.fwd, plan.bwd, plan.wgt
    tb, tw = _pass_ticks(b, 4), _pass_ticks(w, 4)
    same = np.array(w)
    same[tw[0, 0], 0], same[tb[0, 0], 0] = -1, 0  # W in its B's tick: allowed (B phase first)
    S.check_dependencies(_tables(plan, wgt=same))
    early_w = np.array(w)
    early_w[tw[0, 1], 1], early_w[tb[0, 1] - 1, 1] = -1, 0
    early_b = np.array(b)
    early_b[tb[0, 0], 0], early_b[tb[0, 1], 0] = -1, 0  # stage 0's B with stage 1's
    early_f = np.array(f)
    early_f[_pass_ticks(f, 4)[0, 1], 1], early_f[0, 1] = -1, 0  # with stage 0's F of 0
    twice = np.array(w)
    twice[tw[1, 2], 2] = 0
    cases = [
        (dict(fwd=early_f), r"F of micro-batch 0 runs at tick \d+ on logical stage 1 but needs F on the previous stage at an earlier tick"),
        (dict(bwd=early_b), r"B of micro-batch 0 runs at tick \d+ on logical stage 0 but needs B on the next stage at an earlier tick"),
        (dict(wgt=early_w), r"W of micro-batch 0 runs at tick \d+ on logical stage 1 but needs B on the same stage at the same tick or earlier"),
        (dict(wgt=twice), r"wgt\[\d+, 2\] = 0 already ran at tick \d+; each micro-batch in \[0, 4\) must run once per logical stage"),
        (dict(wgt=np.where(w == 3, -1, w)), r"micro-batch 3 never runs on logical stage 0 in wgt"),
        (dict(wgt=np.where(w == 1, 2, np.where(w == 2, 1, w))), r"logical stage 0 runs wgt of micro-batch 2 at tick \d+, not after micro-batch 1"),
        (dict(stash_slots=2), r"the tables need stash_slots >= 3 and grad_slots >= 3; the plan has 2 and 3"),
        (dict(grad_slots=1), r"the tables need stash_slots >= 3 and grad_slots >= 3; the plan has 3 and 1"),
    ]  # fmt: skip
    for change, match in cases:
        with pytest.raises(
            ValueError, match=r"check_dependencies\(zerobubble, K=3, M=4\): " + match
        ):
            S.check_dependencies(_tables(plan, **change))
    # Forward-only plans (GPipe, Circular): the logical stages in order, each once.
    circ = S.Circular(2).timetable(2, 2)
    for fwd, match in [
        (np.where(circ.fwd == 1, -1, circ.fwd), r"micro-batch 1 never runs logical stage 0 in fwd"),
        (circ.fwd[[1, 0, 2, 3, 4]], r"F of micro-batch 0 runs at tick 0 on logical stage 1 but needs F of the previous logical stage at an earlier tick"),
    ]:  # fmt: skip
        bad = S.Timetable("circular", 2, 2, 2, fwd, circ.fwd_repeat, circ.bwd)
        with pytest.raises(ValueError, match=r"check_dependencies\(circular, K=2, M=2\): " + match):
            S.check_dependencies(bad)


def test_zero_bubble_get_and_refusal():
    assert S.get("zerobubble") == S.get(" ZB ") == S.ZeroBubble()
    sched = S.ZeroBubble()
    assert S.get(sched) is sched and sched.name == "zerobubble" and sched.repeats == 1
    with pytest.raises(ValueError, match=r"ZeroBubble.timetable: num_microbatches must be >= num_stages; got num_microbatches=3 with num_stages=4: .*>= 4, or GPipe\(\)"):  # fmt: skip
        sched.timetable(4, 3)
    with pytest.raises(ValueError, match=r"unknown schedule 'z'.*'zerobubble', 'zb'"):
        S.get("z")


# -- pictures with W, and to scale ---------------------------------------------------------------


def test_render_zero_bubble_shows_w():
    text = P.render(S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(4, 8))
    ticks, cells, rest = _grid(text, 4)
    assert ticks == list(range(27)) and all(len(row) == 27 for row in cells)
    flat = " ".join(" ".join(row) for row in cells)
    for i in range(8):
        for kind in "FBW":
            assert len(re.findall(rf"{kind}{i}(?![0-9])", flat)) == 4
    assert "W3 = its weight-gradient pass" in rest[0] and "F5B1W0" in rest[0]
    assert rest[1] == "schedule=zerobubble K=4 M=8 V=1 ticks=27 bubble=0.1111 (f=1, b=1, w=1)"


def test_render_cell_with_f_b_and_w_in_one_tick():
    one = np.zeros((1, 1), np.int32)
    plan = S.Timetable("zerobubble", 1, 1, 1, one, one, one, stash_slots=1, wgt=one, grad_slots=1)
    S.check_dependencies(plan)
    assert _grid(P.render(plan), 1)[1] == [["F0B0W0"]]


def _scaled(text, k):
    lines = text.splitlines()
    return (
        lines[0],
        [line[len(f"stage {k - 1}") + 2 :] for line in lines[1 : k + 1]],
        lines[k + 1 :],
    )


def test_render_to_scale_places_each_pass_at_its_modelled_time():
    costs = T.StageCosts(forward=(1, 2), backward_input=(1, 1), backward_weight=(1, 1),
                         backward=(2, 4))  # fmt: skip
    plan = S.GPipe().timetable(2, 3)
    st = T.step_time(plan, costs)
    text = P.render(plan, costs=costs)
    header, rows, rest = _scaled(text, 2)
    scale = 4  # "[F0]" (4 characters) for the cheapest pass, cost 1
    assert [len(r) for r in rows] == [st.time * scale] * 2
    # Tick c starts at start[c]: its number stands there in the header.
    for c, t0 in enumerate(st.start):
        assert header[len("stage 1  ") + int(t0 * scale) :].startswith(str(c))
    assert rows[0][:12] == "[F0][F1]...."  # tick 1 lasts 2: stage 1's forward costs 2
    assert rows[1][:12] == "....[F0    ]"
    assert rows[1][-24:] == "[B0------------]" + "." * 8  # the last tick: stage 0's B0
    assert rows[0][-8:] == "[B0    ]"
    assert rows[0].count(".") == scale * (st.time - st.work[0])  # idle = modelled bubble
    assert rows[1].count(".") == scale * (st.time - st.work[1])
    assert "[F3--] spans the pass's modelled time" in rest[0]
    assert rest[1].startswith("schedule=gpipe K=2 M=3")
    assert rest[2] == (
        "modelled: time=21 units, bubble=0.3571, work per device=[9, 18], dataflow_time=21 "
        "(without tick barriers)"
    )


def test_render_to_scale_zero_bubble_wraps_and_keeps_ticks():
    text = P.render(
        S.ZeroBubble(pass_costs=(1, 1, 1)).timetable(4, 8), costs=T.StageCosts.equal(4), width=70
    )
    blocks = text.split("\n\n")
    assert len(blocks) == 2 and all(len(line) <= 70 for b in blocks for line in b.splitlines()[:5])
    rows = ["".join(b.splitlines()[1 + s][len("stage 3  ") :] for b in blocks) for s in range(4)]
    assert rows[0] == "[F0][F1][F2][F3]............[B0][W0][F4]" + rows[0][40:]
    assert all(len(r) == 27 * 4 for r in rows)
    marks = [x for b in blocks for x in b.splitlines()[0].split()[1:]]
    assert marks == [str(c) for c in range(27)]  # blocks end at tick boundaries
    assert (
        blocks[1].splitlines()[1].split()[2] == "[F6][B3][W3][F7][B4][W4][B5][W5][B6][W6][B7][W7]"
    )
    assert text.splitlines()[-1].startswith("modelled: time=27 units, bubble=0.1111")


def test_render_without_costs_is_unchanged():
    plan = S.OneFOneB().timetable(2, 2)
    assert P.render(plan) == (
        "tick     0    1    2    3\n"
        "stage 0  F0   F1   B0   B1\n"
        "stage 1  .    F0B0 F1B1 .\n"
        "legend: F3 = forward of micro-batch 3, B3 = its backward, . = idle (bubble); F5B1 = "
        "forward of 5 and backward of 1 in the same tick\n"
        "schedule=1f1b K=2 M=2 V=1 ticks=4 bubble=0.3333 (f=1, b=2)"
    )


def test_render_png_with_w_and_to_scale(tmp_path):
    pytest.importorskip("matplotlib")
    for name, kw in [("zb", {}), ("zbs", {"costs": T.StageCosts.equal(4)})]:
        path = tmp_path / f"{name}.png"
        P.render("zb", 4, 4, path=str(path), **kw)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = tmp_path / "c.png"
    P.render(S.Circular(2), 2, 4, path=str(path), costs=T.StageCosts.equal(4, forward=2))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- Interleaved1F1B (Megatron-LM's virtual pipeline) -------------------------------------------
#
# Worked by hand for K=2, V=2, M=4 (logical stage j = r*K + s: device 0 runs j=0 "a" and j=2 "b",
# device 1 runs j=1 "a" and j=3 "b"). Megatron-LM's order per device: forwards in groups of K
# micro-batches per virtual stage, F0a F1a F0b F1b F2a F3a F2b F3b; backwards likewise with the
# virtual stages reversed, B0b B1b B0a B1a B2b B3b B2a B3a; device s first runs
# 2(K-1-s) + (V-1)K + 1 forwards (5 on device 0, 3 on device 1), then one backward, one forward.
# A pass runs at the first tick its input is there, one F and one B per tick at most:
#   tick 0: d0 F0a.  1: d0 F1a, d1 F0a.  2: d0 F0b (F0 left j=1 at tick 1), d1 F1a.
#   3: d0 F1b; d1 F0b and, on the last stage, its backward B0b at once.
#   4: d0 F2a and B0b (j=2; B0 left j=3 at tick 3); d1 F1b B1b.
#   5: d0 F3a B1b; d1 F2a B0a.  6: d0 F2b B0a; d1 F3a B1a.  7: d0 F3b B1a; d1 F2b B2b.
#   8: d0 B2b (no forward left); d1 F3b B3b.  9: d0 B3b; d1 B2a.  10: d0 B2a; d1 B3a.  11: d0 B3a.
# 12 ticks. With f=1, b=2 in lock-step a tick costs its busiest device: ticks 0-2 cost 1, ticks
# 3-8 cost 3 (a device runs F and B), ticks 9-11 cost 2: 3 + 18 + 6 = 27, while each device
# works V*M*(f+b) = 24: the bubble is 3/27 = 1/9 = (K-1)/(V*M+K-1).
#
# What the example shows holds in general: every hop takes exactly one tick (F(i, j+1) = F(i, j)
# + 1, B(i, j-1) = B(i, j) + 1) and the last stage's B runs with its F, so micro-batch i's passes
# are fixed by F(i, 0); device 0 runs one forward per tick in its order until they run out, so
# F(i, 0) = (i // K)*V*K + i % K: the forwards are Circular's. With S = V*K the last B is
# B(M-1, 0) = F(M-1, 0) + 2(S-1), so T = V*M + V*K + K - 2 ticks: V*K - 1 ticks of forwards
# only, V*M - V*K + K ticks where a device runs F and B, V*K - 1 of backwards only; lock-step
# time (V*K - 1)(f + b) + (V*M - V*K + K)(f + b) = (V*M + K - 1)(f + b).

IL_GRID = [(k, v) for k in (2, 3, 4, 8) for v in (2, 3, 4)]


def _virtual_ticks(table, repeat, k, v, m):
    """``[M, V*K]``: the tick of micro-batch i's pass on logical stage j; each runs exactly once."""
    ticks = np.full((m, v * k), -1)
    for t, s in zip(*np.nonzero(table >= 0)):
        i, j = int(table[t, s]), int(repeat[t, s]) * k + int(s)
        assert ticks[i, j] < 0, f"micro-batch {i} runs twice on logical stage {j}"
        ticks[i, j] = t
    assert (ticks >= 0).all(), f"never run: {np.argwhere(ticks < 0)[:3].tolist()}"
    return ticks


def _megatron_order(k, m, v):
    """Megatron-LM's forward order on every device, as ``(micro-batch, virtual stage)``: groups
    of K micro-batches, each group through virtual stage 0, 1, ..., V-1."""
    return [(g * k + x, r) for g in range(m // k) for r in range(v) for x in range(k)]


@pytest.mark.parametrize(("k", "v"), IL_GRID)
def test_interleaved_runs_each_pass_once_in_megatrons_order(k, v):
    for m in range(k, 8 * k + 1, k):
        plan = S.Interleaved1F1B(repeats=v).timetable(k, m)
        assert (plan.schedule, plan.num_stages, plan.num_microbatches, plan.repeats) == (
            "interleaved", k, m, v,
        )  # fmt: skip
        for table in (plan.fwd, plan.fwd_repeat, plan.bwd, plan.bwd_repeat):
            assert table.dtype == np.int32 and table.shape == (plan.num_ticks, k)
        assert (plan.wgt == -1).all()  # the backward is fused
        assert (plan.fwd_repeat[plan.fwd < 0] == 0).all()
        assert (plan.bwd_repeat[plan.bwd < 0] == 0).all()
        S.check_dependencies(plan)
        # Every (micro-batch, logical stage) runs one F and one B, in dependency order.
        f = _virtual_ticks(plan.fwd, plan.fwd_repeat, k, v, m)
        b = _virtual_ticks(plan.bwd, plan.bwd_repeat, k, v, m)
        assert (f[:, 1:] > f[:, :-1]).all() and (b[:, :-1] > b[:, 1:]).all() and (b >= f).all()
        assert (plan.fwd[-1] >= 0).any() or (plan.bwd[-1] >= 0).any()  # no idle tick at the end
        # Each device: forwards and backwards in Megatron-LM's order; its warm-up forwards, then
        # one backward and one forward (in the tick of the backward at the earliest).
        forwards = _megatron_order(k, m, v)
        backwards = [(i, v - 1 - r) for i, r in forwards]
        for s in range(k):
            tf = [f[i, r * k + s] for i, r in forwards]
            tb = [b[i, r * k + s] for i, r in backwards]
            assert tf == sorted(tf) and tb == sorted(tb), s
            warm = min(v * m, 2 * (k - 1 - s) + (v - 1) * k + 1)
            for x, t in enumerate(tb):
                ran_before = sum(u < t for u in tf)
                ran_by = sum(u <= t for u in tf)
                assert ran_before <= min(warm + x, v * m) <= ran_by <= warm + x + 1, (s, x)


@pytest.mark.parametrize(("k", "v"), [(1, 2), (1, 3), *IL_GRID])
def test_interleaved_forwards_are_circulars_and_backwards_mirror_them(k, v):
    """The closed form worked out above: one tick per hop, the forwards of `Circular`."""
    n = v * k
    for m in range(k, 8 * k + 1, k):
        plan = S.Interleaved1F1B(repeats=v).timetable(k, m)
        f = _virtual_ticks(plan.fwd, plan.fwd_repeat, k, v, m)
        b = _virtual_ticks(plan.bwd, plan.bwd_repeat, k, v, m)
        i, j = np.indices((m, n))
        assert np.array_equal(f, ((i // k) * n + i % k)[:, :1] + j)
        assert np.array_equal(b, f[:, -1:] + (n - 1 - j))
        assert plan.num_ticks == v * m + v * k + k - 2
        circ = S.Circular(repeats=v).timetable(k, m)
        assert np.array_equal(plan.fwd[: circ.num_ticks], circ.fwd)
        assert np.array_equal(plan.fwd_repeat[: circ.num_ticks], circ.fwd_repeat)
        assert (plan.fwd[circ.num_ticks :] == -1).all()


def test_interleaved_by_hand_at_k2_v2_m4():
    plan = S.Interleaved1F1B(repeats=2).timetable(2, 4)
    text = P.render(plan)
    ticks, cells, rest = _grid(text, 2)
    assert ticks == list(range(12))  # the example worked by hand above
    assert cells[0] == [
        "F0a", "F1a", "F0b", "F1b", "F2aB0b", "F3aB1b", "F2bB0a", "F3bB1a", "B2b", "B3b", "B2a", "B3a",
    ]  # fmt: skip
    assert cells[1] == [
        ".", "F0a", "F1a", "F0bB0b", "F1bB1b", "F2aB0a", "F3aB1a", "F2bB2b", "F3bB3b", "B2a", "B3a", ".",
    ]  # fmt: skip
    assert "the letter is the repeat (a = virtual stage 0 of the device, b = 1" in rest[0]
    assert rest[1] == "schedule=interleaved K=2 M=4 V=2 ticks=12 bubble=0.1111 (f=1, b=2)"
    assert Fraction(plan.bubble_fraction()).limit_denominator(1000) == Fraction(1, 9)
    st = T.step_time(plan, T.StageCosts.equal(4, forward=1, backward=2))
    assert st.tick_times.tolist() == [1, 1, 1, 3, 3, 3, 3, 3, 3, 2, 2, 2]
    assert st.time == 27 and st.work.tolist() == [24, 24]
    # Three virtual stages: letters a, b, c; each micro-batch's F and B on every logical stage.
    flat = " ".join(" ".join(row) for row in _grid(P.render(S.Interleaved1F1B(3), 2, 4), 2)[1])
    for i in range(4):
        for kind in "FB":
            assert sorted(re.findall(rf"{kind}{i}([abc])", flat)) == ["a", "a", "b", "b", "c", "c"]


def _replay_virtual_rings(plan, stash_slots, grad_slots):
    """Runs one stash ring and one cotangent ring per logical stage, as the engine does with a
    fused backward; False if a live entry would be overwritten."""
    k, n = plan.num_stages, plan.num_stages * plan.repeats
    stash = [[None] * stash_slots for _ in range(n)]
    grads = [[None] * grad_slots for _ in range(n)]
    arrive_x, arrive_g = {}, {}  # (tick, logical stage) -> micro-batch arriving at the tick's start
    for t in range(plan.num_ticks):
        f = [(int(plan.fwd[t, s]), int(plan.fwd_repeat[t, s]) * k + s) for s in range(k)]
        b = [(int(plan.bwd[t, s]), int(plan.bwd_repeat[t, s]) * k + s) for s in range(k)]
        writes = [(stash, j, i, stash_slots) for i, j in f if i >= 0 and j == 0]
        writes += [(grads, j, i, grad_slots) for i, j in f if i >= 0 and j == n - 1]  # the loss
        writes += [(stash, j, i, stash_slots) for (u, j), i in arrive_x.items() if u == t]
        writes += [(grads, j, i, grad_slots) for (u, j), i in arrive_g.items() if u == t]
        for ring, j, i, slots in writes:
            if ring[j][i % slots] is not None:
                return False
            ring[j][i % slots] = i
        for i, j in f:
            if i >= 0:
                assert stash[j][i % stash_slots] == i, "read an input that is not there"
                if j + 1 < n:
                    arrive_x[t + 1, j + 1] = i
        for i, j in b:
            if i >= 0:
                assert stash[j][i % stash_slots] == i and grads[j][i % grad_slots] == i
                stash[j][i % stash_slots] = grads[j][i % grad_slots] = None
                if j > 0:
                    arrive_g[t + 1, j - 1] = i
    return all(x is None for ring in (stash, grads) for row in ring for x in row)


@pytest.mark.parametrize(("k", "v"), [(1, 2), (2, 2), (3, 3), (4, 2), (4, 4), (8, 3)])
def test_interleaved_memory_is_flat_in_m(k, v):
    """Logical stage 0 keeps micro-batch i's input from F(i, 0) to B(i, 0) = F(i, 0) + 2(V*K - 1),
    2*V*K - 1 ticks, while the inputs arrive K per V*K ticks (F(i, 0) above): 2K at most are live
    (micro-batches 0..2K-1 at tick 2*V*K - 2). A cotangent arrives in the tick of its backward
    (one tick per hop; the last stage's from the loss, with its F): one slot. So the rings hold
    min(M, 2K) and 1 micro-batches per virtual stage, whatever M."""
    slots = set()
    for m in (k, 2 * k, 4 * k, 16 * k):
        plan = S.Interleaved1F1B(repeats=v).timetable(k, m)
        assert (plan.stash_slots, plan.grad_slots) == (min(m, 2 * k), 1), m
        assert _replay_virtual_rings(plan, plan.stash_slots, plan.grad_slots), m
        if plan.stash_slots > 1:
            assert not _replay_virtual_rings(plan, plan.stash_slots - 1, plan.grad_slots), m
        if m >= 2 * k:
            slots.add((plan.stash_slots, plan.grad_slots))
    assert len(slots) == 1  # the same at M = 2K, 4K and 16K
