"""Where `rp.fit`'s logged metrics go besides its JSONL file: `MetricWriter`s.

A writer is any object with ``write(step, metrics)`` and ``close()``. `fit` calls ``write`` on
process 0 with each record it logs (the same records as ``FitResult.history``, without their
``step``), and ``close`` on every process when it returns or raises. Two come with the
library: `TensorBoardWriter` (tensorboardX) and `WandbWriter` (Weights & Biases, offline by
default).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MetricWriter(Protocol):
    """What `rp.fit` writes its logged metrics to (``writers=[...]``).

    ``write(step, metrics)`` gets each record that `fit` logs, on process 0 only: every
    ``log_every`` steps the step's scalar outputs and throughput (``loss``, ``steps_per_s``,
    ...), and every ``eval_every`` steps the evaluation (``eval_...``), at the same step as
    that step's training record. The records are those of ``FitResult.history`` and of the
    ``metrics_path`` JSONL, without their ``step`` key; steps rise, and a step can come twice
    (training, then evaluation). ``close()`` is called once on every process, when `fit`
    returns or raises (also when it refuses its arguments or has no step left to run). Any
    object with these two methods is a writer; it need not subclass this class.

    A writer of your own that keeps the records and prints the loss:

    >>> import numpy as np, replicator as rp
    >>> class Printer:
    ...     def __init__(self):
    ...         self.records = []
    ...     def write(self, step, metrics):
    ...         self.records.append({"step": step, **metrics})
    ...         print(step, metrics["loss"])
    ...     def close(self):
    ...         print("closed")
    >>> printer = Printer()
    >>> isinstance(printer, rp.training.MetricWriter)
    True
    >>> repl = rp.Replicator()
    >>> step_fn = lambda state, x: (state + 1.0, {"loss": state})
    >>> batches = lambda ctx: (np.ones((8, 2), np.float32) for _ in range(4))
    >>> logging = rp.training.LoggingOptions(every=2, progress=False, writers=[printer])
    >>> result = rp.fit(repl, step_fn, repl.replicate(np.float32(0.0)), batches, steps=4,
    ...                 logging=logging)
    2 1.0
    4 3.0
    closed
    >>> printer.records == result.history
    True
    """

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Writes the record of step ``step`` (``metrics``: name to number)."""

    def close(self) -> None:
        """Flushes and releases what the writer holds; called once, when `fit` ends."""


NOT_A_WRITER = """\
{api}: writers[{i}] (a {kind}) has no {method} method; give objects with write(step, metrics) \
and close() (rp.training.MetricWriter), e.g. writers=[rp.training.TensorBoardWriter("runs/tb")] or \
writers=[rp.training.WandbWriter(project="my-project")]."""


def check_writers(writers: Any, *, api: str = "rp.fit") -> list:
    """``writers`` as a list, after checking that it is a list of `MetricWriter`s.

    Raises:
      TypeError: naming ``api``, the argument (or its entry) and what it is.
    """
    if writers is None:
        return []
    if not isinstance(writers, list | tuple):
        raise TypeError(
            f"{api}: writers must be a list of writers (rp.training.MetricWriter); got a "
            f"{type(writers).__name__}. Give writers=[writer]."
        )
    for i, writer in enumerate(writers):
        for method in ("write(step, metrics)", "close()"):
            if not callable(getattr(writer, method.partition("(")[0], None)):
                kind = type(writer).__name__
                raise TypeError(NOT_A_WRITER.format(api=api, i=i, kind=kind, method=method))
    return list(writers)


def closes_writers(fn: Callable) -> Callable:
    """Decorates `fit`: its ``writers`` argument is checked before the call (`check_writers`)
    and each writer is closed after it, whether it returns or raises.

    A writer whose ``close`` raises does not keep the others from closing; its error is raised
    afterwards, or, if ``fn`` raised, given as a warning so that ``fn``'s error stays the one
    raised.
    """
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        writers = check_writers(signature.bind_partial(*args, **kwargs).arguments.get("writers"))
        failed = True
        try:
            out = fn(*args, **kwargs)
            failed = False
            return out
        finally:
            _close_all(writers, raise_errors=not failed)

    return wrapper


def _close_all(writers: Sequence, *, raise_errors: bool) -> None:
    error = None
    for writer in writers:
        try:
            writer.close()
        except Exception as e:
            if raise_errors and error is None:
                error = e
            else:
                warnings.warn(f"rp.fit: closing writer {writer!r} failed: {e!r}", stacklevel=4)
    if error is not None:
        raise error


