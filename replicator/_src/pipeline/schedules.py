"""Pipeline schedules as pure objects: NumPy tick tables, bubble arithmetic and pictures.

K devices ("stages") run M micro-batches. A schedule is a small frozen dataclass whose
``plan(num_stages, num_microbatches)`` returns a :class:`Plan`: tables ``[T, K]`` telling which
micro-batch each stage runs at each tick. The scanned engine reads them; nothing here needs JAX.

Whatever the schedule, the sequential meaning is the same: every micro-batch runs through the
logical stages ``0, 1, ..., S-1`` in order (``S = K * repeats``) and the gradients are summed over
the micro-batches. A schedule only decides *when* and *where* each piece runs.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, TypeAlias

import numpy as np

from replicator._src.errors import positive_int


def _check_sizes(api: str, num_stages: object, num_microbatches: object) -> tuple[int, int]:
    k = positive_int(
        num_stages, api=api, name="num_stages", fix="Pass the size of the 'stage' mesh axis."
    )
    m = positive_int(
        num_microbatches, api=api, name="num_microbatches",
        fix="Pass how many micro-batches to split into.",
    )  # fmt: skip
    return k, m


def _check_enough(api: str, k: int, m: int, why: str) -> None:
    if m < k:
        raise ValueError(
            f"{api}: num_microbatches must be >= num_stages; got num_microbatches={m} with "
            f"num_stages={k}: {why}. Use num_microbatches >= {k}, or GPipe()."
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The tick tables of a schedule for K stages and M micro-batches (read-only arrays).

    Attributes:
      schedule: ``"gpipe"``, ``"circular"`` or ``"1f1b"``.
      num_stages: K.
      num_microbatches: M.
      repeats: V, the virtual stages per device (1 except for Circular).
      fwd: int32 ``[T, K]``: the micro-batch whose forward stage ``s`` runs at tick ``t``, or -1.
      fwd_repeat: int32 ``[T, K]``: the virtual stage ``r`` of that forward; 0 where idle.
      bwd: int32 ``[T, K]``: the micro-batch whose backward stage ``s`` runs at tick ``t``, or
        -1. All -1 for GPipe and Circular: their backward is autodiff of the forward scan, the
        forward ticks replayed in reverse.
      stash_slots: 1F1B's ring buffer of stashed stage inputs (``2K - 1``); 0 for the others.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    repeats: int
    fwd: np.ndarray
    fwd_repeat: np.ndarray
    bwd: np.ndarray
    stash_slots: int = 0

    def __post_init__(self) -> None:
        for name in ("fwd", "fwd_repeat", "bwd"):
            table = np.array(getattr(self, name), dtype=np.int32)
            if table.ndim != 2 or table.shape[1] != self.num_stages:
                raise ValueError(
                    f"Plan: {name} must have shape [T, {self.num_stages}]; got {table.shape}."
                )
            table.setflags(write=False)
            object.__setattr__(self, name, table)
        if not self.fwd.shape == self.fwd_repeat.shape == self.bwd.shape:
            raise ValueError("Plan: fwd, fwd_repeat and bwd must have the same shape [T, K].")

    @property
    def num_ticks(self) -> int:
        """T, the number of ticks of the scan."""
        return int(self.fwd.shape[0])

    def busy(self) -> np.ndarray:
        """Bool ``[T, K]``: whether stage ``s`` runs a forward or a backward at tick ``t``."""
        return (self.fwd >= 0) | (self.bwd >= 0)

    def bubble_fraction(self, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> float:
        """The idle share of a lock-step step; each tick lasts as long as its busiest stage.

        Without backward ticks (GPipe, Circular) the backward replays the forward ticks, so the
        step lasts ``T * (f + b)`` while each device works ``V * M * (f + b)``: the bubble is
        ``1 - V*M/T``. With them (1F1B) a tick lasts ``max_s(f*[fwd] + b*[bwd])`` and each
        device works ``M * (f + b)``.

        Args:
          fwd_cost: the time of one stage forward on one micro-batch.
          bwd_cost: the time of one stage backward (about twice the forward).
        """
        f, b = float(fwd_cost), float(bwd_cost)
        if f < 0 or b < 0 or f + b <= 0:
            raise ValueError(
                f"Plan.bubble_fraction: costs must be >= 0 and not both 0; got "
                f"fwd_cost={fwd_cost}, bwd_cost={bwd_cost}."
            )
        useful = self.repeats * self.num_microbatches * (f + b)
        if not (self.bwd >= 0).any():
            time = self.num_ticks * (f + b)
        else:
            time = float((f * (self.fwd >= 0) + b * (self.bwd >= 0)).max(axis=1).sum())
        return (time - useful) / time


def _diagonal(k: int, m: int, num_ticks: int) -> np.ndarray:
    """``[T, K]`` with ``t - s`` where that is a micro-batch in ``[0, m)``, else -1."""
    i = np.arange(num_ticks)[:, None] - np.arange(k)[None, :]
    return np.where((i >= 0) & (i < m), i, -1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class GPipe:
    """All forwards, then all backwards (by autodiff of the forward scan).

    Stage ``s`` runs the forward of micro-batch ``i`` at tick ``t = i + s``, so ``T = M + K - 1``
    and ``fwd[t, s] = t - s`` when ``0 <= t - s < M``. The backward is the forward ticks in
    reverse. Sequential meaning: each micro-batch through stages ``0..K-1`` in order. Any
    ``M >= 1`` works; the bubble is ``(K-1)/(M+K-1)``.

    Example:
      >>> plan = GPipe().plan(num_stages=2, num_microbatches=3)
      >>> plan.fwd.T.tolist()
      [[0, 1, 2, -1], [-1, 0, 1, 2]]
      >>> plan.num_ticks, plan.bubble_fraction()
      (4, 0.25)
    """

    name: ClassVar[str] = "gpipe"
    repeats: ClassVar[int] = 1

    def plan(self, num_stages: int, num_microbatches: int) -> Plan:
        """The tick tables for ``num_stages`` devices and ``num_microbatches`` micro-batches."""
        k, m = _check_sizes("GPipe.plan", num_stages, num_microbatches)
        fwd = _diagonal(k, m, m + k - 1)
        return Plan(self.name, k, m, 1, fwd, np.zeros_like(fwd), np.full_like(fwd, -1))


@dataclasses.dataclass(frozen=True)
class Circular:
    """Interleaved (looped) GPipe: V virtual stages per device around a ring.

    The model has ``S = V*K`` logical stages; logical stage ``j = r*K + s`` lives on device ``s``
    as its virtual stage ``r``. Micro-batches go in groups of K: micro-batch ``i`` (group
    ``g = i // K``, position ``q = i % K``) runs its forward on device ``s``, repeat ``r`` at tick
    ``t = s + g*K*V + r*K + q``. Device K-1 at repeat ``r`` hands it to device 0 at repeat
    ``r + 1`` one tick later, so one ring shift ``s -> (s+1) % K`` per tick carries every
    activation. ``T`` is the last tick used plus one: ``V*M + K - 1`` when K divides M, and the
    bubble ``(K-1)/(V*M+K-1)``. The backward is autodiff of the forward scan. Sequential meaning:
    each micro-batch through logical stages ``0..V*K-1`` in order. Needs ``M >= K``.

    Example:
      >>> plan = Circular(repeats=2).plan(num_stages=2, num_microbatches=2)
      >>> plan.fwd.T.tolist(), plan.fwd_repeat.T.tolist()
      ([[0, 1, 0, 1, -1], [-1, 0, 1, 0, 1]], [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
      >>> plan.num_ticks, plan.bubble_fraction()
      (5, 0.2)
    """

    repeats: int = 2
    name: ClassVar[str] = "circular"

    def __post_init__(self) -> None:
        positive_int(
            self.repeats, api="Circular", name="repeats",
            fix="Use Circular(repeats=2) or more, or GPipe() for one stage per device.",
        )  # fmt: skip

    def plan(self, num_stages: int, num_microbatches: int) -> Plan:
        """The tick tables for ``num_stages`` devices and ``num_microbatches`` micro-batches."""
        k, m = _check_sizes("Circular.plan", num_stages, num_microbatches)
        why = "with fewer micro-batches than stages every repeat has idle ring slots and the "
        _check_enough("Circular.plan", k, m, why + "bubble is worse than GPipe's")
        v = int(self.repeats)
        i, r, s = np.meshgrid(np.arange(m), np.arange(v), np.arange(k), indexing="ij")
        t = s + (i // k) * k * v + r * k + i % k
        fwd = np.full((int(t.max()) + 1, k), -1, np.int32)
        rep = np.zeros_like(fwd)
        fwd[t, s], rep[t, s] = i, r
        return Plan(self.name, k, m, v, fwd, rep, np.full_like(fwd, -1))


@dataclasses.dataclass(frozen=True)
class OneFOneB:
    """Synchronous one-forward-one-backward, in one scan with explicit backward ticks.

    Stage ``s`` runs the forward of micro-batch ``i`` at tick ``i + s`` and its backward at tick
    ``i + 2(K-1) - s``; within a tick the forward comes first, so the last stage starts each
    backward at once. ``T = M + 2K - 2``; ``bwd[t, s] = t - 2(K-1) + s`` when in ``[0, M)``.
    Stage ``s`` holds at most ``2(K-1-s) + 1`` stashed inputs, so a ring buffer of
    ``stash_slots = 2K - 1`` indexed by ``i % (2K-1)`` suffices for any M. Sequential meaning:
    each micro-batch through stages ``0..K-1``, then its gradient back through ``K-1..0``.
    Needs ``M >= K``.

    Example:
      >>> plan = OneFOneB().plan(num_stages=2, num_microbatches=2)
      >>> plan.fwd.T.tolist(), plan.bwd.T.tolist(), plan.stash_slots
      ([[0, 1, -1, -1], [-1, 0, 1, -1]], [[-1, -1, 0, 1], [-1, 0, 1, -1]], 3)
    """

    name: ClassVar[str] = "1f1b"
    repeats: ClassVar[int] = 1

    def plan(self, num_stages: int, num_microbatches: int) -> Plan:
        """The tick tables for ``num_stages`` devices and ``num_microbatches`` micro-batches."""
        k, m = _check_sizes("OneFOneB.plan", num_stages, num_microbatches)
        why = "1F1B needs at least K micro-batches in flight to reach its steady state"
        _check_enough("OneFOneB.plan", k, m, why)
        num_ticks = m + 2 * k - 2
        fwd = _diagonal(k, m, num_ticks)
        t = np.arange(num_ticks)[:, None] - 2 * (k - 1) + np.arange(k)[None, :]
        bwd = np.where((t >= 0) & (t < m), t, -1)
        return Plan(self.name, k, m, 1, fwd, np.zeros_like(fwd), bwd, stash_slots=2 * k - 1)


Schedule: TypeAlias = GPipe | Circular | OneFOneB
_BY_NAME = {"gpipe": GPipe, "circular": Circular, "1f1b": OneFOneB}


def get(schedule: Schedule | str) -> Schedule:
    """A schedule object from an instance or a name: ``"gpipe"``, ``"circular"``, ``"1f1b"``.

    >>> get("1f1b")
    OneFOneB()
    """
    if isinstance(schedule, GPipe | Circular | OneFOneB):
        return schedule
    if isinstance(schedule, str):
        cls = _BY_NAME.get(schedule.strip().lower())
        if cls is None:
            raise ValueError(
                f"schedules.get: unknown schedule {schedule!r}; valid names are "
                f"{', '.join(map(repr, _BY_NAME))} (or pass GPipe(), Circular(repeats=V), OneFOneB())."
            )
        return cls()
    raise TypeError(
        f"schedules.get: schedule must be a schedule object or one of the names "
        f"{', '.join(map(repr, _BY_NAME))}; got {type(schedule).__name__}."
    )


# -- pictures -----------------------------------------------------------------------------------


def _columns(plan: Plan) -> tuple[np.ndarray, ...]:
    """Columns of the picture: (fwd, fwd_repeat, bwd, bwd_repeat), each ``[C, K]``.

    Autodiff schedules get the forward ticks, then their mirror: the backward replay.
    """
    if (plan.bwd >= 0).any():
        return plan.fwd, plan.fwd_repeat, plan.bwd, np.zeros_like(plan.bwd)
    idle, zero = np.full_like(plan.fwd, -1), np.zeros_like(plan.fwd)
    return (
        np.concatenate([plan.fwd, idle]),
        np.concatenate([plan.fwd_repeat, zero]),
        np.concatenate([idle, plan.fwd[::-1]]),
        np.concatenate([zero, plan.fwd_repeat[::-1]]),
    )


def _label(kind: str, i: int, r: int, repeats: int) -> str:
    if i < 0:
        return ""
    if repeats == 1:
        return f"{kind}{i}"
    return f"{kind}{i}{chr(ord('a') + r)}" if repeats <= 26 else f"{kind}{i}.{r}"


def _summary(plan: Plan) -> str:
    k, m, v, t = plan.num_stages, plan.num_microbatches, plan.repeats, plan.num_ticks
    return (
        f"schedule={plan.schedule} K={k} M={m} V={v} ticks={t} "
        f"bubble={plan.bubble_fraction():.4f} (f=1, b=2)"
    )


def _legend(plan: Plan) -> str:
    text = "legend: F3 = forward of micro-batch 3, B3 = its backward, . = idle (bubble)"
    if 1 < plan.repeats <= 26:
        text += "; the letter is the repeat (a = virtual stage 0 of the device, b = 1, ...)"
    elif plan.repeats > 26:
        text += "; the number after the dot is the repeat (virtual stage of the device)"
    if (plan.bwd >= 0).any():
        return text + "; F5B1 = forward of 5 and backward of 1 in the same tick"
    t = plan.num_ticks
    return text + f"; ticks 0-{t - 1} forward, {t}-{2 * t - 1} backward (the forward replayed)"


def render(
    schedule_or_plan: Plan | Schedule | str,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    *,
    path: str | None = None,
    width: int | None = None,
) -> str:
    """A picture of a schedule: an ASCII grid, and optionally a PNG drawn with matplotlib.

    One row per stage, one column per tick. A cell shows ``F3`` (forward of micro-batch 3),
    ``B3`` (its backward), ``F5B1`` (both in one 1F1B tick) and, for Circular, the repeat as a
    letter (``F3b``: repeat 1); ``.`` is idle. GPipe and Circular show the forward ticks
    followed by the backward (the forward ticks mirrored). A legend and a summary line follow.

    Args:
      schedule_or_plan: a :class:`Plan`, or a schedule (object or name) with the sizes.
      num_stages: K, when a schedule is given.
      num_microbatches: M, when a schedule is given.
      path: if given, also save a PNG there (needs ``pip install "replicator[plot]"``).
      width: wrap the grid into blocks of columns at most this many characters wide (each
        block repeats the stage labels and tick header). ``None``: one block, no wrapping.

    Returns:
      The ASCII picture.

    >>> print(render("gpipe", 2, 2))
    tick     0  1  2  3  4  5
    stage 0  F0 F1 .  .  B1 B0
    stage 1  .  F0 F1 B1 B0 .
    legend: F3 = forward of micro-batch 3, B3 = its backward, . = idle (bubble); ticks 0-2 forward, 3-5 backward (the forward replayed)
    schedule=gpipe K=2 M=2 V=1 ticks=3 bubble=0.3333 (f=1, b=2)
    """
    if isinstance(schedule_or_plan, Plan):
        plan = schedule_or_plan
        for name, want in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
            if want is not None and want != getattr(plan, name):
                raise ValueError(
                    f"render: {name}={want} does not match the plan's "
                    f"{getattr(plan, name)}; omit it when passing a Plan."
                )
    else:
        if num_stages is None or num_microbatches is None:
            raise ValueError(
                "render: pass num_stages and num_microbatches with a schedule, "
                "e.g. render('1f1b', 4, 8), or pass a Plan."
            )
        plan = get(schedule_or_plan).plan(num_stages, num_microbatches)
    cf, cfr, cb, cbr = _columns(plan)
    v = plan.repeats
    cells = [
        [
            _label("F", cf[c, s], cfr[c, s], v) + _label("B", cb[c, s], cbr[c, s], v) or "."
            for c in range(cf.shape[0])
        ]
        for s in range(plan.num_stages)
    ]
    cw = max(len(str(cf.shape[0] - 1)), *(len(x) for row in cells for x in row))
    lw = len(f"stage {plan.num_stages - 1}")
    per = cf.shape[0] if width is None else max(1, (width - lw - 1) // (cw + 1))
    blocks = []
    for lo in range(0, cf.shape[0], per):
        cols = range(lo, min(lo + per, cf.shape[0]))
        lines = ["tick".ljust(lw) + "  " + " ".join(str(c).ljust(cw) for c in cols)]
        for s, row in enumerate(cells):
            lines.append(f"stage {s}".ljust(lw) + "  " + " ".join(row[c].ljust(cw) for c in cols))
        blocks.append("\n".join(line.rstrip() for line in lines))
    text = "\n\n".join(blocks) + "\n" + _legend(plan) + "\n" + _summary(plan)
    if path is not None:
        _draw_png(plan, (cf, cfr, cb, cbr), path)
    return text


def _draw_png(plan: Plan, columns: tuple[np.ndarray, ...], path: str) -> None:
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise ImportError(
            'render(path=...) draws with matplotlib: pip install "replicator[plot]"'
        ) from e
    cf, cfr, cb, cbr = columns
    ncol, k, m, v = cf.shape[0], plan.num_stages, plan.num_microbatches, plan.repeats
    fig = Figure(figsize=(min(2 + 0.45 * ncol, 60), 1.2 + 0.55 * k))
    ax = fig.add_subplot()
    maps = matplotlib.colormaps["Blues"], matplotlib.colormaps["Oranges"]
    for c in range(ncol):
        for s in range(k):
            parts = [
                (p, i, r)
                for p, i, r in ((0, cf[c, s], cfr[c, s]), (1, cb[c, s], cbr[c, s]))
                if i >= 0
            ]
            if not parts:
                ax.add_patch(Rectangle((c, s), 0.95, 0.95, color="#eeeeee"))
            h = 0.95 / max(len(parts), 1)
            for n, (p, i, r) in enumerate(parts):
                shade = 0.3 + 0.5 * (r * m + i) / max(v * m - 1, 1)
                ax.add_patch(Rectangle((c, s + n * h), 0.95, h, color=maps[p](shade)))
                ax.text(
                    c + 0.475,
                    s + (n + 0.5) * h,
                    _label("FB"[p], i, r, v)[1:],
                    ha="center",
                    va="center",
                    fontsize=7 if len(parts) == 1 else 6,
                    color="white" if shade > 0.6 else "black",
                )
    if not (plan.bwd >= 0).any():
        ax.axvline(plan.num_ticks - 0.025, color="black", linewidth=1)
    ax.set_xlim(0, ncol)
    ax.set_ylim(k, 0)
    ax.set_yticks(np.arange(k) + 0.475, [f"stage {s}" for s in range(k)])
    ax.set_xticks(np.arange(ncol) + 0.475, [str(c) for c in range(ncol)], fontsize=6)
    ax.set_xlabel("tick (blue: forward, orange: backward, grey: idle)")
    ax.set_title(_summary(plan), fontsize=9)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
