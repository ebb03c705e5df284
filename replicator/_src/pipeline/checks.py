"""The rules a schedule's tick tables must keep, and the ring buffers they need.

`check_dependencies` refuses tables that break an order the engines rely on; `ring_slots` sizes
the ring buffers of stashed inputs and cotangents that tables with backward ticks need. Both
read a plan's tables per logical stage (``j = repeat * K + s``), so they hold for virtual stages.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _op_ticks(
    api: str, table: np.ndarray, name: str, m: int, rep: np.ndarray | None = None, v: int = 1
) -> np.ndarray:
    """``[M, V*K]``: the tick of micro-batch ``i``'s pass on logical stage ``j`` in ``table``
    (``j = rep[t, s] * K + s``; ``rep`` all 0 when ``None``).

    Raises a ValueError when a pass runs twice or never, or a logical stage runs them out of
    order.
    """
    k = table.shape[1]
    rep = np.zeros_like(table) if rep is None else np.asarray(rep)
    ticks = np.full((m, v * k), -1)
    for t, s in zip(*np.nonzero(table >= 0), strict=True):
        i, j = int(table[t, s]), int(rep[t, s]) * k + int(s)
        if i >= m or ticks[i, j] >= 0:
            what = "is not a micro-batch" if i >= m else f"already ran at tick {ticks[i, j]}"
            raise ValueError(
                f"{api}: {name}[{t}, {s}] = {i} {what}; each micro-batch in [0, {m}) must run "
                f"once per logical stage in {name}."
            )
        ticks[i, j] = t
    missing = np.argwhere(ticks < 0)
    if len(missing):
        i, j = missing[0]
        raise ValueError(f"{api}: micro-batch {i} never runs on logical stage {j} in {name}.")
    bad = np.argwhere(np.diff(ticks, axis=0) <= 0)
    if len(bad):
        i, j = bad[0]
        raise ValueError(
            f"{api}: logical stage {j} runs {name} of micro-batch {i + 1} at tick "
            f"{ticks[i + 1, j]}, not after micro-batch {i} (tick {ticks[i, j]}); each stage must "
            f"run them in micro-batch order, so that its ring buffers can be indexed by i % slots."
        )
    return ticks


def _pass_ticks(
    api: str, fwd, bwd, wgt, m: int | None = None, fwd_repeat=None, bwd_repeat=None, v: int = 1
) -> tuple[np.ndarray, ...]:
    """The ticks ``[M, V*K]`` of F, B and W on each logical stage (W = B when the backward is
    fused: ``wgt`` all -1)."""
    fwd, bwd, wgt = (np.asarray(x) for x in (fwd, bwd, wgt))
    m = int(fwd.max()) + 1 if m is None else m
    tf = _op_ticks(api, fwd, "fwd", m, fwd_repeat, v)
    tb = _op_ticks(api, bwd, "bwd", m, bwd_repeat, v)
    tw = tb if (wgt < 0).all() else _op_ticks(api, wgt, "wgt", m)
    return tf, tb, tw


def ring_slots(
    fwd: np.ndarray, bwd: np.ndarray, wgt: np.ndarray, fwd_repeat: np.ndarray | None = None,
    bwd_repeat: np.ndarray | None = None, repeats: int = 1,
) -> tuple[int, int]:  # fmt: skip
    """The ring buffer sizes ``(stash_slots, grad_slots)`` that tables with backward ticks need.

    Micro-batch ``i``'s input is live on logical stage ``j`` from its arrival (tick
    ``F(i,j-1) + 1``; on stage 0 from ``F(i,0)``) through its W (``W = B`` when the backward is
    fused: ``wgt`` all -1); its output cotangent from its arrival (tick ``B(i,j+1) + 1``; on the
    last stage from ``F(i,S-1)``, where the loss makes it) through its W. Passes run in
    micro-batch order on each logical stage, so the live micro-batches form a window; a ring
    indexed by ``i % slots`` (one ring per virtual stage) needs the widest window over logical
    stages and ticks: ``max(largest live i - smallest + 1)``.

    Args:
      fwd: int ``[T, K]``, the forward table.
      bwd: int ``[T, K]``, the backward (B) table.
      wgt: int ``[T, K]``, the W table, or all -1.
      fwd_repeat: int ``[T, K]``, the forwards' virtual stages (all 0 when ``None``).
      bwd_repeat: int ``[T, K]``, the backwards' virtual stages (all 0 when ``None``).
      repeats: V, the virtual stages per device.

    Returns:
      ``(stash_slots, grad_slots)``.

    >>> from replicator._src.pipeline.schedules import OneFOneB
    >>> p = OneFOneB().timetable(3, 6)
    >>> ring_slots(p.fwd, p.bwd, p.wgt)
    (5, 1)
    """
    tf, tb, tw = _pass_ticks(
        "schedules.ring_slots", fwd, bwd, wgt, None, fwd_repeat, bwd_repeat, repeats
    )
    stash_from = np.concatenate([tf[:, :1], tf[:, :-1] + 1], axis=1)
    grad_from = np.concatenate([tb[:, 1:] + 1, tf[:, -1:]], axis=1)
    return _window(stash_from, tw), _window(grad_from, tw)


def _window(first: np.ndarray, last: np.ndarray) -> int:
    """The widest ``max - min + 1`` of the live ``i`` (``first[i, s] <= t <= last[i, s]``)."""
    m = first.shape[0]
    t = np.arange(int(last.max()) + 1)
    live = (first[:, :, None] <= t) & (t <= last[:, :, None])  # [M, K, T]
    i = np.arange(m)[:, None, None]
    hi, lo = np.where(live, i, -1).max(axis=0), np.where(live, i, m).min(axis=0)
    return int(np.where(hi >= 0, hi - lo + 1, 0).max())


def check_dependencies(plan: Any) -> None:
    """Raises a ValueError if ``plan``'s tables break an order the engine relies on.

    In a tick, a stage runs its F phase, then B, then W; at the tick's end it sends its F output
    to stage ``s+1`` and its B output to ``s-1``. So F of ``(i, j)`` needs F of ``(i, j-1)`` at
    an earlier tick (``j`` the logical stage); with backward ticks, B of ``(i, s)`` needs F of
    ``(i, s)`` at the same tick or earlier and B of ``(i, s+1)`` at an earlier tick, and W needs
    B at the same tick or earlier; each pass runs exactly once, in micro-batch order per stage;
    ``stash_slots`` and ``grad_slots`` are at least `ring_slots`.

    Args:
      plan: the `schedules.Timetable` to check.

    Raises:
      ValueError: naming the first broken rule.

    >>> from replicator._src.pipeline.schedules import ZeroBubble
    >>> check_dependencies(ZeroBubble().timetable(4, 8))
    """
    api = f"check_dependencies({plan.schedule}, K={plan.num_stages}, M={plan.num_microbatches})"
    k, m, v = plan.num_stages, plan.num_microbatches, plan.repeats
    if not (plan.bwd >= 0).any():
        ticks = np.full((m, v * k), -1)
        for t, s in zip(*np.nonzero(plan.fwd >= 0), strict=True):
            ticks[plan.fwd[t, s], plan.fwd_repeat[t, s] * k + s] = t
        if (ticks < 0).any():
            i, j = np.argwhere(ticks < 0)[0]
            raise ValueError(f"{api}: micro-batch {i} never runs logical stage {j} in fwd.")
        _check_after(api, ticks[:, 1:], ticks[:, :-1], "F", "F of the previous logical stage", 1)
        return
    tf, tb, tw = _pass_ticks(
        api, plan.fwd, plan.bwd, plan.wgt, m, plan.fwd_repeat, plan.bwd_repeat, v
    )
    _check_after(api, tf[:, 1:], tf[:, :-1], "F", "F on the previous stage", 1)
    _check_after(api, tb, tf, "B", "F on the same stage", 0, first=0)
    _check_after(api, tb[:, :-1], tb[:, 1:], "B", "B on the next stage", 1, first=0)
    _check_after(api, tw, tb, "W", "B on the same stage", 0, first=0)
    stash, grad = ring_slots(plan.fwd, plan.bwd, plan.wgt, plan.fwd_repeat, plan.bwd_repeat, v)
    rings = (plan.wgt >= 0).any() or v > 1  # the engines that keep cotangents in a ring
    if plan.stash_slots < stash or (rings and plan.grad_slots < grad):
        raise ValueError(
            f"{api}: the tables need stash_slots >= {stash} and grad_slots >= "
            f"{grad if rings else 0}; the plan has {plan.stash_slots} and {plan.grad_slots}."
        )


def _check_after(api: str, late, early, what: str, needs: str, gap: int, first: int = 1):
    """Refuses ``late[i, s] < early[i, s] + gap``; column ``s`` is stage ``s + first``."""
    bad = np.argwhere(late < early + gap)
    if len(bad):
        i, s = bad[0]
        when = "an earlier tick" if gap else "the same tick or earlier"
        raise ValueError(
            f"{api}: {what} of micro-batch {i} runs at tick {late[i, s]} on logical stage "
            f"{s + first} "
            f"but needs {needs} at {when} (it runs at tick {early[i, s]})."
        )
