"""The training loop: `fit` drives ``repl.run`` over ``repl.distribute(input_fn)``.

It shows a progress bar, logs metrics (JSONL, TensorBoard), evaluates now and then, checkpoints every
``checkpoint_every`` steps and when the process is asked to stop (SIGTERM, SIGINT: preemption),
and resumes from the newest checkpoint, input position included, so that a killed run loses at
most one checkpoint interval and continues exactly where it stopped. What it shows and writes is
`fit_log`'s, its non-finite checks are `nonfinite`'s and its stop signals `stop_flag`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from replicator._src.context import Replicator, local_row
from replicator._src.core import errors
from replicator._src.core.typing import PyTree, StepFn
from replicator._src.distributed import beat
from replicator._src.distributed import initialize as distributed
from replicator._src.training.checkpoint import Checkpoints, NoReadableCheckpointError
from replicator._src.training.fit_log import Report, drop_lines_after, notice
from replicator._src.training.nonfinite import FiniteGuard
from replicator._src.training.nonfinite import NonFiniteError as NonFiniteError  # raised by fit
from replicator._src.training.profiling import Profile, Tracer
from replicator._src.training.rundir import holds_run_lock
from replicator._src.training.stop_flag import StopFlag
from replicator._src.training.writers import MetricWriter, closes_writers


@dataclasses.dataclass
class FitResult:
    """What `fit` returns: the final state and what happened."""

    state: PyTree
    step: int  # the number of steps done, over all runs of this checkpoint directory
    history: list[dict]  # the logged metrics of this run
    preempted: bool  # stopped by SIGTERM/SIGINT (a checkpoint saved as emergency_after says)
    resumed_from: int | None  # the checkpoint step this run started from


@closes_writers  # writers checked before the run and closed after it, whatever happens
@holds_run_lock  # the run directory is this run's alone, until fit returns or raises
def fit(
    repl: Replicator,
    step_fn: StepFn,
    state: PyTree,
    input_fn: Callable[[Any], Iterable[PyTree]],
    *,
    steps: int,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    keep: int = 3,
    log_every: int = 10,
    metrics_path: str | os.PathLike | None = None,
    tensorboard_dir: str | os.PathLike | None = None,
    eval_fn: Callable[[PyTree], dict] | None = None,
    eval_every: int | None = None,
    examples_per_step: int | None = None,
    tokens_per_step: int | None = None,
    progress: bool = True,
    profile: Profile | dict | None = None,
    writers: list[MetricWriter] | tuple[MetricWriter, ...] = (),
    async_checkpoints: bool = False,
    emergency_after: int | None = 1,
    start_over_if_unreadable: bool = False,
) -> FitResult:
    """Trains for ``steps`` steps, resuming from ``checkpoint_dir`` if it holds a checkpoint.

    Equivalent to::

        for batch in repl.distribute(input_fn):            # from the checkpointed position
            state, outputs = repl.run(step_fn, state, batch)

    plus a progress bar, logging, evaluation, checkpoints and a summary at the end. The scalar
    ``outputs`` of ``step_fn`` are the logged metrics (``loss`` first among them).

    Non-finite training stops the run with `NonFiniteError` (naming the step and the metric or
    state leaf) before anything non-finite is saved, so every good checkpoint is kept and
    running again resumes from the newest. Checked: the scalar outputs of ``step_fn`` at every
    step that logs them (``log_every``) or saves a checkpoint, and the whole state (one small
    jitted reduction) right before each checkpoint is saved. With loss scaling, a step that the
    optimizer skipped (its ``skipped`` output grew: the state did not change) may show a
    non-finite loss; that is handled, not an error. Evaluation outputs are not checked.

    Running a finished run again (its newest checkpoint is at ``steps`` or beyond) does no
    step: it says that the run is complete and returns the restored state. If ``input_fn``
    ends before ``steps``, the state at that step is saved (with ``checkpoint_dir``) and a line
    says where the input ended.

    The input position is part of each checkpoint. If ``input_fn``'s iterator has
    ``get_state``/``set_state`` (`rp.Batches`, grain's iterators) its state is saved and a
    resumed run continues from it; otherwise ``input_fn`` must be deterministic, and on resume
    the batches before the checkpointed step are passed over.

    Args:
      repl, step_fn, state, input_fn: as for ``repl.run`` and ``repl.distribute``; ``state``
        is the initial state (placed), also the template that checkpoints restore into (on this
        mesh, whatever the mesh that saved them). Its buffers are donated to the first step:
        use ``result.state`` afterwards.
      steps: the total number of steps of the run (resumed runs count from where they were).
      checkpoint_dir: where checkpoints go; None: no checkpoints, no resume.
      checkpoint_every: save every this many steps (and at the end, and on SIGTERM/SIGINT as
        ``emergency_after`` says).
      keep: checkpoints to keep.
      log_every: steps between metric logs (each log reads the outputs: a host sync).
      metrics_path: a JSONL file that gets one line per log and per evaluation, written by
        process 0 (appended, so a resumed run continues it). The lines of steps after the one
        the run starts from, logged by an earlier run that stopped later, are dropped first, so
        that each step appears once: on resume, those after the restored checkpoint; in a run
        that starts at step 0 (no checkpoint yet, e.g. the first was killed before its first
        save, or no ``checkpoint_dir``), those of every step.
      tensorboard_dir: also write the metrics as TensorBoard scalars there (needs
        ``tensorboardX``: ``pip install "replicator[tensorboard]"``); the same as
        ``writers=[rp.training.TensorBoardWriter(tensorboard_dir)]``.
      eval_fn: ``eval_fn(state) -> dict`` of numbers, called every ``eval_every`` steps with
        the training state, logged with an ``eval_`` prefix. It may run steps on that state
        with ``repl.run`` (``repl.run(eval_step, state, batch)``): while it runs, ``repl``
        donates nothing, so training goes on with the same state. It must not delete the
        state otherwise (e.g. through ``jax.jit(..., donate_argnums=0)``): fit raises a
        ValueError naming ``eval_fn`` if it does.
      examples_per_step: the global batch size, for the examples/s figure.
      tokens_per_step: tokens per global batch, for the tokens/s figure of language models.
      progress: show a progress bar (in a terminal, or in Jupyter with ipywidgets) or else a
        line per log, and a summary at the end; on stderr, on process 0 only.
      profile: an `rp.training.Profile` (or a dict of its fields: ``dir``, ``start_step``,
        ``num_steps``): a ``jax.profiler`` trace of those steps, for TensorBoard or Perfetto.
      writers: `rp.training.MetricWriter`s (objects with ``write(step, metrics)`` and ``close()``),
        e.g. ``rp.training.TensorBoardWriter(dir)``, ``rp.training.WandbWriter(project=...)`` or your own: each
        gets every logged record (those of ``history``, without ``step``) on process 0, and
        is closed on every process when fit returns or raises.
      async_checkpoints: write checkpoints in a background thread (orbax's asynchronous
        saving): each save returns once the state is copied off the devices and training goes
        on while the files are written. A step is still complete or absent on disk (written
        aside, renamed when done); the next save, and fit's return (or its error), wait for
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
      start_over_if_unreadable: if ``checkpoint_dir`` holds checkpoints and none of them is
        readable, move them all aside (renamed ``<step>.broken-<time>``, never deleted, as a
        broken newest step is when an older one restores) and train from step 0, with a
        warning per step. By default (False) that is a FileNotFoundError and nothing is moved:
        when no step restores, ``state`` (the template they restore into) may be what is wrong,
        so set it only once the checkpoints are known to be broken.

    Returns:
      A `FitResult`; ``history`` holds this run's logged metrics.

    Raises:
      NonFiniteError: (a FloatingPointError) if a checked output or the state is not finite.
      CheckpointWriteError: (an OSError) if a checkpoint cannot be written because its
        filesystem is full or over quota; its partial directory is removed and the complete
        checkpoints are kept, so running again (with space) resumes from the newest.
      FileNotFoundError: if no checkpoint of ``checkpoint_dir`` is readable and not
        ``start_over_if_unreadable``.
      TypeError: if ``writers`` is not a list of objects with ``write`` and ``close``.

    Example (one epoch of a regression, on whatever devices there are)::

        def input_fn(ctx):
            return rp.Batches({"x": x, "y": y}, global_batch_size=256, ctx=ctx, num_epochs=1)

        result = rp.fit(repl, step_fn, state, input_fn, steps=1000,
                        checkpoint_dir="/tmp/run", checkpoint_every=100)
    """
    _check_arguments(steps, checkpoint_dir, checkpoint_every, eval_every, log_every)
    _check_options(emergency_after, async_checkpoints, start_over_if_unreadable)
    tracer = Tracer(Profile.of(profile))
    ckpt = None
    if checkpoint_dir is not None:
        ckpt = Checkpoints(checkpoint_dir, keep=keep, async_save=async_checkpoints)
    try:
        state, start, resumed_from, input_state = _resume(
            ckpt, state, metrics_path, start_over=start_over_if_unreadable
        )
        if start >= steps:
            notice(
                f"rp.fit: the run is complete at step {start} (steps={steps}); its checkpoint is in "
                f"{ckpt.directory}. Nothing to do: give a larger steps to train on."
            )
            return FitResult(state, start, [], False, resumed_from)
        report = Report(
            steps,
            start,
            progress,
            metrics_path,
            tensorboard_dir,
            examples_per_step,
            tokens_per_step,
            writers=writers,
        )
        if resumed_from is not None:
            report.say(f"rp.fit: resumed from the checkpoint of step {start} in {ckpt.directory}")
        run = _Training(
            repl,
            step_fn,
            state,
            start=start,
            steps=steps,
            ckpt=ckpt,
            checkpoint_every=checkpoint_every,
            log_every=log_every or steps,
            eval_fn=eval_fn,
            eval_every=eval_every,
            report=report,
            tracer=tracer,
            emergency_after=emergency_after,
        )
        try:
            run.train(input_fn, input_state)
            run.conclude()
        finally:
            tracer.stop()  # a run that ends (or fails) inside the traced steps
            report.close()
        return FitResult(run.state, run.step, report.history, run.preempted, resumed_from)
    finally:
        if ckpt is not None:
            ckpt.close()  # after the write in progress, if any


def _check_arguments(steps, checkpoint_dir, checkpoint_every, eval_every, log_every) -> None:
    """Refuses `fit`'s counts that are not positive ints, and checkpoints without a directory."""
    errors.positive_int(steps, api="rp.fit", name="steps")
    for name, value in (
        ("checkpoint_every", checkpoint_every),
        ("eval_every", eval_every),
        ("log_every", log_every),
    ):
        errors.positive_int(value, api="rp.fit", name=name, none=" or None")
    if checkpoint_every and checkpoint_dir is None:
        raise ValueError(
            "rp.fit: checkpoint_every is set but checkpoint_dir is None; give checkpoint_dir "
            "(a directory) to save checkpoints."
        )


def _check_options(emergency_after, async_checkpoints, start_over_if_unreadable) -> None:
    """Refuses `fit`'s checkpoint options of the wrong type."""
    errors.positive_int(emergency_after, api="rp.fit", name="emergency_after", none=" or None")
    flags = {
        "async_checkpoints": async_checkpoints,
        "start_over_if_unreadable": start_over_if_unreadable,
    }
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"rp.fit: {name} must be True or False; got {flag!r}.")


