"""``replicator explain CONFIG``: the config's training step compiled for its mesh on emulated
CPU devices and read (`explain`), without training; and the check of an output file
(`check_writable`)."""

from __future__ import annotations

import dataclasses
import os

from replicator.cli.config import TrainConfig
from replicator.cli.jobs.building import abstract_job, builtin_job, check_batch, checked_build
from replicator.cli.jobs.devices import emulate


def explain(config: TrainConfig, *, json_path: str | None = None):
    """Compiles the config's training step for its mesh on emulated CPU devices and returns its
    `StepReport` (also written to ``json_path``), without training.

    A built-in model on its built-in data is built from shapes (`abstract_job`): nothing is
    allocated, so a model too big for this machine (configs/llama3_8b.yaml) is explained too.
    Your own job, or your own data, is built and its first batch read.

    Raises:
      ValueError: naming the keys, for what the library refuses of the job, or ``--json`` for
        a file that cannot be written.
    """
    if json_path:
        check_writable(json_path, flag="--json")
    emulate(config, cpu_only=True)
    if builtin_job(config) is not None and config.data.path is None:  # from shapes: a model
        repl, step_fn, state, batch = abstract_job(config)  # too big to build here explains too
        check_batch(config, repl)
    else:  # your own job or data: built, and its first batch read
        repl, step_fn, state, input_fn, _ = checked_build(config)
        batches = input_fn(repl.input_context())
        batch = next(iter(batches))  # the first global batch (this process's part of it)
        if hasattr(batches, "close"):
            batches.close()
    report = repl.explain(step_fn, state, batch)
    report = dataclasses.replace(report, step=f"{config.name} ({config.model.label})")
    if json_path:
        with open(json_path, "w") as f:
            f.write(report.to_json() + "\n")
    return report


def check_writable(path: str, *, flag: str) -> None:
    """Refuses, naming ``flag``, an output file that cannot be written: a directory, or one in
    a directory that does not exist (or is not writable); nothing is created."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "is a directory"
    elif not os.path.isdir(folder):
        problem = f"is in {folder}, which is not a directory"
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = f"is in {folder}, which is not writable"
    else:
        return
    raise ValueError(f"{flag} {path} {problem}; give the path of a file to write, e.g. {flag} "
                     f"report.json in an existing directory.")  # fmt: skip
