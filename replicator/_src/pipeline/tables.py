"""Tick tables of the schedules with explicit backward ticks, built in NumPy.

Each builder returns ``[T, K]`` int tables (-1 where a stage is idle) that `schedules` wraps
in a `schedules.Timetable`: 1F1B's diagonals, ZeroBubble's two tables (ZB-H1's one pass per tick, and
1F1B's ticks with each weight-gradient pass where it fits) and Megatron-LM's interleaved order.
"""

from __future__ import annotations

import numpy as np


def diagonal(k: int, m: int, num_ticks: int) -> np.ndarray:
    """``[T, K]`` with ``t - s`` where that is a micro-batch in ``[0, m)``, else -1."""
    i = np.arange(num_ticks)[:, None] - np.arange(k)[None, :]
    return np.where((i >= 0) & (i < m), i, -1).astype(np.int32)


def one_f_one_b_order(k: int, m: int, s: int) -> list[tuple[int, int]]:
    """Stage ``s``'s F (0) and B (1) passes in 1F1B order, as ``(phase, micro-batch)``."""
    warm = min(k - s, m)
    order = [(0, i) for i in range(warm)]
    for i in range(m):
        order.append((1, i))
        if warm + i < m:
            order.append((0, warm + i))
    return order


def zero_bubble_tables(k: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ZB-H1's ``fwd``, ``bwd``, ``wgt`` tables (see `ZeroBubble`)."""
    never = 1 << 30
    ran = np.full((2, m, k), never)  # the tick of F (0) and B (1) of (i, s)
    orders = [one_f_one_b_order(k, m, s) for s in range(k)]
    nxt, done_w = [0] * k, [0] * k
    rows = []
    while min(done_w) < m:
        t, row = len(rows), np.full((3, k), -1, np.int32)
        for s in range(k):
            pending = int((ran[1, :, s] < t).sum()) - done_w[s]
            ready = False
            if nxt[s] < len(orders[s]):
                p, i = orders[s][nxt[s]]
                if p == 0:
                    ready = s == 0 or ran[0, i, s - 1] < t
                else:
                    ready = ran[0, i, s] < t and (s == k - 1 or ran[1, i, s + 1] < t)
            if ready and pending <= s:
                row[p, s], ran[p, i, s] = i, t
                nxt[s] += 1
            elif pending:
                row[2, s] = done_w[s]
                done_w[s] += 1
        rows.append(row)
    fwd, bwd, wgt = np.stack(rows, axis=1)
    return fwd, bwd, wgt


def interleaved_order(k: int, m: int, v: int, s: int) -> list[tuple[int, int, int]]:
    """Device ``s``'s passes in Megatron-LM's interleaved order, as ``(phase, mb, repeat)``."""
    n = v * m
    chunk = [(x // k) % v for x in range(n)]
    mb = [(x // (k * v)) * k + x % k for x in range(n)]
    fwd = [(0, mb[x], chunk[x]) for x in range(n)]
    bwd = [(1, mb[x], v - 1 - chunk[x]) for x in range(n)]
    warm = min(n, 2 * (k - 1 - s) + (v - 1) * k + 1)
    order = fwd[:warm]
    for x in range(n):
        order.append(bwd[x])
        if warm + x < n:
            order.append(fwd[warm + x])
    return order


def interleaved_tables(k: int, m: int, v: int) -> tuple[np.ndarray, ...]:
    """`Interleaved1F1B`'s ``fwd``, ``fwd_repeat``, ``bwd``, ``bwd_repeat`` tables.

    Each tick, each device runs the head of its order if its inputs are there (a forward needs
    the previous logical stage's forward at an earlier tick; a backward its own forward at this
    tick or earlier and the next logical stage's backward at an earlier tick), and then the pass
    after it too if that is of the other kind and ready.
    """
    never, last = 1 << 30, v * k - 1
    ran = np.full((2, m, v * k), never)  # the tick of F (0) and B (1) of (i, j)
    orders = [interleaved_order(k, m, v, s) for s in range(k)]
    nxt = [0] * k
    rows = []
    while any(n < len(o) for n, o in zip(nxt, orders, strict=True)):
        t, row = len(rows), np.full((4, k), -1, np.int32)
        row[1], row[3] = 0, 0
        for s in range(k):
            for _ in range(2):
                if nxt[s] == len(orders[s]):
                    break
                p, i, r = orders[s][nxt[s]]
                j = r * k + s
                if row[2 * p, s] >= 0:  # one pass of each kind per tick
                    break
                if p == 0:
                    ready = j == 0 or ran[0, i, j - 1] < t
                else:
                    ready = ran[0, i, j] <= t and (j == last or ran[1, i, j + 1] < t)
                if not ready:
                    break
                row[2 * p, s], row[2 * p + 1, s], ran[p, i, j] = i, r, t
                nxt[s] += 1
        rows.append(row)
    return tuple(np.stack(rows, axis=1))


def aligned_tables(
    k: int, m: int, f: float, b: float, w: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`ZeroBubble`'s aligned ``fwd``, ``bwd``, ``wgt`` tables: 1F1B's F and B ticks, each W
    where it fits in the tick's length (costs ``f``, ``b``, ``w``) or when more than 2K wait."""
    ticks = m + 2 * k - 2
    fwd = diagonal(k, m, ticks)
    t = np.arange(ticks)[:, None] - 2 * (k - 1) + np.arange(k)[None, :]
    bwd = np.where((t >= 0) & (t < m), t, -1).astype(np.int32)
    idle = np.full(k, -1, np.int32)
    done, rows = np.zeros(k, int), []
    while done.min() < m:
        t = len(rows)
        fr, br = (fwd[t], bwd[t]) if t < ticks else (idle, idle)
        cost = np.where(fr >= 0, f, 0.0) + np.where(br >= 0, b, 0.0)
        pending = (bwd[: t + 1] >= 0).sum(axis=0) - done  # W may follow its B in the tick
        wr = np.where(pending > 2 * k, done, -1).astype(np.int32)  # too many wait: run one
        cost += np.where(wr >= 0, w, 0.0)
        length = cost.max() if cost.max() > 0 else w
        free = (wr < 0) & (pending > 0) & (cost + w <= length * (1 + 1e-9))
        wr = np.where(free, done, wr).astype(np.int32)
        done += wr >= 0
        rows.append((fr, br, wr))
    out = tuple(np.stack(x) for x in zip(*rows, strict=True))
    return out[0], out[1], out[2]
