"""The training loop: `fit` drives ``repl.run`` over ``repl.distribute(input_fn)``.

It shows a progress bar, logs metrics (JSONL, TensorBoard), evaluates now and then, checkpoints every
``checkpoint_every`` steps and when the process is asked to stop (SIGTERM, SIGINT: preemption),
and resumes from the newest checkpoint, input position included, so that a killed run loses at
most one checkpoint interval and continues exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src import distributed, errors
from replicator._src.checkpoint import Checkpoints
from replicator._src.context import Replicator, local_row
from replicator._src.rundir import holds_run_lock
from replicator._src.typing import PyTree, StepFn


class NonFiniteError(FloatingPointError):
    """`fit` stopped because a training output or the state is not finite (nan or inf).

    Raised before anything non-finite is saved: every checkpoint of the run is kept, and the
    run resumes from the newest (for example with a lower learning rate) when started again.
    """


NONFINITE = """\
rp.fit: {what} at step {step}. Stopped before saving anything non-finite: {kept}
Lower the learning rate, check the data (or pass loss_scale="dynamic" to wrap_optimizer, which \
skips steps whose gradients are not finite), then run again{resume}."""


@dataclasses.dataclass
class FitResult:
    """What `fit` returns: the final state and what happened."""

    state: PyTree
    step: int  # the number of steps done, over all runs of this checkpoint directory
    history: list[dict]  # the logged metrics of this run
    preempted: bool  # stopped by SIGTERM/SIGINT, after saving a checkpoint
    resumed_from: int | None  # the checkpoint step this run started from


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
      checkpoint_every: save every this many steps (and at the end, and on SIGTERM/SIGINT).
      keep: checkpoints to keep.
      log_every: steps between metric logs (each log reads the outputs: a host sync).
      metrics_path: a JSONL file that gets one line per log and per evaluation (appended, so a
        resumed run continues it; on resume, the lines of steps after the restored checkpoint,
        logged before the run stopped, are dropped first, so that each step appears once).
      tensorboard_dir: also write the metrics as TensorBoard scalars there (needs
        ``tensorboardX``: ``pip install "replicator[tensorboard]"``).
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

    Returns:
      A `FitResult`; ``history`` holds this run's logged metrics.

    Raises:
      NonFiniteError: (a FloatingPointError) if a checked output or the state is not finite.

    Example (one epoch of a regression, on whatever devices there are)::

        def input_fn(ctx):
            return rp.Batches({"x": x, "y": y}, global_batch_size=256, ctx=ctx, num_epochs=1)

        result = rp.fit(repl, step_fn, state, input_fn, steps=1000,
                        checkpoint_dir="/tmp/run", checkpoint_every=100)
    """
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
    log_every = log_every or steps
    ckpt = Checkpoints(checkpoint_dir, keep=keep) if checkpoint_dir is not None else None
    start, resumed_from, input_state = 0, None, None
    if ckpt is not None and ckpt.latest_step() is not None:
        state, record = ckpt.restore(state)
        start = resumed_from = int(record["step"])
        input_state = _my_input_state(record.get("input_state"))
        if metrics_path is not None:
            _drop_lines_after(metrics_path, start)
    if start >= steps:
        _notice(
            f"rp.fit: the run is complete at step {start} (steps={steps}); its checkpoint is in "
            f"{ckpt.directory}. Nothing to do: give a larger steps to train on."
        )
        return FitResult(state, start, [], False, resumed_from)
    report = _Report(
        steps, start, progress, metrics_path, tensorboard_dir, examples_per_step, tokens_per_step
    )
    if resumed_from is not None:
        report.say(f"rp.fit: resumed from the checkpoint of step {start} in {ckpt.directory}")
    step, preempted = start, False
    stop = _StopFlag()
    guard = _FiniteGuard(ckpt)

    def save(batches) -> None:
        guard.check_state(step, state)
        extra = {"data_position": step}
        position = batches.get_state()
        if position is not None:
            extra["input_state"] = _gather(position)
        ckpt.save(step, state, **extra)

    try:
        with (
            stop.installed(),
            report,
            repl.distribute(
                input_fn, skip=0 if input_state is not None else start, state=input_state
            ) as batches,
        ):
            for batch in batches:
                distributed.heartbeat()  # progress, for replicator launch --watchdog
                if step >= steps:
                    break
                state, outputs = repl.run(step_fn, state, batch)
                step += 1
                report.advance(step)
                logs = step % log_every == 0 or step == steps
                saves = ckpt is not None and checkpoint_every and step % checkpoint_every == 0
                if logs or saves:
                    metrics = _numbers(local_row(outputs))
                    if logs:
                        report.log(step, metrics)
                    guard.check_outputs(step, metrics)
                if eval_fn is not None and eval_every and step % eval_every == 0:
                    report.log(step, _numbers(_evaluate(repl, eval_fn, state)), prefix="eval_")
                if saves:
                    save(batches)
                if stop.requested:
                    preempted = True
                    break
                if step >= steps:
                    break  # before next() takes one more batch off the input
            if ckpt is not None and step > start and ckpt.latest_step() != step:
                save(batches)  # at the end, on SIGTERM/SIGINT, or where the input ended
        if preempted:
            report.say(f"rp.fit: stopped by {stop.signal_name} at step {step}; checkpoint saved")
        elif step < steps:
            saved = f"; checkpoint of step {step} saved in {ckpt.directory}" if ckpt else ""
            report.notice(
                f"rp.fit: the input (input_fn) ended at step {step} of {steps}, before steps"
                f"{saved}."
            )
        report.summary(step, ckpt)
    finally:
        report.close()
    return FitResult(state, step, report.history, preempted, resumed_from)