class TensorBoardWriter:
    """Writes the metrics as TensorBoard scalars (tensorboardX) to ``directory``.

    ``LoggingOptions(tensorboard_dir=d)`` is ``LoggingOptions(writers=[TensorBoardWriter(d)])``.
    The event file is created at the first write, so that a writer made on every process of a
    multi-process job leaves files from process 0 only (the one `fit` writes on). Each write is
    flushed. A resumed run writes a new event file into the same directory; TensorBoard shows
    the files of a directory as one run.

    Without tensorboardX installed (``pip install "replicator[tensorboard]"``), it warns when
    made and writes nothing; the other writers and the JSONL file are not affected.

    Args:
      directory: where the event files go (created if needed).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        self._writer = None
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            warnings.warn(
                f"rp.training.TensorBoardWriter: tensorboardX is not installed, so no TensorBoard scalars "
                f"go to {self.directory} (the other writers and metrics_path are not affected). "
                f'pip install "replicator[tensorboard]" to write them.',
                stacklevel=2,
            )
            self._summary_writer = None
        else:
            self._summary_writer = SummaryWriter

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Adds each number of ``metrics`` as the scalar of its name at ``step``, and flushes."""
        if self._summary_writer is None:
            return
        if self._writer is None:
            self._writer = self._summary_writer(self.directory)
        for key, value in metrics.items():
            if isinstance(value, int | float):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        """Closes the event file (if one was written)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


WANDB_MODES = ("offline", "online", "disabled")

NO_WANDB = (
    "rp.training.WandbWriter: wandb is not installed; pip install wandb (or pip install "
    '"replicator[wandb]").'
)


class WandbWriter:
    """Writes the metrics to a Weights & Biases run: offline by default, nothing sent.

    The run starts at the first write (``wandb.init``; `fit` writes on process 0 only, so a
    writer made on every process of a multi-process job starts one run) and finishes at
    ``close`` (``run.finish()``), which `fit` calls when it ends. Each record becomes
    ``run.log(metrics, step=step)``: W&B's step is `fit`'s step, and a step's training and
    evaluation records make one row. In ``mode="offline"`` the run is written to
    ``dir/wandb/offline-run-<time>-<id>/run-<id>.wandb`` and nothing is sent; ``wandb sync``
    that directory later to upload it. ``mode="disabled"`` writes nothing. The run is made with
    ``reinit="create_new"``: a run of your own (``wandb.init()``) stays active and untouched.

    Resuming: each `fit` that writes to it makes a new W&B run (a new id and, offline, a new
    ``offline-run-...`` directory). A resumed `fit` logs from the step after its checkpoint,
    so its run's history starts there; the run before it holds the steps up to where it
    stopped, including any logged after that checkpoint, which the resumed run logs again. To
    go on in one online run instead, give ``id="..."`` and ``resume="allow"``.

    Steps: W&B takes the steps of a run in increasing order and drops, with a warning, a record
    of a step below its current one. This writer skips such records itself, with one warning:
    this happens when a resumed online run (``id``, ``resume``) already holds steps after the
    checkpoint that `fit` restarts from. Those steps keep the values W&B has (the run that
    stopped logged them; a resumed `fit` recomputes the same steps from the same checkpoint and
    input position), and the steps after them are written. The ``metrics_path`` JSONL file
    instead drops its lines after the checkpoint and takes the resumed run's.

    Args:
      project: the W&B project.
      name: the run's display name (default: W&B's own).
      dir: the directory in which W&B makes its ``wandb`` directory (default: ``WANDB_DIR``,
        or the working directory).
      mode: ``"offline"``, ``"online"`` or ``"disabled"``.
      config: the run's configuration (hyperparameters), shown and compared by W&B.
      **init_kwargs: more arguments of ``wandb.init`` (``entity``, ``group``, ``tags``, ``id``,
        ``resume``, ``settings``, ...).

    Raises:
      ImportError: if wandb is not installed (``pip install "replicator[wandb]"``).
      ValueError: if ``project`` is not a non-empty str or ``mode`` is not one of the above.

    Example::

        writer = rp.training.WandbWriter(project="my-project", name="run1", dir="runs/run1")
        rp.fit(repl, step_fn, state, input_fn, steps=1000,
               logging=rp.training.LoggingOptions(writers=[writer]))
        # then, with network: wandb sync runs/run1/wandb/offline-run-*
    """

    def __init__(
        self,
        *,
        project: str,
        name: str | None = None,
        dir: str | os.PathLike | None = None,
        mode: str = "offline",
        config: Mapping[str, Any] | None = None,
        **init_kwargs: Any,
    ) -> None:
        if not isinstance(project, str) or not project.strip():
            raise ValueError(
                f"rp.training.WandbWriter: project must be a non-empty str (the W&B project); got "
                f"{project!r}."
            )
        if mode not in WANDB_MODES:
            raise ValueError(
                f"rp.training.WandbWriter: mode={mode!r} is not one of "
                f"{', '.join(map(repr, WANDB_MODES))}; use mode='offline' to write the run "
                f"here and upload it later with wandb sync."
            )
        try:
            import wandb
        except ImportError as e:
            raise ImportError(NO_WANDB) from e
        self._wandb = wandb
        self._init = {
            "project": project,
            "name": name,
            "dir": None if dir is None else os.fspath(dir),
            "mode": mode,
            "config": None if config is None else dict(config),
            "reinit": "create_new",
            **init_kwargs,
        }
        self._run = None
        self._floor = 0  # W&B's current step: it drops records of lower steps
        self._resumed = self._warned = False

    @property
    def run(self) -> Any:
        """The ``wandb`` run, started if it has not been yet."""
        if self._run is None:
            if self._init["dir"] is not None:
                os.makedirs(self._init["dir"], exist_ok=True)
            self._run = self._wandb.init(**self._init)
            self._floor = self._run.step if self._run.resumed else 0
            self._resumed = bool(self._run.resumed)
        return self._run

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """``run.log(metrics, step=step)``, unless ``step`` is below the run's current step."""
        run = self.run
        if step < self._floor:
            if not self._warned:
                self._warned = True
                which = (
                    "the next step of the resumed W&B run, which holds the steps before it"
                    if self._resumed
                    else "the last step written"
                )
                warnings.warn(
                    f"rp.training.WandbWriter: step {step} is below step {self._floor}, {which}; W&B "
                    f"takes the steps of a run in increasing order only, so the records of "
                    f"steps below {self._floor} are skipped and the later ones are written.",
                    stacklevel=2,
                )
            return
        run.log(dict(metrics), step=step)
        self._floor = step

    def close(self) -> None:
        """Finishes the run (``run.finish()``), if one was started; a later write starts
        another."""
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
