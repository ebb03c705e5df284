"""Pipeline schedules as pure objects: NumPy tick tables, their dependencies and ring buffers.

K devices ("stages") run M micro-batches. A schedule is a small frozen dataclass whose
``timetable(num_stages, num_microbatches)`` returns a :class:`Timetable`: tables ``[T, K]`` telling which
micro-batch each stage runs at each tick. The scanned engine reads them; nothing here needs JAX.
Their modelled step time is in `timing`, their pictures in `pictures`.

Whatever the schedule, the sequential meaning is the same: every micro-batch runs through the
logical stages ``0, 1, ..., S-1`` in order (``S = K * repeats``) and the gradients are summed over
the micro-batches. A schedule only decides *when* and *where* each piece runs.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar, TypeAlias

import numpy as np

from replicator._src.core.errors import positive_int
from replicator._src.pipeline import timing
from replicator._src.pipeline.checks import check_dependencies as check_dependencies
from replicator._src.pipeline.checks import ring_slots as ring_slots
from replicator._src.pipeline.tables import aligned_tables as _aligned_tables
from replicator._src.pipeline.tables import diagonal as _diagonal
from replicator._src.pipeline.tables import interleaved_tables as _interleaved_tables
from replicator._src.pipeline.tables import zero_bubble_tables as _zero_bubble_tables


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
class Timetable:
    """The tick tables of a schedule for K stages and M micro-batches (read-only arrays).

    Attributes:
      schedule: ``"gpipe"``, ``"circular"``, ``"1f1b"``, ``"interleaved"`` or ``"zerobubble"``.
      num_stages: K.
      num_microbatches: M.
      repeats: V, the virtual stages per device (1 except for Circular and Interleaved1F1B).
      fwd: int32 ``[T, K]``: the micro-batch whose forward stage ``s`` runs at tick ``t``, or -1.
      fwd_repeat: int32 ``[T, K]``: the virtual stage ``r`` of that forward; 0 where idle.
      bwd: int32 ``[T, K]``: the micro-batch whose backward stage ``s`` runs at tick ``t``, or
        -1. All -1 for GPipe and Circular: their backward is autodiff of the forward scan, the
        forward ticks replayed in reverse.
      stash_slots: the ring buffer of stashed stage inputs, indexed by ``i % stash_slots``
        (1F1B: ``2K - 1``; ZeroBubble: its own bound); 0 for GPipe and Circular.
      wgt: int32 ``[T, K]``: the micro-batch whose weight-gradient pass (W) stage ``s`` runs at
        tick ``t``, or -1. Only ZeroBubble splits the backward into B (input gradients, in
        ``bwd``) and W; elsewhere all -1 (B and W run together in ``bwd``). ``None`` when
        built: all -1.
      grad_slots: the ring buffer of output cotangents kept from their arrival until the W
        pass (ZeroBubble) or the backward (Interleaved1F1B), indexed by ``i % grad_slots``; 0
        for the others.
      bwd_repeat: int32 ``[T, K]``: the virtual stage ``r`` of the backward in ``bwd``; 0 where
        idle. ``None`` when built: all 0.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    repeats: int
    fwd: np.ndarray
    fwd_repeat: np.ndarray
    bwd: np.ndarray
    stash_slots: int = 0
    wgt: np.ndarray | None = None
    grad_slots: int = 0
    bwd_repeat: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.wgt is None:
            object.__setattr__(self, "wgt", np.full_like(np.asarray(self.fwd), -1))
        if self.bwd_repeat is None:
            object.__setattr__(self, "bwd_repeat", np.zeros_like(np.asarray(self.fwd)))
        for name in ("fwd", "fwd_repeat", "bwd", "wgt", "bwd_repeat"):
            table = np.array(getattr(self, name), dtype=np.int32)
            if table.ndim != 2 or table.shape[1] != self.num_stages:
                raise ValueError(
                    f"Timetable: {name} must have shape [T, {self.num_stages}]; got {table.shape}."
                )
            table.setflags(write=False)
            object.__setattr__(self, name, table)
        if not (
            self.fwd.shape == self.fwd_repeat.shape == self.bwd.shape == self.wgt.shape
            == self.bwd_repeat.shape
        ):  # fmt: skip
            raise ValueError(
                "Timetable: fwd, fwd_repeat, bwd, bwd_repeat and wgt must have the same shape [T, K]."
            )
        if self.repeats > 1 and (self.wgt >= 0).any():
            raise ValueError(
                "Timetable: weight-gradient passes (wgt) with virtual stages (repeats > 1) are not "
                "supported; split the backward with repeats=1 (ZeroBubble) only."
            )

    @property
    def num_ticks(self) -> int:
        """T, the number of ticks of the scan."""
        return int(self.fwd.shape[0])

    def busy(self) -> np.ndarray:
        """Bool ``[T, K]``: whether stage ``s`` runs a forward, a backward or a W at tick ``t``."""
        return (self.fwd >= 0) | (self.bwd >= 0) | (self.wgt >= 0)

    def bubble_fraction(self, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> float:
        """The idle share of a lock-step step; each tick lasts as long as its busiest stage.

        The modelled bubble of `timing.step_time` with equal costs on every stage: forward
        ``f``, backward ``b`` (ZeroBubble: B and W ``b/2`` each). Without backward ticks (GPipe,
        Circular) the backward replays the forward ticks, so the step lasts ``T * (f + b)``
        while each device works ``V * M * (f + b)``: the bubble is ``1 - V*M/T``. With them
        (1F1B) a tick lasts ``max_s(f*[fwd] + b*[bwd])`` and each device works ``M * (f + b)``.

        Args:
          fwd_cost: the time of one stage forward on one micro-batch.
          bwd_cost: the time of one stage backward (about twice the forward).
        """
        f, b = float(fwd_cost), float(bwd_cost)
        if not (f >= 0 and b >= 0 and f + b > 0):
            raise ValueError(
                f"Timetable.bubble_fraction: costs must be >= 0 and not both 0; got "
                f"fwd_cost={fwd_cost}, bwd_cost={bwd_cost}."
            )
        costs = timing.StageCosts.equal(
            self.num_stages * self.repeats, forward=f, backward_input=b / 2,
            backward_weight=b / 2, backward=b,
        )  # fmt: skip
        return timing.step_time(self, costs).bubble_fraction


class _RenamedPlan:
    """``plan``, the old name of ``timetable``: kept for one release."""

    def plan(self, num_stages: int, num_microbatches: int) -> Timetable:
        """Deprecated: use ``timetable``."""
        warnings.warn(
            f"{type(self).__name__}.plan is deprecated and will be removed in the next release; "
            f"use {type(self).__name__}.timetable.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.timetable(num_stages, num_microbatches)


@dataclasses.dataclass(frozen=True)
class GPipe(_RenamedPlan):
    """All forwards, then all backwards (by autodiff of the forward scan).

    Stage ``s`` runs the forward of micro-batch ``i`` at tick ``t = i + s``, so ``T = M + K - 1``
    and ``fwd[t, s] = t - s`` when ``0 <= t - s < M``. The backward is the forward ticks in
    reverse. Sequential meaning: each micro-batch through stages ``0..K-1`` in order. Any
    ``M >= 1`` works; the bubble is ``(K-1)/(M+K-1)``.

    Example:
      >>> plan = GPipe().timetable(num_stages=2, num_microbatches=3)
      >>> plan.fwd.T.tolist()
      [[0, 1, 2, -1], [-1, 0, 1, 2]]
      >>> plan.num_ticks, plan.bubble_fraction()
      (4, 0.25)
    """

    name: ClassVar[str] = "gpipe"
    repeats: ClassVar[int] = 1

    def timetable(self, num_stages: int, num_microbatches: int) -> Timetable:
        """The tick tables for ``num_stages`` devices and ``num_microbatches`` micro-batches."""
        k, m = _check_sizes("GPipe.timetable", num_stages, num_microbatches)
        fwd = _diagonal(k, m, m + k - 1)
        return Timetable(self.name, k, m, 1, fwd, np.zeros_like(fwd), np.full_like(fwd, -1))


@dataclasses.dataclass(frozen=True)
class Circular(_RenamedPlan):
    """Interleaved (looped) GPipe: V virtual stages per device around a ring.

    The model has ``S = V*K`` logical stages; logical stage ``j = r*K + s`` lives on device ``s``
    as its virtual stage ``r``. Micro-batches go in groups of K: micro-batch ``i`` (group
    ``g = i // K``, position ``q = i % K``) runs its forward on device ``s``, repeat ``r`` at tick
    ``t = s + g*K*V + r*K + q``. Device K-1 at repeat ``r`` hands it to device 0 at repeat
    ``r + 1`` one tick later, so one ring shift ``s -> (s+1) % K`` per tick carries every
    activation. ``T`` is the last tick used plus one: ``V*M + K - 1`` when K divides M, and the
    bubble ``(K-1)/(V*M+K-1)``. The backward is autodiff of the forward scan. Sequential meaning:
    each micro-batch through logical stages ``0..V*K-1`` in order. Needs ``M >= K``.

    Args:
      repeats: V, the virtual stages per device.

    Example:
      >>> plan = Circular(repeats=2).timetable(num_stages=2, num_microbatches=2)
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

    def timetable(self, num_stages: int, num_microbatches: int) -> Timetable:
        """The tick tables for ``num_stages`` devices and ``num_microbatches`` micro-batches."""
        k, m = _check_sizes("Circular.timetable", num_stages, num_microbatches)
        why = "with fewer micro-batches than stages every repeat has idle ring slots and the "
        _check_enough("Circular.timetable", k, m, why + "bubble is worse than GPipe's")
        v = int(self.repeats)
        i, r, s = np.meshgrid(np.arange(m), np.arange(v), np.arange(k), indexing="ij")
        t = s + (i // k) * k * v + r * k + i % k
        fwd = np.full((int(t.max()) + 1, k), -1, np.int32)
        rep = np.zeros_like(fwd)
        fwd[t, s], rep[t, s] = i, r
        return Timetable(self.name, k, m, v, fwd, rep, np.full_like(fwd, -1))


@dataclasses.dataclass(frozen=True)
class OneFOneB(_RenamedPlan):
    """Synchronous one-forward-one-backward, in one scan with explicit backward ticks.

    Stage ``s`` runs the forward of micro-batch ``i`` at tick ``i + s`` and its backward at tick
    ``i + 2(K-1) - s``; within a tick the forward comes first, so the last stage starts each
    backward at once. ``T = M + 2K - 2``; ``bwd[t, s] = t - 2(K-1) + s`` when in ``[0, M)``.
    Stage ``s`` holds at most ``2(K-1-s) + 1`` stashed inputs, so a ring buffer of
    ``stash_slots = 2K - 1`` indexed by ``i % (2K-1)`` suffices for any M. Sequential meaning:
    each micro-batch through stages ``0..K-1``, then its gradient back through ``K-1..0``.
    Needs ``M >= K``.

    Example:
      >>> plan = OneFOneB().timetable(num_stages=2, num_microbatches=2)
      >>> plan.fwd.T.tolist(), plan.bwd.T.tolist(), plan.stash_slots
      ([[0, 1, -1, -1], [-1, 0, 1, -1]], [[-1, -1, 0, 1], [-1, 0, 1, -1]], 3)
    """

    name: ClassVar[str] = "1f1b"
    repeats: ClassVar[int] = 1

    def timetable(self, num_stages: int, num_microbatches: int) -> Timetable:
        """The tick tables for ``num_stages`` devices and ``num_microbatches`` micro-batches."""
        k, m = _check_sizes("OneFOneB.timetable", num_stages, num_microbatches)
        why = "1F1B needs at least K micro-batches in flight to reach its steady state"
        _check_enough("OneFOneB.timetable", k, m, why)
        num_ticks = m + 2 * k - 2
        fwd = _diagonal(k, m, num_ticks)
        t = np.arange(num_ticks)[:, None] - 2 * (k - 1) + np.arange(k)[None, :]
        bwd = np.where((t >= 0) & (t < m), t, -1)
        return Timetable(self.name, k, m, 1, fwd, np.zeros_like(fwd), bwd, stash_slots=2 * k - 1)


@dataclasses.dataclass(frozen=True)
class ZeroBubble(_RenamedPlan):
    """Zero bubble (Qi et al., ICLR 2024): 1F1B with its backward split into B and W.

    The backward of a stage splits into B, the input gradient that the previous stage waits for,
    and W, the weight gradient that nobody waits for, so the W passes can fill 1F1B's bubbles.
    In a lock-step scan a tick lasts as long as its busiest stage, so where the passes go
    depends on what they cost; `plan` builds two tables and keeps the one whose modelled step
    (`timing.step_time`) is shorter with ``pass_costs``:

    - **one pass per tick** (ZB-H1): stage ``s`` keeps 1F1B's order of F and B (``K - s``
      forwards, then ``B, F, B, F, ...``), one pass per tick, and runs a W whenever its next F
      or B is not ready yet, or when more than ``s`` W passes are pending. With equal costs
      ``F = B = W`` it takes ``3M + K - 1`` ticks, a bubble of ``(K-1)/(3M+K-1)``; each stage
      holds at most K stage inputs and K output cotangents. When the passes cost different
      amounts, the stages run different passes in one tick and each tick lasts the longest.
    - **aligned**: 1F1B's F and B ticks (F of micro-batch ``i`` on stage ``s`` at tick ``i + s``,
      B at ``i + 2(K-1) - s``), and each W at the first tick where its stage's passes and the W
      fit in the tick's length anyway, or when more than 2K W passes are pending; leftover W
      passes in ticks of their own at the end. In the steady state every stage runs F, B and W
      in the same tick, so unequal costs waste nothing there; the rings hold up to about 3K
      micro-batches.

    The default ``pass_costs`` are the relative FLOPs of the library's GPT block's passes;
    with them the aligned table wins from ``M = 2K`` on (BENCHMARKS.md, "Pipeline schedules on
    the GPT", has both tables' modelled steps). Sequential meaning: each micro-batch through
    stages ``0..K-1``, then its gradient back through ``K-1..0``, each stage's weight gradient
    from the same cotangent. Needs ``M >= K``.

    Args:
      pass_costs: the relative costs ``(F, B, W)`` of a stage's forward, input-gradient and
        weight-gradient passes that choose the table (measure yours with
        `costs.stage_costs`); the numbers never change the result, only when passes run.

    Example:
      >>> plan = ZeroBubble(pass_costs=(1, 1, 1)).timetable(num_stages=2, num_microbatches=2)
      >>> plan.fwd.T.tolist()
      [[0, 1, -1, -1, -1, -1, -1], [-1, 0, -1, 1, -1, -1, -1]]
      >>> plan.bwd.T.tolist()
      [[-1, -1, -1, 0, -1, 1, -1], [-1, -1, 0, -1, 1, -1, -1]]
      >>> plan.wgt.T.tolist()
      [[-1, -1, -1, -1, 0, -1, 1], [-1, -1, -1, -1, -1, 0, 1]]
      >>> plan.num_ticks, plan.stash_slots, plan.grad_slots, round(plan.bubble_fraction(), 4)
      (7, 2, 2, 0.1429)
    """

    pass_costs: tuple[float, float, float] = (1.0, 1.08, 0.91)
    name: ClassVar[str] = "zerobubble"
    repeats: ClassVar[int] = 1

    def __post_init__(self) -> None:
        costs = self.pass_costs
        ok = isinstance(costs, tuple | list) and len(costs) == 3
        try:
            ok = ok and all(float(c) > 0 and np.isfinite(float(c)) for c in costs)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"ZeroBubble: pass_costs must be three numbers > 0, the relative costs (F, B, W) "
                f"of a stage's forward, input-gradient and weight-gradient passes; got "
                f"{costs!r}. Use e.g. ZeroBubble(pass_costs=(1.0, 1.1, 0.9))."
            )
        object.__setattr__(self, "pass_costs", tuple(float(c) for c in costs))

    def timetable(self, num_stages: int, num_microbatches: int) -> Timetable:
        """The tick tables for ``num_stages`` devices and ``num_microbatches`` micro-batches."""
        k, m = _check_sizes("ZeroBubble.timetable", num_stages, num_microbatches)
        why = "ZeroBubble keeps 1F1B's order, which needs K micro-batches in flight"
        _check_enough("ZeroBubble.timetable", k, m, why)
        f, b, w = self.pass_costs
        costs = timing.StageCosts.equal(k, forward=f, backward_input=b, backward_weight=w)
        best = None
        for tables in (_zero_bubble_tables(k, m), _aligned_tables(k, m, f, b, w)):
            fwd, bwd, wgt = tables
            stash, grad = ring_slots(fwd, bwd, wgt)
            plan = Timetable(
                self.name, k, m, 1, fwd, np.zeros_like(fwd), bwd,
                stash_slots=stash, wgt=wgt, grad_slots=grad,
            )  # fmt: skip
            time = timing.step_time(plan, costs).time
            if best is None or time < best[0] - 1e-9 * time:  # a tie keeps the one-pass table
                best = (time, plan)
        return best[1]


@dataclasses.dataclass(frozen=True)
class Interleaved1F1B(_RenamedPlan):
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): V virtual stages per device, 1F1B's order.

    The model has ``S = V*K`` logical stages laid out as in `Circular`: logical stage
    ``j = r*K + s`` is device ``s``'s virtual stage ``r``, and activations go around the ring
    (cotangents around it backwards). Each device runs Megatron-LM's order of passes: forwards
    go in groups of K micro-batches per virtual stage (micro-batches ``0..K-1`` through its
    stage 0, then through its stage 1, ...), backwards likewise with the virtual stages
    reversed; device ``s`` first runs ``2(K-1-s) + (V-1)K + 1`` forwards, then alternates one
    backward and one forward. Each pass runs at the first tick its inputs are there, a forward
    and a backward per tick at most (the forward first). With equal costs the bubble is
    Megatron-LM's ``(K-1)/(V*M + K-1)``, against 1F1B's ``(K-1)/(M+K-1)``; a device holds the
    residuals of at most ``stash_slots`` micro-batches per virtual stage, whatever M. Sequential
    meaning: each micro-batch through logical stages ``0..V*K-1``, then its gradient back.
    Needs ``M`` to be a multiple of K.

    Args:
      repeats: V, the virtual stages per device.

    Example:
      >>> plan = Interleaved1F1B(repeats=2).timetable(num_stages=2, num_microbatches=2)
      >>> plan.fwd.T.tolist()
      [[0, 1, 0, 1, -1, -1, -1, -1], [-1, 0, 1, 0, 1, -1, -1, -1]]
      >>> plan.bwd.T.tolist(), plan.bwd_repeat.T.tolist()
      ([[-1, -1, -1, -1, 0, 1, 0, 1], [-1, -1, -1, 0, 1, 0, 1, -1]], [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]])
      >>> plan.num_ticks, round(plan.bubble_fraction(), 4), round(1 / (2 * 2 + 1), 4)
      (8, 0.2, 0.2)
    """

    repeats: int = 2
    name: ClassVar[str] = "interleaved"

    def __post_init__(self) -> None:
        v = self.repeats
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 2:
            raise ValueError(
                f"Interleaved1F1B: repeats must be an int >= 2 (virtual stages per device); got "
                f"{v!r}. Use Interleaved1F1B(repeats=2) or more, or OneFOneB() for one stage "
                f"per device."
            )

    def timetable(self, num_stages: int, num_microbatches: int) -> Timetable:
        """The tick tables for ``num_stages`` devices and ``num_microbatches`` micro-batches."""
        k, m = _check_sizes("Interleaved1F1B.timetable", num_stages, num_microbatches)
        why = "1F1B's order needs K micro-batches in flight"
        _check_enough("Interleaved1F1B.timetable", k, m, why)
        if m % k:
            raise ValueError(
                f"Interleaved1F1B.timetable: num_microbatches must be a multiple of num_stages (the "
                f"micro-batches go through each virtual stage in groups of K); got "
                f"num_microbatches={m} with num_stages={k}. Use num_microbatches="
                f"{(m // k + 1) * k}, or OneFOneB()."
            )
        v = int(self.repeats)
        fwd, frep, bwd, brep = _interleaved_tables(k, m, v)
        stash, grad = ring_slots(fwd, bwd, np.full_like(fwd, -1), frep, brep, v)
        return Timetable(
            self.name, k, m, v, fwd, frep, bwd, stash_slots=stash, grad_slots=grad,
            bwd_repeat=brep,
        )  # fmt: skip


Schedule: TypeAlias = GPipe | Circular | OneFOneB | Interleaved1F1B | ZeroBubble
_BY_NAME = {
    "gpipe": GPipe, "circular": Circular, "1f1b": OneFOneB, "interleaved": Interleaved1F1B,
    "interleaved1f1b": Interleaved1F1B, "zerobubble": ZeroBubble, "zb": ZeroBubble,
}  # fmt: skip


def get(schedule: Schedule | str) -> Schedule:
    """A schedule object from an instance or a name.

    The names are ``"gpipe"``, ``"circular"``, ``"1f1b"``, ``"interleaved"`` (or
    ``"interleaved1f1b"``) and ``"zerobubble"`` (or ``"zb"``).

    >>> get("1f1b")
    OneFOneB()
    """
    if isinstance(schedule, GPipe | Circular | OneFOneB | Interleaved1F1B | ZeroBubble):
        return schedule
    if isinstance(schedule, str):
        cls = _BY_NAME.get(schedule.strip().lower())
        if cls is None:
            raise ValueError(
                f"schedules.get: unknown schedule {schedule!r}; valid names are "
                f"{', '.join(map(repr, _BY_NAME))} (or pass GPipe(), Circular(repeats=V), OneFOneB(), "
                f"Interleaved1F1B(repeats=V), ZeroBubble())."
            )
        return cls()
    raise TypeError(
        f"schedules.get: schedule must be a schedule object or one of the names "
        f"{', '.join(map(repr, _BY_NAME))}; got {type(schedule).__name__}."
    )