class _FiniteGuard:
    """Stops `fit` with `NonFiniteError` when a checked output or the state is not finite."""

    def __init__(self, ckpt: Checkpoints | None) -> None:
        self._ckpt = ckpt
        self._skipped: float | None = None  # the last ``skipped`` count of loss scaling seen

    def check_outputs(self, step: int, metrics: dict) -> None:
        skipped = [v for k, v in metrics.items() if k.split(".")[-1] == "skipped"]
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not np.isfinite(v)]
        if skipped:
            handled = self._skipped is None or skipped[0] > self._skipped
            self._skipped = skipped[0]
            if handled:  # the optimizer skipped this step: its state did not change
                bad = []
        if _anywhere(bool(bad)):
            name = bad[0] if bad else "(on another process)"
            value = metrics.get(name, float("nan"))
            raise NonFiniteError(self._message(f"the training output {name!r} is {value}", step))

    def check_state(self, step: int, state: PyTree) -> None:
        leaf = _nonfinite_leaf(state)
        if leaf is not None:
            raise NonFiniteError(
                self._message(f"state leaf {leaf} is not finite (nan or inf)", step)
            )

    def _message(self, what: str, step: int) -> str:
        ckpt = self._ckpt
        newest = ckpt.latest_step() if ckpt is not None else None
        if ckpt is None:
            kept, resume = "there is no checkpoint_dir, so nothing was saved.", ""
        elif newest is None:
            kept = f"no checkpoint in {ckpt.directory} yet."
            resume = " (it starts from step 0)"
        else:
            kept = f"the checkpoints in {ckpt.directory} are kept (newest: step {newest})."
            resume = f" to resume from step {newest}"
        return NONFINITE.format(what=what, step=step, kept=kept, resume=resume)


