"""`rp.fit`'s options, in three small records: `CheckpointOptions` (where and when the run is
saved), `LoggingOptions` (what it shows and writes) and `EvalOptions` (how it is evaluated).

Each record is frozen, has a default for every field but the one it is about, and checks its
fields when it is built, so that a wrong value is refused where it is written, before any step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from replicator._src.core import errors
from replicator._src.core.typing import PyTree
from replicator._src.training.profiling import Profile
from replicator._src.training.writers import MetricWriter, check_writers


def _check_flags(api: str, **flags: Any) -> None:
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{api}: {name} must be True or False; got {flag!r}.")


def _check_path(api: str, name: str, value: Any, *, none: bool = True) -> None:
    if value is None and none:
        return
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        also = " or None" if none else ""
        raise TypeError(
            f"{api}: {name} must be a path (a str or os.PathLike){also}; got {value!r}."
        )


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Where and when `rp.fit` saves checkpoints, and what it does when asked to stop.

    A run with checkpoints resumes from the newest one in ``directory`` (the input position
    included), so that a killed run loses at most ``every`` steps. Orbax writes each step aside
    and renames it when complete: a step is on disk whole or not at all.

    Args:
      directory: where the checkpoints go (a directory, created if needed).
      every: save every this many steps; None: at the end only (and on SIGTERM/SIGINT as
        ``emergency_after`` says).
      keep: the newest checkpoints to keep.
      async_save: write checkpoints in a background thread (orbax's asynchronous saving):
        each save returns once the state is copied off the devices and training goes on
        while the files are written; the next save, and fit's return (or its error), wait for
        the write in progress.
      emergency_after: on SIGTERM or SIGINT (a preemption; `rp.fit` stops every process after
        the same step), save a checkpoint of the step reached only if the newest checkpoint is
        at least this many steps older (none yet counts from step 0); None: never save on a
        stop signal (a rerun resumes from the newest checkpoint). The default, 1, saves unless
        the stop comes right after a save. It applies to those signals only: after a *peer's*
        failure in a multi-process job (a process that crashed or was killed) no emergency
        save is made, because orbax's multi-process save waits for every process at its
        barriers and, when the state is split over processes (ZeRO, ``model``, ``stage``
        axes), the dead peer's shards are gone; the job restarts from the newest checkpoint.
      start_over_if_unreadable: if ``directory`` holds checkpoints and none of them is
        readable, move them all aside (renamed ``<step>.broken-<time>``, never deleted) and
        train from step 0, with a warning per step. By default that is a FileNotFoundError
        and nothing is moved: when no step restores, the state they restore into may be what
        is wrong, so set it only once the checkpoints are known to be broken.

    Raises:
      ValueError: if ``every``, ``keep`` or ``emergency_after`` is not an int >= 1 (or None
        where allowed).
      TypeError: if ``directory`` is not a path, or a flag is not a bool.

    Example::

        rp.fit(repl, step_fn, state, input_fn, steps=1000,
               checkpointing=rp.training.CheckpointOptions("/tmp/run", every=100))

    >>> CheckpointOptions("/tmp/run", every=100).keep
    3
    """

    directory: str | os.PathLike
    every: int | None = None
    keep: int = 3
    async_save: bool = False
    emergency_after: int | None = 1
    start_over_if_unreadable: bool = False

    def __post_init__(self) -> None:
        api = "rp.training.CheckpointOptions"
        _check_path(api, "directory", self.directory, none=False)
        errors.positive_int(self.every, api=api, name="every", none=" or None")
        errors.positive_int(self.keep, api=api, name="keep")
        errors.positive_int(self.emergency_after, api=api, name="emergency_after", none=" or None")
        _check_flags(
            api, async_save=self.async_save, start_over_if_unreadable=self.start_over_if_unreadable
        )


