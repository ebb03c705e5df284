"""The modelled step time of a pipeline schedule on parallel hardware.

Emulated CPU devices share cores, so wall time measures total work and cannot show a bubble. The
step time a schedule takes on K parallel devices is modelled instead, from its tick tables
(`schedules.Timetable`) and each stage's costs (`StageCosts`: FLOPs or seconds of one micro-batch's
forward, input-gradient and weight-gradient passes, as the engine runs them).

Two times are modelled. ``time`` is lock-step, what the SPMD scan does: every tick ends with a
``ppermute``, so a tick lasts as long as its busiest stage. ``dataflow_time`` keeps each stage's
order of passes but drops the tick barriers: each pass starts as soon as its stage is free and its
inputs are done, which is what an asynchronous (MPMD) runtime could reach at best.

This module reads a plan's tables only (``fwd``, ``fwd_repeat``, ``bwd``, ``bwd_repeat``,
``wgt``, ``num_stages``, ``repeats``); it does not import the schedules, which define
``Timetable.bubble_fraction`` through it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

UNITS = ("units", "flops", "seconds")
_FIELDS = ("forward", "backward_input", "backward_weight", "backward")


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """The cost of one micro-batch's passes through each logical stage, as the engine runs them.

    Each field has one entry per logical stage ``j`` (``S = V * K``; logical stage ``r*K + s`` is
    device ``s``'s virtual stage ``r``), in units of ``unit``.

    Attributes:
      forward: F, the forward pass.
      backward_input: B, the input-gradient pass (ZeroBubble's B, with its recompute).
      backward_weight: W, the weight-gradient pass (ZeroBubble's W, with its recompute).
      backward: the fused backward that GPipe, Circular and 1F1B run (input and weight gradients
        in one pass, with its recompute).
      unit: ``"flops"``, ``"seconds"`` or ``"units"`` (abstract equal costs).

    >>> StageCosts.equal(2).backward
    (2.0, 2.0)
    >>> StageCosts(forward=(1, 2), backward_input=(1, 2), backward_weight=(1, 2), backward=(2, 4))
    StageCosts(forward=(1.0, 2.0), backward_input=(1.0, 2.0), backward_weight=(1.0, 2.0), backward=(2.0, 4.0), unit='units')
    """

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    backward: tuple[float, ...]
    unit: str = "units"

    def __post_init__(self) -> None:
        for name in _FIELDS:
            object.__setattr__(self, name, _costs(name, getattr(self, name)))
        n = len(self.forward)
        for name in _FIELDS[1:]:
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"StageCosts: {name} has {len(getattr(self, name))} entries but forward has "
                    f"{n}; give every field one entry per logical stage (num_stages * repeats)."
                )
        if self.unit not in UNITS:
            raise ValueError(
                f"StageCosts: unit must be one of {', '.join(map(repr, UNITS))}; got {self.unit!r}."
            )

    @classmethod
    def equal(
        cls,
        num_stages: int,
        *,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        backward: float | None = None,
        unit: str = "units",
    ) -> StageCosts:
        """The same costs on every one of ``num_stages`` logical stages.

        Args:
          num_stages: how many logical stages (``K * V`` for ``Circular(repeats=V)``).
          forward: F.
          backward_input: B.
          backward_weight: W.
          backward: the fused backward; ``backward_input + backward_weight`` when ``None``.
          unit: see the class.

        Returns:
          The costs.
        """
        if isinstance(num_stages, bool) or not isinstance(num_stages, int | np.integer):
            raise ValueError(
                f"StageCosts.equal: num_stages must be an int >= 1; got {num_stages!r}."
            )
        if num_stages < 1:
            raise ValueError(
                f"StageCosts.equal: num_stages must be an int >= 1; got {num_stages!r}."
            )
        if backward is None:
            backward = float(backward_input) + float(backward_weight)
        n = int(num_stages)
        return cls(
            forward=(forward,) * n, backward_input=(backward_input,) * n,
            backward_weight=(backward_weight,) * n, backward=(backward,) * n, unit=unit,
        )  # fmt: skip

    @property
    def num_stages(self) -> int:
        """How many logical stages the costs describe."""
        return len(self.forward)


def _costs(name: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, str) or not hasattr(value, "__len__") or len(value) == 0:
        raise ValueError(
            f"StageCosts: {name} must be a non-empty sequence of numbers, one per logical stage; "
            f"got {value!r}. Use e.g. StageCosts.equal(num_stages) for equal costs."
        )
    out = []
    for j, x in enumerate(value):
        try:
            x = float(x)
        except (TypeError, ValueError):
            x = math.nan
        if not math.isfinite(x) or x < 0:
            raise ValueError(
                f"StageCosts: {name}[{j}] must be a finite number >= 0; got {value[j]!r}. "
                f"Give each stage's cost in the costs' unit (e.g. FLOPs or seconds)."
            )
        out.append(x)
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class StepTime:
    """The modelled time of one step of a plan on K parallel devices.

    Attributes:
      time: the lock-step step time: the sum of ``tick_times``.
      bubble_fraction: the idle share of the devices: ``1 - sum(work) / (K * time)``.
      work: float ``[K]``: the busy time of each device.
      tick_times: float ``[C]``: each tick's duration, its busiest stage's work. ``C = T`` for
        plans with backward ticks; for GPipe and Circular ``C = 2T``: the forward ticks, then
        the backward ticks (the forward ticks replayed in reverse).
      start: float ``[C]``: when each tick starts.
      phase_times: float ``[3, C, K]``: the time stage ``s`` spends in tick ``c`` on its F, B
        and W phase (0 where idle), in that order within the tick.
      dataflow_time: the critical path of the same per-stage order of passes without tick
        barriers (each pass starts when its stage is free and its inputs are done): what an
        asynchronous runtime could reach; never more than ``time``.
      unit: the costs' unit.
    """

    time: float
    bubble_fraction: float
    work: np.ndarray
    tick_times: np.ndarray
    start: np.ndarray
    phase_times: np.ndarray
    dataflow_time: float
    unit: str = "units"


def columns(plan: Any) -> tuple[np.ndarray, ...]:
    """The plan's ticks as run: ``(fwd, fwd_repeat, bwd, bwd_repeat, wgt)``, each ``[C, K]``.

    Plans with backward ticks run their tables as they are (``C = T``). GPipe and Circular run
    their forward ticks, then the same ticks in reverse as backward ticks (``C = 2T``).
    """
    zero = np.zeros_like(plan.fwd)
    if (plan.bwd >= 0).any():
        return plan.fwd, plan.fwd_repeat, plan.bwd, plan.bwd_repeat, plan.wgt
    idle = np.full_like(plan.fwd, -1)
    return (
        np.concatenate([plan.fwd, idle]),
        np.concatenate([plan.fwd_repeat, zero]),
        np.concatenate([idle, plan.fwd[::-1]]),
        np.concatenate([zero, plan.fwd_repeat[::-1]]),
        np.concatenate([idle, idle]),
    )


def _check_costs(plan: Any, costs: StageCosts | None) -> StageCosts:
    n = plan.num_stages * plan.repeats
    if costs is None:
        return StageCosts.equal(n)
    if not isinstance(costs, StageCosts):
        raise TypeError(
            f"step_time: costs must be a StageCosts or None; got {type(costs).__name__}. Use "
            f"e.g. StageCosts.equal({n})."
        )
    if costs.num_stages != n:
        raise ValueError(
            f"step_time: costs describe {costs.num_stages} logical stages but the plan has "
            f"{n} (num_stages={plan.num_stages} x repeats={plan.repeats}); give one cost per "
            f"logical stage, e.g. StageCosts.equal({n})."
        )
    return costs


def _phase_times(plan: Any, costs: StageCosts) -> np.ndarray:
    cf, cfr, cb, cbr, cw = columns(plan)
    k = plan.num_stages
    logical = np.arange(k)[None, :]
    split = (plan.wgt >= 0).any()
    b_cost = costs.backward_input if split else costs.backward
    out = np.zeros((3, *cf.shape))
    for p, (table, rep, cost) in enumerate(
        [
            (cf, cfr, costs.forward),
            (cb, cbr, b_cost),
            (cw, np.zeros_like(cw), costs.backward_weight),
        ]
    ):
        out[p] = np.where(table >= 0, np.asarray(cost)[rep * k + logical], 0.0)
    return out


def _dataflow_time(plan: Any, phase_times: np.ndarray) -> float:
    """The critical path of the per-stage pass order, without tick barriers."""
    cf, cfr, cb, cbr, cw = columns(plan)
    k, last = plan.num_stages, plan.num_stages * plan.repeats - 1
    done: dict[tuple[str, int, int], float] = {}
    free = np.zeros(k)
    # Columns, then phases F, B, W within a column, are a topological order of the passes: every
    # input of a pass ran in an earlier column, or earlier in the same column on the same stage.
    for c in range(cf.shape[0]):
        for p, (table, rep) in enumerate([(cf, cfr), (cb, cbr), (cw, np.zeros_like(cw))]):
            for s in np.nonzero(table[c] >= 0)[0]:
                i, j = int(table[c, s]), int(rep[c, s]) * k + int(s)
                if p == 0:
                    deps = [("F", i, j - 1)] if j > 0 else []
                elif p == 1:
                    deps = [("F", i, j)] + ([("B", i, j + 1)] if j < last else [])
                else:
                    deps = [("B", i, j)]
                ready = max([free[s], *(done[d] for d in deps)])
                free[s] = done["FBW"[p], i, j] = ready + phase_times[p, c, s]
    return float(free.max())


def step_time(plan: Any, costs: StageCosts | None = None) -> StepTime:
    """The modelled time of one step of ``plan`` on K parallel devices in lock-step.

    Plans with backward ticks (1F1B, Interleaved1F1B, ZeroBubble): a tick costs ``max_s`` of
    the sum of its active phases: F is the forward of logical stage
    ``fwd_repeat[t, s] * K + s``; B is ``backward`` (the fused backward) when ``wgt`` is all
    -1, else ``backward_input``; W is ``backward_weight``. GPipe and Circular run their
    forward ticks, then replay them in reverse as backward ticks, each costing ``max_s`` of the
    ``backward`` of its active stages.

    Equivalent to::

        tick_times = [max(sum(cost of each phase stage s runs in tick c) for s in range(K))
                      for c in range(C)]
        time = sum(tick_times)

    Args:
      plan: a `schedules.Timetable`.
      costs: the costs of each logical stage; equal costs (F = B = W = 1, fused backward = 2)
        when ``None``.

    Returns:
      The `StepTime`.

    Raises:
      ValueError: when ``costs`` describe another number of logical stages, or the step takes
        no time (all costs of the passes that run are 0).

    >>> from replicator._src.pipeline.schedules import GPipe
    >>> t = step_time(GPipe().timetable(num_stages=2, num_microbatches=3))
    >>> t.time, t.bubble_fraction, t.tick_times.tolist()
    (12.0, 0.25, [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    """
    costs = _check_costs(plan, costs)
    phases = _phase_times(plan, costs)
    tick_times = phases.sum(axis=0).max(axis=1)
    time = float(tick_times.sum())
    if time <= 0:
        raise ValueError(
            "step_time: the step takes no time: every pass that runs costs 0; give the stages "
            "positive costs."
        )
    work = phases.sum(axis=(0, 1))
    return StepTime(
        time=time,
        bubble_fraction=float((plan.num_stages * time - work.sum()) / (plan.num_stages * time)),
        work=work,
        tick_times=tick_times,
        start=np.cumsum(tick_times) - tick_times,
        phase_times=phases,
        dataflow_time=_dataflow_time(plan, phases),
        unit=costs.unit,
    )