def _anywhere(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (so that every process stops together)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


@jax.jit
def _finite_flags(leaves: list) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def _nonfinite_leaf(state: PyTree) -> str | None:
    """The path of the first floating leaf of ``state`` holding a nan or inf, or None."""
    flat = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not flat:
        return None
    flags = np.asarray(_finite_flags([x for _, x in flat]))
    if flags.all():
        return None
    return jax.tree_util.keystr(flat[int(np.argmin(flags))][0])


def _drop_lines_after(path: str | os.PathLike, step: int) -> None:
    """Rewrites the JSONL file ``path`` without the lines of steps after ``step`` (logged by a
    run that stopped after its last checkpoint, and about to be logged again) and without a
    line cut short by a kill: through a new file and a rename, so that a kill meanwhile
    leaves the old file or the new one."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and record["step"] > step
        ):
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if kept == lines:
        return
    temporary = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _notice(text: str) -> None:
    """A line on stderr on process 0, whether or not ``progress`` is on."""
    if jax.process_index() == 0:
        print(text, file=sys.stderr, flush=True)


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


class _Report:
    """The run's outputs besides the state: progress bar or lines, JSONL, TensorBoard, summary."""

    def __init__(
        self, steps, start, progress, metrics_path, tensorboard_dir, examples, tokens
    ) -> None:
        self.steps, self.start = steps, start
        self.history: list[dict] = []
        self._show = progress and jax.process_index() == 0
        self._examples, self._tokens = examples, tokens
        self._t_start = self._t_log = time.perf_counter()
        self._last_log_step = start
        self._jsonl = open(metrics_path, "a") if metrics_path is not None else None
        self._tb = _tensorboard(tensorboard_dir) if jax.process_index() == 0 else None
        self._bar = _bar(steps, start) if self._show else None
        self._status = ""

    def __enter__(self):
        if self._bar is not None:
            self._bar[0].start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar[0].stop()
            self._bar = None

    def advance(self, step: int) -> None:
        if self._bar is not None:
            progress, task = self._bar
            progress.update(task, completed=step, status=self._status)

    def log(self, step: int, metrics: dict, prefix: str = "") -> None:
        record = {"step": step, **{prefix + k: v for k, v in metrics.items()}}
        if not prefix:
            now = time.perf_counter()
            rate = (step - self._last_log_step) / max(now - self._t_log, 1e-9)
            self._t_log, self._last_log_step = now, step
            record["steps_per_s"] = rate
            if self._examples:
                record["examples_per_s"] = rate * self._examples
            if self._tokens:
                record["tokens_per_s"] = rate * self._tokens
        self.history.append(record)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        line = _line(record, self.steps)
        if self._bar is not None:
            if not prefix:
                self._status = "  ".join(line.split("  ")[1:4])
            self._bar[0].console.print(line, highlight=False)
        else:
            self.say(line)

    def say(self, text: str) -> None:
        if not self._show:
            return
        if self._bar is not None:
            self._bar[0].console.print(text, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def notice(self, text: str) -> None:
        """``text`` on process 0 even without ``progress``: something the user must know."""
        if self._show:
            self.say(text)
        else:
            _notice(text)

    def summary(self, step: int, ckpt: Checkpoints | None) -> None:
        seconds = time.perf_counter() - self._t_start
        done = step - self.start
        parts = [f"rp.fit: {done} steps (to step {step}) in {seconds:.1f} s"]
        losses = [r["loss"] for r in self.history if "loss" in r]
        if losses:
            parts.append(f"loss {losses[0]:.4g} -> {losses[-1]:.4g}")
        rate = done / max(seconds, 1e-9)
        if self._tokens:
            parts.append(f"{rate * self._tokens:,.0f} tokens/s")
        elif self._examples:
            parts.append(f"{rate * self._examples:,.0f} examples/s")
        if ckpt is not None and ckpt.latest_step() is not None:
            parts.append(f"checkpoint {ckpt.latest_step()} in {ckpt.directory}")
        self.__exit__()
        self.say("; ".join(parts))

    def close(self) -> None:
        self.__exit__()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _bar(steps: int, start: int):
    """A rich progress bar on stderr if stderr shows one (a terminal, or Jupyter with
    ipywidgets); None in logs and files, where a line per log reads better."""
    from rich import progress as rp_progress
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_jupyter:
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            return None
    elif not console.is_terminal or console.is_dumb_terminal:
        return None
    bar = rp_progress.Progress(
        rp_progress.TextColumn("step"),
        rp_progress.MofNCompleteColumn(),
        rp_progress.BarColumn(),
        rp_progress.TimeElapsedColumn(),
        rp_progress.TextColumn("<"),
        rp_progress.TimeRemainingColumn(),
        rp_progress.TextColumn("{task.fields[status]}"),
        console=console,
    )
    task = bar.add_task("fit", total=steps, completed=start, status="")
    return bar, task


def _tensorboard(directory):
    if directory is None:
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        warnings.warn(
            "rp.fit: tensorboard_dir is set but tensorboardX is not installed; metrics go to "
            'JSONL only. pip install "replicator[tensorboard]" to write TensorBoard scalars.',
            stacklevel=3,
        )
        return None
    return SummaryWriter(os.fspath(directory))


class _StopFlag:
    """SIGTERM/SIGINT set a flag that the loop reads at each step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = {}

        def handler(signum, frame):
            self.requested = True
            self.signal_name = signal.Signals(signum).name

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _numbers(tree: Any) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, value in flat:
        value = np.asarray(value)
        if value.size == 1:
            key = jax.tree_util.keystr(path).strip("[]'\".") or "value"
            out[key.replace("']['", ".")] = value.item()
    return out


def _line(metrics: dict, steps: int) -> str:
    parts = [f"step {metrics['step']:>6}/{steps}"]
    for key, value in metrics.items():
        if key != "step":
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return "  ".join(parts)