@dataclasses.dataclass(frozen=True)
class LoggingOptions:
    """What `rp.fit` shows and writes besides the state: metrics, a progress bar, a trace.

    Every ``every`` steps the scalar outputs of ``step_fn`` (``loss`` first among them) and the
    throughput are logged: to ``FitResult.history``, to a progress bar or a line, and to the
    JSONL file and the writers. Each log reads the outputs back from the devices (a host sync).

    Args:
      every: steps between metric logs (and the last step); None: the last step only.
      first_step: also log step 1, so that the loss curve starts where training does (a run
        resumed past it is unchanged).
      metrics_path: a JSONL file that gets one line per log and per evaluation, written by
        process 0 (appended, so a resumed run continues it). The lines of steps after the one
        the run starts from, logged by an earlier run that stopped later, are dropped first, so
        that each step appears once.
      tensorboard_dir: also write the metrics as TensorBoard scalars there (needs
        ``tensorboardX``: ``pip install "replicator[tensorboard]"``); the same as a
        ``rp.training.TensorBoardWriter(tensorboard_dir)`` in ``writers``.
      writers: objects with ``write(step, metrics)`` and ``close()``
        (`rp.training.MetricWriter`), e.g. ``rp.training.TensorBoardWriter(dir)``,
        ``rp.training.WandbWriter(project=...)`` or your own: each gets every logged record
        (those of ``history``, without ``step``) on process 0, and is closed on every process
        when fit returns or raises.
      examples_per_step: the global batch size, for the examples/s figure.
      tokens_per_step: tokens per global batch, for the tokens/s figure of language models.
      progress: show a progress bar (in a terminal, or in Jupyter with ipywidgets) or else a
        line per log, and a summary at the end; on stderr, on process 0 only.
      profile: an `rp.training.Profile`: a ``jax.profiler`` trace of its steps, for
        TensorBoard or Perfetto.

    Raises:
      ValueError: if ``every``, ``examples_per_step`` or ``tokens_per_step`` is not an int
        >= 1 (or None).
      TypeError: if a path is not a path, a flag not a bool, ``profile`` not a `Profile`, or
        ``writers`` not a list of objects with ``write`` and ``close``.

    Example::

        rp.fit(repl, step_fn, state, input_fn, steps=1000,
               logging=rp.training.LoggingOptions(every=50, metrics_path="/tmp/run/m.jsonl"))

    >>> LoggingOptions(every=50, progress=False).every
    50
    """

    every: int | None = 10
    first_step: bool = False
    metrics_path: str | os.PathLike | None = None
    tensorboard_dir: str | os.PathLike | None = None
    writers: Sequence[MetricWriter] = ()
    examples_per_step: int | None = None
    tokens_per_step: int | None = None
    progress: bool = True
    profile: Profile | None = None

    def __post_init__(self) -> None:
        api = "rp.training.LoggingOptions"
        for name in ("every", "examples_per_step", "tokens_per_step"):
            errors.positive_int(getattr(self, name), api=api, name=name, none=" or None")
        for name in ("metrics_path", "tensorboard_dir"):
            _check_path(api, name, getattr(self, name))
        _check_flags(api, first_step=self.first_step, progress=self.progress)
        check_writers(self.writers, api=api)
        if self.profile is not None and not isinstance(self.profile, Profile):
            raise TypeError(
                f"{api}: profile must be an rp.training.Profile or None; got "
                f"{type(self.profile).__name__}. e.g. profile=rp.training.Profile('/tmp/trace')."
            )


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """How `rp.fit` evaluates: ``fn(state)`` every ``every`` steps.

    ``fn(state) -> dict`` of numbers is called with the training state; its numbers are logged
    with an ``eval_`` prefix (to ``history``, the JSONL file and the writers). It may run steps
    on that state with ``repl.run`` (``repl.run(eval_step, state, batch)``): while it runs,
    ``repl`` donates nothing, so training goes on with the same state. It must not delete the
    state otherwise (e.g. through ``jax.jit(..., donate_argnums=0)``): fit raises a ValueError
    naming it if it does. Its outputs are not checked for non-finite numbers.

    Args:
      fn: ``fn(state) -> dict`` of numbers.
      every: evaluate after every this many steps.

    Raises:
      TypeError: if ``fn`` is not callable.
      ValueError: if ``every`` is not an int >= 1.

    Example::

        def evaluate(state):
            _, out = repl.run(eval_step, state, held_out_batch)
            return rp.local_row(out)

        rp.fit(repl, step_fn, state, input_fn, steps=1000,
               evaluation=rp.training.EvalOptions(evaluate, every=100))

    >>> EvalOptions(lambda state: {}, every=100).every
    100
    """

    fn: Callable[[PyTree], dict]
    every: int

    def __post_init__(self) -> None:
        api = "rp.training.EvalOptions"
        if not callable(self.fn):
            raise TypeError(f"{api}: fn must be a function fn(state) -> dict; got {self.fn!r}.")
        errors.positive_int(self.every, api=api, name="every")
