"""The training loop: `fit` drives ``repl.run`` over ``repl.distribute(input_fn)``.

It logs metrics (a progress line, and JSONL), evaluates now and then, checkpoints every
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
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from replicator._src.checkpoint import Checkpoints
from replicator._src.context import Replicator, local_row
from replicator._src.typing import PyTree, StepFn


@dataclasses.dataclass
class FitResult:
    """What `fit` returns: the final state and what happened."""

    state: PyTree
    step: int  # the number of steps done, over all runs of this checkpoint directory
    history: list[dict]  # the logged metrics of this run
    preempted: bool  # stopped by SIGTERM/SIGINT, after saving a checkpoint
    resumed_from: int | None  # the checkpoint step this run started from


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

    plus logging, evaluation and checkpoints. ``input_fn`` must be deterministic: on resume the
    batches before the checkpointed position are skipped.

    Args:
      repl, step_fn, state, input_fn: as for ``repl.run`` and ``repl.distribute``; ``state``
        is the initial state (placed), also the template that checkpoints restore into.
      steps: the total number of steps of the run (resumed runs count from where they were).
      checkpoint_dir: where checkpoints go; None: no checkpoints, no resume.
      checkpoint_every: save every this many steps (and at the end, and on SIGTERM/SIGINT).
      keep: checkpoints to keep.
      log_every: steps between metric logs (each log reads the outputs: a host sync).
      metrics_path: a JSONL file that gets one line per log and per evaluation (appended, so a
        resumed run continues it).
      eval_fn: ``eval_fn(state) -> dict`` of numbers, called every ``eval_every`` steps.
      examples_per_step: the global batch size, for the examples/s figure.
      tokens_per_step: tokens per global batch, for the tokens/s figure of language models.
      progress: print a progress line per log to stderr.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"rp.fit: steps must be an int >= 1; got {steps!r}.")
    for name, value in (("checkpoint_every", checkpoint_every), ("eval_every", eval_every)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"rp.fit: {name} must be an int >= 1 or None; got {value!r}.")
    ckpt = Checkpoints(checkpoint_dir, keep=keep) if checkpoint_dir is not None else None
    start, resumed_from = 0, None
    if ckpt is not None and ckpt.latest_step() is not None:
        state, record = ckpt.restore(state)
        start = resumed_from = int(record["step"])
        _say(progress, f"rp.fit: resumed from the checkpoint of step {start} in {ckpt.directory}")
    history: list[dict] = []
    log = open(metrics_path, "a") if metrics_path is not None else None
    step, preempted = start, False
    stop = _StopFlag()
    t0, last_log_step = time.perf_counter(), start
    try:
        with stop.installed(), repl.distribute(input_fn, skip=start) as batches:
            for batch in batches:
                if step >= steps:
                    break
                state, outputs = repl.run(step_fn, state, batch)
                step += 1
                if step % log_every == 0 or step == steps:
                    metrics = _numbers(local_row(outputs))
                    now = time.perf_counter()
                    rate = (step - last_log_step) / max(now - t0, 1e-9)
                    metrics["step"], metrics["steps_per_s"] = step, rate
                    if examples_per_step:
                        metrics["examples_per_s"] = rate * examples_per_step
                    if tokens_per_step:
                        metrics["tokens_per_s"] = rate * tokens_per_step
                    t0, last_log_step = now, step
                    history.append(metrics)
                    _write(log, metrics)
                    _say(progress, _line(metrics, steps))
                if eval_fn is not None and eval_every and step % eval_every == 0:
                    result = {
                        "step": step,
                        **{f"eval_{k}": v for k, v in _numbers(eval_fn(state)).items()},
                    }
                    history.append(result)
                    _write(log, result)
                    _say(progress, _line(result, steps))
                if ckpt is not None and checkpoint_every and step % checkpoint_every == 0:
                    ckpt.save(step, state, data_position=step)
                if stop.requested:
                    preempted = True
                    break
        if ckpt is not None and (preempted or step >= steps) and ckpt.latest_step() != step:
            ckpt.save(step, state, data_position=step)
        if preempted:
            _say(
                progress, f"rp.fit: stopped by {stop.signal_name} at step {step}; checkpoint saved"
            )
    finally:
        if log is not None:
            log.close()
    return FitResult(state, step, history, preempted, resumed_from)


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


def _write(log, record: dict) -> None:
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()


def _line(metrics: dict, steps: int) -> str:
    parts = [f"step {metrics['step']:>6}/{steps}"]
    for key, value in metrics.items():
        if key != "step":
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return "  ".join(parts)


def _say(enabled: bool, text: str) -> None:
    if enabled and jax.process_index() == 0:
        print(text, file=sys.stderr, flush=True)
