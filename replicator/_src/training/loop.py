"""The training loop: `fit` drives ``repl.run`` over ``repl.distribute(input_fn)``.

It shows a progress bar, logs metrics (JSONL, TensorBoard), evaluates now and then, checkpoints every
few steps and when the process is asked to stop (SIGTERM, SIGINT: preemption), and resumes from
the newest checkpoint, input position included, so that a killed run loses at most one
checkpoint interval and continues exactly where it stopped. Its options are `options`' records
(the keywords of the previous release: `fit_keywords`); what it shows and writes is `fit_log`'s,
its non-finite checks are `nonfinite`'s and its stop signals `stop_flag`'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np

from replicator._src.context import Replicator, local_row
from replicator._src.core import errors
from replicator._src.core.typing import PyTree, StepFn
from replicator._src.distributed import beat, programs
from replicator._src.distributed import initialize as distributed
from replicator._src.training import fit_keywords
from replicator._src.training.checkpoint import Checkpoints, NoReadableCheckpointError
from replicator._src.training.fit_log import Report, drop_lines_after, notice
from replicator._src.training.nonfinite import FiniteGuard
from replicator._src.training.nonfinite import NonFiniteError as NonFiniteError  # raised by fit
from replicator._src.training.options import CheckpointOptions, EvalOptions, LoggingOptions
from replicator._src.training.profiling import Tracer
from replicator._src.training.rundir import holds_run_lock
from replicator._src.training.stop_flag import StopFlag
from replicator._src.training.writers import closes_writers


@dataclasses.dataclass
class FitResult:
    """What `fit` returns: the final state and what happened."""

    state: PyTree
    step: int  # the number of steps done, over all runs of this checkpoint directory
    history: list[dict]  # the logged metrics of this run
    preempted: bool  # stopped by SIGTERM/SIGINT (saved as CheckpointOptions.emergency_after says)
    resumed_from: int | None  # the checkpoint step this run started from
    stopped_by: str = ""  # the signal that stopped it ("SIGTERM", "SIGINT in process 1"), or ""


def fit(
    repl: Replicator,
    step_fn: StepFn,
    state: PyTree,
    input_fn: Callable[[Any], Iterable[PyTree]],
    *,
    steps: int,
    checkpointing: CheckpointOptions | None = None,
    logging: LoggingOptions | None = None,
    evaluation: EvalOptions | None = None,
    on_step: Callable[[int], None] | None = None,
    **deprecated: Any,
) -> FitResult:
    """Trains for ``steps`` steps, resuming from the newest checkpoint if there is one.

    Equivalent to::

        for batch in repl.distribute(input_fn):            # from the checkpointed position
            state, outputs = repl.run(step_fn, state, batch)
            on_step(step)

    plus a progress bar, logging, evaluation, checkpoints and a summary at the end. The scalar
    ``outputs`` of ``step_fn`` are the logged metrics (``loss`` first among them). What is
    saved, shown and evaluated, and when, is said by three option records:
    `rp.training.CheckpointOptions`, `rp.training.LoggingOptions` and
    `rp.training.EvalOptions`.

    Non-finite training stops the run with `NonFiniteError` (naming the step and the metric or
    state leaf) before anything non-finite is saved, so every good checkpoint is kept and
    running again resumes from the newest. Checked: the scalar outputs of ``step_fn`` at every
    step that logs them or saves a checkpoint, and the whole state (one small jitted
    reduction) right before each checkpoint is saved. With loss scaling, a step that the
    optimizer skipped (its ``skipped`` output grew: the state did not change) may show a
    non-finite loss; that is handled, not an error. Evaluation outputs are not checked.

    Running a finished run again (its newest checkpoint is at ``steps`` or beyond) does no
    step: it says that the run is complete and returns the restored state. If ``input_fn``
    ends before ``steps``, the state at that step is saved (with checkpoints) and a line says
    where the input ended.

    The input position is part of each checkpoint. If ``input_fn``'s iterator has
    ``get_state``/``set_state`` (`rp.Batches`, grain's iterators) its state is saved and a
    resumed run continues from it; otherwise ``input_fn`` must be deterministic, and on resume
    the batches before the checkpointed step are passed over.

    The keyword arguments of the previous release (``checkpoint_dir``, ``checkpoint_every``,
    ``keep``, ``async_checkpoints``, ``emergency_after``, ``start_over_if_unreadable``,
    ``log_every``, ``metrics_path``, ``tensorboard_dir``, ``writers``, ``examples_per_step``,
    ``tokens_per_step``, ``progress``, ``profile``, ``eval_fn``, ``eval_every``) still work,
    each with a ``DeprecationWarning`` naming its field in the records, until the next release.

    Args:
      repl: the `rp.Replicator` whose ``run`` and ``distribute`` train.
      step_fn: one replica's step, ``step_fn(state, batch) -> (state, outputs)``.
      state: the initial state (placed), also the template that checkpoints restore into (on
        this mesh, whatever the mesh that saved them). Its buffers are donated to the first
        step: use ``result.state`` afterwards.
      input_fn: ``input_fn(ctx)``, an iterable of this process's batches (as for
        ``repl.distribute``).
      steps: the total number of steps of the run (resumed runs count from where they were).
      checkpointing: where and when to save checkpoints (`rp.training.CheckpointOptions`);
        None: no checkpoints, no resume.
      logging: what to show and write (`rp.training.LoggingOptions`); None: its defaults (a
        log every 10 steps, a progress bar, no files).
      evaluation: what to evaluate and when (`rp.training.EvalOptions`); None: no evaluation.
      on_step: ``on_step(step)``, called after each step with its number (counted from 1 over
        every run of the checkpoint directory) once ``repl.run`` has returned, before the
        step's logs, evaluation and checkpoint: e.g. to tell a failure of the first step from
        one later on, or to stop from outside (raise).
      **deprecated: the keyword arguments of the previous release (see above).

    Returns:
      A `FitResult`; ``history`` holds this run's logged metrics.

    Raises:
      NonFiniteError: (a FloatingPointError) if a checked output or the state is not finite.
      rp.distributed.ProgramsDifferError: (a ValueError) on several processes, before the
        first step, if they lowered different step programs (which would hang in a
        collective): on every process, naming them by fingerprint and the first line that
        differs.
      CheckpointWriteError: (an OSError) if a checkpoint cannot be written because its
        filesystem is full or over quota; its partial directory is removed and the complete
        checkpoints are kept, so running again (with space) resumes from the newest.
      FileNotFoundError: if no checkpoint of the checkpoint directory is readable and not
        ``start_over_if_unreadable``.
      ValueError: if ``steps`` is not an int >= 1, or an old keyword argument is given with
        its record.
      TypeError: for an unknown keyword argument, or an option that is not its record.

    Example (one epoch of a regression, on whatever devices there are)::

        def input_fn(ctx):
            return rp.Batches({"x": x, "y": y}, global_batch_size=256, ctx=ctx, num_epochs=1)

        result = rp.fit(repl, step_fn, state, input_fn, steps=1000,
                        checkpointing=rp.training.CheckpointOptions("/tmp/run", every=100),
                        logging=rp.training.LoggingOptions(every=50))
    """
    given = {"checkpointing": checkpointing, "logging": logging, "evaluation": evaluation}
    if deprecated:
        given = fit_keywords.translate(deprecated, given)
    options = _options(given, on_step)
    directory = None if options.checkpointing is None else options.checkpointing.directory
    return _fit(
        repl,
        step_fn,
        state,
        input_fn,
        steps=steps,
        checkpoint_dir=directory,
        metrics_path=options.logging.metrics_path,
        writers=options.logging.writers,
        options=options,
    )


class _Options(NamedTuple):
    """`fit`'s options, each checked to be of its record's type."""

    checkpointing: CheckpointOptions | None
    logging: LoggingOptions
    evaluation: EvalOptions | None
    on_step: Callable[[int], None] | None


def _options(given: dict[str, Any], on_step: Any) -> _Options:
    """`fit`'s option records, checked; ``logging``'s defaults when it is None."""
    for name, cls in fit_keywords.RECORDS.items():
        value = given[name]
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                f"rp.fit: {name} must be an rp.training.{cls.__name__} or None; got "
                f"{type(value).__name__}. e.g. {name}=rp.training.{cls.__name__}(...)."
            )
    if on_step is not None and not callable(on_step):
        raise TypeError(
            f"rp.fit: on_step must be a function on_step(step) or None; got {on_step!r}."
        )
    logging = given["logging"] or LoggingOptions()
    return _Options(given["checkpointing"], logging, given["evaluation"], on_step)


@closes_writers  # writers checked before the run and closed after it, whatever happens
@holds_run_lock  # the run directory is this run's alone, until fit returns or raises
def _fit(repl, step_fn, state, input_fn, *, steps, checkpoint_dir, metrics_path, writers, options):
    """`fit` with its options checked; ``checkpoint_dir``, ``metrics_path`` and ``writers``
    (the options') are read by the decorators."""
    del checkpoint_dir, writers
    errors.positive_int(steps, api="rp.fit", name="steps")
    saving, logging = options.checkpointing, options.logging
    tracer = Tracer(logging.profile)
    ckpt = None
    if saving is not None:
        ckpt = Checkpoints(saving.directory, keep=saving.keep, async_save=saving.async_save)
    try:
        start_over = saving is not None and saving.start_over_if_unreadable
        state, start, resumed_from, input_state = _resume(
            ckpt, state, metrics_path, start_over=start_over
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
            logging.progress,
            metrics_path,
            logging.tensorboard_dir,
            logging.examples_per_step,
            logging.tokens_per_step,
            writers=logging.writers,
        )
        if resumed_from is not None:
            report.say(f"rp.fit: resumed from the checkpoint of step {start} in {ckpt.directory}")
        run = _Training(repl, step_fn, state, start, steps, ckpt, options, report, tracer)
        try:
            run.train(input_fn, input_state)
            run.conclude()
        finally:
            tracer.stop()  # a run that ends (or fails) inside the traced steps
            report.close()
        stopped_by = run.stop.stopped_by if run.preempted else ""
        return FitResult(
            run.state, run.step, report.history, run.preempted, resumed_from, stopped_by
        )
    finally:
        if ckpt is not None:
            ckpt.close()  # after the write in progress, if any


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
        start: int,
        steps: int,
        ckpt: Checkpoints | None,
        options: _Options,
        report: Report,
        tracer: Tracer,
    ) -> None:
        self.repl, self.step_fn, self.state = repl, step_fn, state
        self.start = self.step = start
        self.steps, self.ckpt, self.options = steps, ckpt, options
        self.log_every = options.logging.every or steps
        saving = options.checkpointing
        self.checkpoint_every = None if saving is None else saving.every
        self.emergency_after = 1 if saving is None else saving.emergency_after  # see fit
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
        if self.step == self.start and self.repl.lowering != "local":  # several processes:
            programs.check_same_program(  # the same program on each, or refused (hangs)
                lambda: self.repl.lower(self.step_fn, self.state, batch).as_text(),
                mesh=self.repl.mesh,
                api="rp.fit",
            )
        self.tracer.before(self.step + 1)
        self.state, outputs = self.repl.run(self.step_fn, self.state, batch)
        self.step += 1
        stop = self.stop.after_step(self.step)  # before anything waits on the step's results
        self.tracer.after(self.step, self.state)
        step, report, options = self.step, self.report, self.options
        if options.on_step is not None:
            options.on_step(step)
        report.advance(step)
        logs = step % self.log_every == 0 or step == self.steps
        logs = logs or (step == 1 and options.logging.first_step)
        every = self.checkpoint_every
        saves = self.ckpt is not None and every and step % every == 0
        if logs or saves:
            metrics = _numbers(local_row(outputs))
            if logs:
                report.log(step, metrics)
            self.guard.check_outputs(step, metrics)
        evaluation = options.evaluation
        if evaluation is not None and step % evaluation.every == 0:
            metrics = _evaluate(self.repl, evaluation.fn, self.state)
            report.log(step, _numbers(metrics), prefix="eval_")
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


def _evaluate(repl: Replicator, fn: Callable[[PyTree], dict], state: PyTree) -> Any:
    """``fn(state)`` (`EvalOptions.fn`), with ``repl``'s donation suspended so that the state
    outlives it."""
    with repl._donation_suspended():
        metrics = fn(state)
    path = errors.deleted_leaf(state)
    if path is not None:
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise ValueError(
            f"rp.fit: the evaluation's fn ({name}) deleted state leaf {path} of the training "
            f"state, which training goes on with: it donated it to a program (a jax.jit with "
            f"donate_argnums, or another Replicator with donate=True) or deleted it. Let it "
            f"only read the state: run its steps through fit's replicator (fit suspends its "
            f"donation during the evaluation), jit without donate_argnums, or give another "
            f"replicator donate=False."
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
