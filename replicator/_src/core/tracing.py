"""What the library notes while a step is traced, for the report to read back.

Two kinds of note, both made by the code that builds a step (the pipeline engine) and read by
``report.py`` once the step is compiled; neither changes what the step computes:

* `runs`: a named scope around a conditional inside a loop, saying how many of the loop's
  trips take it; the HLO reader (``hlo.py``) finds the scope's name in the compiled program.
* `note_pipeline`: a `PipelineNote` for each pipeline traced inside `recording`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import jax

from replicator._src.core import scoped

RUNS_MARK = re.compile(r"replicator_runs_(\d+)_of_(\d+)")


@contextlib.contextmanager
def runs(num: int, den: int) -> Iterator[None]:
    """Marks the conditionals traced inside as running ``num`` times in every ``den`` loop trips.

    Use it around a ``lax.cond`` inside a ``lax.scan`` whose predicate is true on a known share
    of the iterations; the HLO reader then counts that conditional's work and collectives
    ``num / den`` as often as the loop runs (otherwise: as often as the loop runs).
    """
    with jax.named_scope(f"replicator_runs_{int(num)}_of_{int(den)}"):
        yield


@dataclasses.dataclass(frozen=True)
class PipelineNote:
    """A pipeline call traced in the step: its schedule and what moves between stages.

    Attributes:
      schedule: ``"gpipe"``, ``"circular"`` or ``"1f1b"``.
      num_stages: K.
      num_microbatches: M.
      repeats: V, virtual stages per device.
      ticks: T, ticks of the schedule's scan.
      bubble_fraction: the idle share of a lock-step step (backward = 2 x forward).
      activation_bytes: one micro-batch's activation on one device: what a stage sends to the
        next each tick (and, as cotangent, back).
      sends_per_step: stage shifts per step on each device: 2T with the backward pass (the
        activation forward, its cotangent back), T for a forward-only ``apply``.
      picture: the schedule as an ASCII grid (``rp.pipeline.render``).
      padding: for stages that differ (``rp.pipeline.sequential``), what packing them into
        buffers of one shape costs; empty otherwise.
      modelled_time: the modelled lock-step time of one step on K parallel devices
        (`timing.step_time`), with the stages' measured costs (in ``cost_unit``); with equal
        costs when they could not be measured (see ``cost_note``).
      modelled_bubble: the idle share of that modelled step.
      dataflow_time: the same passes without tick barriers, what an asynchronous runtime could
        reach at best (`timing.StepTime.dataflow_time`).
      cost_unit: ``"flops"`` (XLA's count of each stage's compiled passes) or ``"units"``
        (equal costs: F = B = W = 1, fused backward 2).
      stage_costs: each logical stage's measured F, B, W and fused-backward FLOPs on one
        micro-batch (`timing.StageCosts`), or None when not measured.
      equal_time: the modelled step time with equal costs, in units.
      equal_bubble: the modelled bubble with equal costs (``bubble_fraction`` for
        ``value_and_grad``).
      cost_note: why the stages' costs were not measured; empty when they were.
      held_grads: with ZeRO-3 and ``scatter_grads="step"``, the ``(dtype, shape)`` of each
        whole stage gradient a device holds over the step (summed over the micro-batches,
        reduce-scattered once); empty otherwise.
      held_weights: likewise, the stage's weights gathered once for the step (GPipe, Circular).
      held_bytes: ``(gradients, weights)`` bytes of those found in the compiled program's loop
        state (``Replicator.explain`` reads them); None before it is read.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    repeats: int
    ticks: int
    bubble_fraction: float
    activation_bytes: int
    sends_per_step: int
    picture: str
    padding: str = ""
    modelled_time: float = 0.0
    modelled_bubble: float = 0.0
    dataflow_time: float = 0.0
    cost_unit: str = "units"
    stage_costs: object | None = None  # a pipeline `timing.StageCosts` (core does not import it)
    equal_time: float = 0.0
    equal_bubble: float = 0.0
    cost_note: str = ""
    held_grads: tuple = ()
    held_weights: tuple = ()
    held_bytes: tuple[int, int] | None = None


_NOTES: scoped.Stack[list[PipelineNote]] = scoped.Stack()
_MEASURE: scoped.Stack[bool] = scoped.Stack()


@contextlib.contextmanager
def recording(*, measure_stages: bool = True) -> Iterator[list[PipelineNote]]:
    """Collects the `PipelineNote`s of the pipelines traced inside the block. With
    ``measure_stages=False`` the notes model the step with equal stage costs instead of
    compiling each stage's passes to count their FLOPs (faster; exact for identical stages)."""
    with _NOTES.push([]) as notes, _MEASURE.push(bool(measure_stages)):
        yield notes


def recording_pipelines() -> bool:
    """Whether a `recording` block is open on this thread (the engine then notes its plan)."""
    return bool(_NOTES)


def measuring_stages() -> bool:
    """Whether the open `recording` block wants each stage's FLOPs measured."""
    return bool(_MEASURE) and _MEASURE.top()


def note_pipeline(note: PipelineNote) -> None:
    """Called by the pipeline engine at trace time; a no-op unless a report is being made."""
    if _NOTES:
        _NOTES.top().append(note)


@dataclasses.dataclass(frozen=True)
class ZeroNote:
    """A ZeRO update traced in the step: how much of it runs on shards.

    Attributes:
      zero_stage: 1, 2 or 3.
      num_replicas: N.
      split_leaves: parameters with an axis split over the replicas (their state too).
      whole_leaves: parameters of more than one element with no axis that divides by N, kept
        whole on every replica: their gradients are all-reduced and their update computed on
        every replica.
      whole_bytes: those parameters' bytes (one device's block), what each replica holds of
        them (with ZeRO-3) instead of 1/N.
      gathered: each operation of the update that gathers its operands over the replicas to
        run on whole arrays.
    """

    zero_stage: int
    num_replicas: int
    split_leaves: int
    whole_leaves: int
    whole_bytes: int
    gathered: tuple[str, ...]


_ZERO_NOTES: scoped.Stack[list[ZeroNote]] = scoped.Stack()


@contextlib.contextmanager
def recording_zero() -> Iterator[list[ZeroNote]]:
    """Collects the `ZeroNote`s of the ZeRO updates traced inside the block."""
    with _ZERO_NOTES.push([]) as notes:
        yield notes


def note_zero(note: ZeroNote) -> None:
    """Called by ZeRO's update at trace time; a no-op unless a report is being made."""
    if _ZERO_NOTES:
        _ZERO_NOTES.top().append(note)
