"""Pipeline schedules: the tick tables, their invariants, bubbles, validation and pictures."""

import itertools
import re
from fractions import Fraction

import numpy as np
import pytest

from replicator._src.pipeline import schedules as S

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
    plan = sched.plan(k, m)
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
    plan = S.GPipe().plan(k, m)
    assert plan.num_ticks == m + k - 1 and plan.stash_slots == 0
    t, s = np.indices(plan.fwd.shape)
    assert np.array_equal(plan.fwd, np.where((t - s >= 0) & (t - s < m), t - s, -1))
    assert (plan.bwd == -1).all() and (plan.fwd_repeat == 0).all()
    assert plan.bubble_fraction() == pytest.approx((k - 1) / (m + k - 1))
    assert plan.bubble_fraction(1.0, 1.0) == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 2), (2, 6), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_circular_ticks_and_bubble(k, m, v):
    plan = S.Circular(repeats=v).plan(k, m)
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
    a, b = S.Circular(repeats=1).plan(k, m), S.GPipe().plan(k, m)
    for name in ("fwd", "fwd_repeat", "bwd"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.bubble_fraction() == pytest.approx(b.bubble_fraction())


@pytest.mark.parametrize(("k", "m"), [(1, 1), (1, 5), (2, 2), (2, 5), (3, 3), (4, 4), (4, 16)])
def test_one_f_one_b_backward_and_stash(k, m):
    plan = S.OneFOneB().plan(k, m)
    assert plan.num_ticks == m + 2 * k - 2
    assert plan.stash_slots == 2 * k - 1 == S.OneFOneB().plan(k, 5 * m).stash_slots
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
    plan = S.OneFOneB().plan(4, 16)
    assert Fraction(plan.bubble_fraction()).limit_denominator(1000) == Fraction(9, 57)
    assert plan.bubble_fraction() == pytest.approx(S.GPipe().plan(4, 16).bubble_fraction())
    # With equal costs every tick costs its busiest stage's work: recompute by hand.
    f, b = 1.0, 1.0
    time = sum(
        max(f * (x >= 0) + b * (y >= 0) for x, y in zip(*row)) for row in zip(plan.fwd, plan.bwd)
    )
    assert plan.bubble_fraction(f, b) == pytest.approx(1 - 16 * (f + b) / time)
    assert S.OneFOneB().plan(1, 3).bubble_fraction() == 0.0


def test_plan_is_read_only():
    plan = S.GPipe().plan(2, 2)
    with pytest.raises(ValueError):
        plan.fwd[0, 0] = 5
    with pytest.raises(AttributeError):
        plan.num_stages = 3


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: S.Circular().plan(4, 2),
            r"num_microbatches.*got num_microbatches=2.*num_microbatches >= 4, or GPipe\(\)",
        ),
        (lambda: S.OneFOneB().plan(4, 3), r"OneFOneB.plan: num_microbatches.*>= 4, or GPipe\(\)"),
        (lambda: S.Circular(repeats=0), r"Circular: repeats must be an int >= 1; got 0"),
        (lambda: S.Circular(repeats=1.5), r"repeats must be an int >= 1; got 1.5"),
        (lambda: S.Circular(repeats=True), r"repeats must be an int >= 1; got True"),
        (lambda: S.GPipe().plan(4, 0), r"plan: num_microbatches must be an int >= 1; got 0"),
        (lambda: S.GPipe().plan(0, 4), r"GPipe.plan: num_stages must be an int >= 1; got 0"),
        (lambda: S.OneFOneB().plan(2.0, 4), r"num_stages must be an int >= 1; got 2.0"),
        (lambda: S.Circular().plan(2, -1), r"Circular.plan: num_microbatches must be an int >= 1"),
        (lambda: S.get("pipedream"), r"unknown schedule 'pipedream'.*'gpipe', 'circular', '1f1b'"),
        (lambda: S.GPipe().plan(2, 2).bubble_fraction(-1.0), r"costs must be >= 0"),
        (lambda: S.render("gpipe"), r"render: pass num_stages and num_microbatches"),
        (lambda: S.render(S.GPipe().plan(2, 2), 3), r"num_stages=3 does not match"),
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
    assert S.GPipe().plan(np.int64(2), np.int32(3)).num_ticks == 4
    with pytest.raises(TypeError, match="got int"):
        S.get(3)
    assert [S.get(n).name for n in ("gpipe", "circular", "1f1b")] == ["gpipe", "circular", "1f1b"]


def _grid(text, k):
    lines = text.splitlines()
    header = lines[0].split()
    assert header[0] == "tick"
    rows = [line.split() for line in lines[1 : k + 1]]
    assert [r[:2] for r in rows] == [["stage", str(s)] for s in range(k)]
    return [int(x) for x in header[1:]], [r[2:] for r in rows], lines[k + 1 :]


@pytest.mark.parametrize(
    ("sched", "k", "m", "columns"),
    [("gpipe", 4, 6, 2 * 9), (S.Circular(2), 2, 4, 2 * 9), ("1f1b", 4, 6, 12), ("gpipe", 1, 1, 2)],
)
def test_render_ascii(sched, k, m, columns):
    text = S.render(sched, k, m)
    ticks, cells, rest = _grid(text, k)
    assert ticks == list(range(columns))
    assert all(len(row) == columns for row in cells)  # "." fills idle cells, so columns align
    flat = " ".join(" ".join(row) for row in cells)
    v = S.get(sched).repeats
    for i in range(m):
        assert len(re.findall(rf"F{i}(?![0-9])", flat)) == k * v
        assert len(re.findall(rf"B{i}(?![0-9])", flat)) == k * v
    assert rest[0].startswith("legend:")
    plan = S.get(sched).plan(k, m)
    assert rest[1] == (
        f"schedule={plan.schedule} K={k} M={m} V={v} ticks={plan.num_ticks} "
        f"bubble={plan.bubble_fraction():.4f} (f=1, b=2)"
    )
    assert S.render(plan) == text
    lengths = {len(line) for line in text.splitlines()[: k + 1]}
    assert max(lengths) - min(lengths) <= max(len(c) for row in cells for c in row)


def test_render_cells():
    cells = _grid(S.render("1f1b", 2, 3), 2)[1]
    assert cells[1] == [".", "F0B0", "F1B1", "F2B2", "."]
    cells = _grid(S.render(S.Circular(2), 2, 2), 2)[1]
    assert cells[0][:4] == ["F0a", "F1a", "F0b", "F1b"]
    assert cells[0][-4:] == ["B1b", "B0b", "B1a", "B0a"]


def test_render_wraps_to_width():
    plan = S.Circular(3).plan(4, 8)
    text = S.render(plan, width=60)
    blocks = text.split("\n\n")
    assert len(blocks) > 1
    ticks = []
    for block in blocks:
        lines = block.splitlines()
        assert all(len(line) <= 60 for line in lines[:5])
        ticks += [int(x) for x in lines[0].split()[1:]]
    assert ticks == list(range(2 * plan.num_ticks))
    assert text.endswith(S.render(plan).splitlines()[-1])


def test_render_png(tmp_path):
    pytest.importorskip("matplotlib")
    for name, sched in [("s", "gpipe"), ("c", S.Circular(2)), ("o", "1f1b")]:
        path = tmp_path / f"{name}.png"
        text = S.render(sched, 4, 8, path=str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "bubble=" in text