def _resume(ckpt: Checkpoints | None, state: PyTree, metrics_path, *, start_over: bool) -> tuple:
    """Where `fit` starts: ``(state, start, resumed_from, input_state)``, from the newest
    readable checkpoint if there is one, else from ``state`` at step 0; the JSONL lines of the
    steps after the start are dropped. With ``start_over``, checkpoints of which none is
    readable are moved aside, and the run starts at step 0."""
    start, resumed_from, input_state = 0, None, None
    if ckpt is not None and ckpt.latest_step() is not None:
        try:
            state, record = ckpt.restore(state)
        except NoReadableCheckpointError as e:
            if not start_over:
                raise
            ckpt._move_aside(e.unreadable, restored_step=None)
        else:
            start = resumed_from = int(record["step"])
            input_state = _my_input_state(record.get("input_state"))
    if metrics_path is not None:
        drop_lines_after(metrics_path, start)
    return state, start, resumed_from, input_state


class _Training:
    """One run of `fit`'s loop: the state and step it has reached, and the work of each step."""

    def __init__(
        self,
        repl: Replicator,
        step_fn: StepFn,
        state: PyTree,
        *,
        start: int,
        steps: int,
        ckpt: Checkpoints | None,
        checkpoint_every: int | None,
        log_every: int,
        eval_fn: Callable[[PyTree], dict] | None,
        eval_every: int | None,
        report: Report,
        tracer: Tracer,
        emergency_after: int | None = 1,
    ) -> None:
        self.repl, self.step_fn, self.state = repl, step_fn, state
        self.emergency_after = emergency_after  # see fit
        self.start = self.step = start
        self.steps, self.log_every = steps, log_every
        self.ckpt, self.checkpoint_every = ckpt, checkpoint_every
        self.eval_fn, self.eval_every = eval_fn, eval_every
        self.report, self.tracer = report, tracer
        self.preempted = False
        self.stop = StopFlag()
        self.guard = FiniteGuard(ckpt)

    def train(self, input_fn: Callable[[Any], Iterable[PyTree]], input_state: Any) -> None:
        """Runs steps until ``steps``, a stop signal or the end of the input; saves the last."""
        skip = 0 if input_state is not None else self.start
        with (
            self.stop.installed(),
            self.report,
            self.repl.distribute(input_fn, skip=skip, state=input_state) as batches,
        ):
            for batch in batches:
                distributed.heartbeat(self.step + 1)  # for replicator launch's watchdog
                if self.step >= self.steps or not self._step(batch, batches):
                    break
            if self._saves_where_it_stopped():
                self._save(batches)  # at the end, on SIGTERM/SIGINT, or where the input ended

    def _saves_where_it_stopped(self) -> bool:
        """Whether `train` saves the step it stopped at: at ``steps`` or where the input ended
        (unless just saved); on SIGTERM/SIGINT, if the newest checkpoint is at least
        ``emergency_after`` steps older (every process decides alike: the same step, the same
        directory)."""
        ckpt = self.ckpt
        if ckpt is None or self.step <= self.start:
            return False
        newest = ckpt.latest_step()
        if newest == self.step:
            return False
        if not self.preempted:
            return True
        after = self.emergency_after
        return after is not None and self.step - (newest or 0) >= after

    def _step(self, batch: PyTree, batches) -> bool:
        """One step, then its logs, checks, evaluation and checkpoint; whether to go on."""
        self.tracer.before(self.step + 1)
        self.state, outputs = self.repl.run(self.step_fn, self.state, batch)
        self.step += 1
        stop = self.stop.after_step(self.step)  # before anything waits on the step's results
        self.tracer.after(self.step, self.state)
        step, report = self.step, self.report
        report.advance(step)
        logs = step % self.log_every == 0 or step == self.steps
        every = self.checkpoint_every
        saves = self.ckpt is not None and every and step % every == 0
        if logs or saves:
            metrics = _numbers(local_row(outputs))
            if logs:
                report.log(step, metrics)
            self.guard.check_outputs(step, metrics)
        if self.eval_fn is not None and self.eval_every and step % self.eval_every == 0:
            report.log(
                step, _numbers(_evaluate(self.repl, self.eval_fn, self.state)), prefix="eval_"
            )
        if saves:
            self._save(batches)
        if stop:
            self.preempted = True
            return False
        return step < self.steps  # else stop before next() takes one more batch off the input

    def _save(self, batches) -> None:
        self.guard.check_state(self.step, self.state)
        extra = {"data_position": self.step}
        position = batches.get_state()
        if position is not None:
            extra["input_state"] = _gather(position)
        self.ckpt.save(self.step, self.state, **extra)
        beat.checkpointed(self.step)  # for replicator launch: where a restart resumes

    def _kept(self) -> str:
        """What a stop signal left: the checkpoint saved, or why none was (emergency_after)."""
        newest = self.ckpt.latest_step() if self.ckpt is not None else None
        if newest == self.step:
            return "checkpoint saved"
        if self.ckpt is None:
            return "no checkpoint_dir, nothing saved"
        since = f"step {newest}" if newest is not None else "none"
        return (
            f"no checkpoint saved (emergency_after={self.emergency_after}; newest: {since}): "
            f"running again resumes from step {newest or 0}"
        )

    def conclude(self) -> None:
        """Says how the run ended, unless at ``steps``, and sums it up."""
        step, ckpt, report = self.step, self.ckpt, self.report
        if self.preempted:
            report.notice(
                f"rp.fit: stopped by {self.stop.stopped_by} at step {step}; {self._kept()}"
            )
        elif step < self.steps:
            saved = f"; checkpoint of step {step} saved in {ckpt.directory}" if ckpt else ""
            report.notice(
                f"rp.fit: the input (input_fn) ended at step {step} of {self.steps}, before steps"
                f"{saved}."
            )
        report.summary(step, ckpt)


