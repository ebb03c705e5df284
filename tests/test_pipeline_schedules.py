"""Pipeline schedules: the tick tables, their invariants, bubbles, validation and pictures."""

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
        (lambda: P.render("gpipe"), r"render: pass num_stages and num_microbatches"),
        (lambda: P.render(S.GPipe().plan(2, 2), 3), r"num_stages=3 does not match"),
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
    plan = S.get(sched).plan(k, m)
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
    plan = S.Circular(3).plan(4, 8)
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
    plan = S.ZeroBubble().plan(k, m)
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
    plan = S.ZeroBubble().plan(k, m)
    assert plan.num_ticks == 3 * m + k - 1  # ZB-H1: one unit of bubble per stage boundary
    assert plan.bubble_fraction() == pytest.approx((k - 1) / (3 * m + k - 1))
    assert plan.bubble_fraction() <= S.OneFOneB().plan(k, m).bubble_fraction()
    assert (plan.stash_slots, plan.grad_slots) == (k, k)  # 2K, like 1F1B's 2K - 1 (+1 spare)
    assert (plan.stash_slots, plan.grad_slots) == S.ring_slots(plan.fwd, plan.bwd, plan.wgt)


def test_zero_bubble_targets_at_k4_m8():
    zb, one = S.ZeroBubble().plan(4, 8), S.OneFOneB().plan(4, 8)
    assert zb.bubble_fraction() <= 0.5 * one.bubble_fraction()
    assert Fraction(zb.bubble_fraction()).limit_denominator(1000) == Fraction(3, 27)
    assert zb.stash_slots + zb.grad_slots <= 1.5 * (2 * 4)


def test_zero_bubble_cells_and_wait_rule():
    plan = S.ZeroBubble().plan(2, 3)
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
    plan = sched.plan(k, m)
    stash, grad = S.ring_slots(plan.fwd, plan.bwd, plan.wgt)
    if sched.name == "1f1b":
        assert (stash, grad) == (min(2 * k - 1, m), 1) and plan.stash_slots >= stash
    assert _replay_rings(plan, stash, grad)
    if stash > 1:
        assert not _replay_rings(plan, stash - 1, grad)
    if grad > 1:
        assert not _replay_rings(plan, stash, grad - 1)


def _tables(plan, **change):
    tables = {"fwd": plan.fwd, "bwd": plan.bwd, "wgt": plan.wgt, **change}
    kw = dict(stash_slots=plan.stash_slots, grad_slots=plan.grad_slots)
    kw.update({n: change.pop(n) for n in list(change) if n.endswith("_slots")})
    return S.Plan(
        plan.schedule, plan.num_stages, plan.num_microbatches, 1, tables["fwd"],
        plan.fwd_repeat, tables["bwd"], wgt=tables["wgt"], **kw,
    )  # fmt: skip


def test_check_dependencies_refuses_each_broken_rule():
    plan = S.ZeroBubble().plan(3, 4)
    for good in (plan, S.OneFOneB().plan(3, 4), S.GPipe().plan(3, 2), S.Circular(2).plan(2, 4)):
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
    circ = S.Circular(2).plan(2, 2)
    for fwd, match in [
        (np.where(circ.fwd == 1, -1, circ.fwd), r"micro-batch 1 never runs logical stage 0 in fwd"),
        (circ.fwd[[1, 0, 2, 3, 4]], r"F of micro-batch 0 runs at tick 0 on logical stage 1 but needs F of the previous logical stage at an earlier tick"),
    ]:  # fmt: skip
        bad = S.Plan("circular", 2, 2, 2, fwd, circ.fwd_repeat, circ.bwd)
        with pytest.raises(ValueError, match=r"check_dependencies\(circular, K=2, M=2\): " + match):
            S.check_dependencies(bad)


def test_zero_bubble_get_and_refusal():
    assert S.get("zerobubble") == S.get(" ZB ") == S.ZeroBubble()
    sched = S.ZeroBubble()
    assert S.get(sched) is sched and sched.name == "zerobubble" and sched.repeats == 1
    with pytest.raises(ValueError, match=r"ZeroBubble.plan: num_microbatches must be >= num_stages; got num_microbatches=3 with num_stages=4: .*>= 4, or GPipe\(\)"):  # fmt: skip
        sched.plan(4, 3)
    with pytest.raises(ValueError, match=r"unknown schedule 'z'.*'zerobubble', 'zb'"):
        S.get("z")


# -- pictures with W, and to scale ---------------------------------------------------------------


def test_render_zero_bubble_shows_w():
    text = P.render("zb", 4, 8)
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
    plan = S.Plan("zerobubble", 1, 1, 1, one, one, one, stash_slots=1, wgt=one, grad_slots=1)
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
    plan = S.GPipe().plan(2, 3)
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
    text = P.render("zb", 4, 8, costs=T.StageCosts.equal(4), width=70)
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
    plan = S.OneFOneB().plan(2, 2)
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
