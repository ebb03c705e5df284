"""What `fit` shows and writes besides the state: its `Report`.

A progress bar on a terminal (or in Jupyter) or a line per log, the metrics as JSONL lines and
to the run's writers (TensorBoard, W&B, your own), notices and the summary at the end, on
process 0. `drop_lines_after` keeps a resumed run's JSONL file to one line per step.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Sequence

import jax

from replicator._src.training.checkpoint import Checkpoints
from replicator._src.training.writers import MetricWriter, TensorBoardWriter


def drop_lines_after(path: str | os.PathLike, step: int) -> None:
    """Rewrites the JSONL file ``path`` without the lines of steps after ``step`` (logged by a
    run that stopped after its last checkpoint, and about to be logged again) and without a
    line cut short by a kill: through a new file and a rename, so that a kill meanwhile
    leaves the old file or the new one. Process 0 alone, which alone writes it."""
    if jax.process_index() != 0:
        return
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


def notice(text: str) -> None:
    """A line on stderr on process 0, whether or not ``progress`` is on."""
    if jax.process_index() == 0:
        print(text, file=sys.stderr, flush=True)


class Report:
    """The run's outputs besides the state: progress bar or lines, JSONL, writers, summary.

    ``writers`` (checked by `writers.check_writers`) are written to on process 0 and closed by
    their owner (`fit`); the `TensorBoardWriter` of ``tensorboard_dir`` is the report's own.
    """

    def __init__(
        self,
        steps,
        start,
        progress,
        metrics_path,
        tensorboard_dir,
        examples,
        tokens,
        *,
        writers: Sequence[MetricWriter] = (),
    ) -> None:
        self.steps, self.start = steps, start
        self.history: list[dict] = []
        self._show = progress and jax.process_index() == 0
        self._examples, self._tokens = examples, tokens
        self._t_start = self._t_log = time.perf_counter()
        self._last_log_step = start
        first = jax.process_index() == 0  # one process writes the run's files
        self._jsonl = open(metrics_path, "a") if metrics_path is not None and first else None
        self._tb = _tensorboard(tensorboard_dir) if first else None
        self._writers = [*([self._tb] if self._tb else []), *writers] if first else []
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
        for writer in self._writers:
            writer.write(step, {k: v for k, v in record.items() if k != "step"})
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
            notice(text)

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


def _tensorboard(directory) -> TensorBoardWriter | None:
    if directory is None:
        return None
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        warnings.warn(
            "rp.fit: tensorboard_dir is set but tensorboardX is not installed; no TensorBoard "
            "scalars are written (metrics_path and the writers are not affected). pip install "
            '"replicator[tensorboard]" to write them.',
            stacklevel=3,
        )
        return None
    return TensorBoardWriter(directory)


def _line(metrics: dict, steps: int) -> str:
    parts = [f"step {metrics['step']:>6}/{steps}"]
    for key, value in metrics.items():
        if key != "step":
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return "  ".join(parts)