def _evaluate(repl: Replicator, eval_fn: Callable[[PyTree], dict], state: PyTree) -> Any:
    """``eval_fn(state)``, with ``repl``'s donation suspended so that the state outlives it."""
    with repl._donation_suspended():
        metrics = eval_fn(state)
    path = errors.deleted_leaf(state)
    if path is not None:
        name = getattr(eval_fn, "__qualname__", None) or repr(eval_fn)
        raise ValueError(
            f"rp.fit: eval_fn ({name}) deleted state leaf "
            f"{path} of the training state, which "
            f"training goes on with: it donated it to a program (a jax.jit with "
            f"donate_argnums, or another Replicator with donate=True) or deleted it. Let "
            f"eval_fn only read the state: run its steps through fit's replicator (fit "
            f"suspends its donation during eval_fn), jit without donate_argnums, or give "
            f"another replicator donate=False."
        )
    return metrics


def _gather(position: Any) -> list:
    """Every process's input position, in process order (each process has its own input)."""
    if jax.process_count() == 1:
        return [position]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(position).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([raw.size], np.int32))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: raw.size] = raw
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[: int(n)])) for row, n in zip(rows, np.ravel(sizes))]


def _my_input_state(states: list | None) -> Any:
    if states is None:
        return None
    if len(states) == jax.process_count():
        return states[jax.process_index()]
    if all(s == states[0] for s in states):  # e.g. rp.Batches: one position for all processes
        return states[0]
    raise ValueError(
        f"rp.fit: the checkpoint holds the input positions of {len(states)} processes, which "
        f"differ, and this run has {jax.process_count()}; resume with the same number of "
        f"processes, or use an input whose position is the same on every process (rp.Batches)."
    )


def _numbers(tree: Any) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, value in flat:
        value = np.asarray(value)
        if value.size == 1:
            key = jax.tree_util.keystr(path).strip("[]'\".") or "value"
            out[key.replace("']['", ".")] = value.item()
    return out
