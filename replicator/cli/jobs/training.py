"""``replicator train CONFIG``: the processes joined, the job built and checked against the
replicas, `rp.fit` with the run's checkpoints, logs, writers and profile, and its pictures; what
is refused before the first training step is raised as a `SetupError` (`run`)."""

from __future__ import annotations

import dataclasses
import os
import time

import jax

import replicator as rp
from replicator.cli import runs
from replicator.cli.config import TrainConfig
from replicator.cli.jobs.building import checked_build
from replicator.cli.jobs.memory import check_memory
from replicator.cli.jobs.pictures import draw_schedule, plot_loss
from replicator.cli.jobs.processes import joined
from replicator.cli.jobs.refusals import USER_ERRORS, SetupError


def run(config: TrainConfig) -> dict:
    """Trains as ``config`` says; returns a summary (first and last loss, steps, seconds).

    Everything the job needs is checked before the run directory is created, and a run refused
    before its first step removes the directory it created: it leaves nothing on disk.

    Raises:
      SetupError: if the library refuses the job before the first step (see `SetupError`).
    """
    config, processes_here = joined(config)
    out = os.path.join(config.out_dir, config.name)
    try:
        runs.check_out_dir(config.out_dir, config.name)
        check_memory(config, processes=processes_here)  # from shapes, before any allocation
        repl, step_fn, state, input_fn, tokens = checked_build(config)
        created = runs.make(out, config.out_dir)
    except (*USER_ERRORS, OSError) as e:
        raise SetupError(str(e)) from e
    first = jax.process_index() == 0
    try:
        try:
            writers = _writers(config, out)
            if first:
                runs.note_init_from(config.init_from, out, config.name)
        except OSError as e:
            raise SetupError(str(e)) from e
        print(
            f"replicator train {config.name}: {repl} on {runs.machine(jax.devices())}", flush=True
        )
        t0 = time.perf_counter()
        result = _fit(config, out, (repl, step_fn, state, input_fn, tokens), writers)
    except SetupError:
        if first:  # refused before its first step: nothing of this run stays on disk
            runs.remove(created)
        raise
    seconds = time.perf_counter() - t0
    losses = [(h["step"], h["loss"]) for h in result.history if "loss" in h]
    summary = {
        "steps": result.step,
        "seconds": seconds,
        "first_loss": losses[0][1] if losses else None,
        "last_loss": losses[-1][1] if losses else None,
        "preempted": result.preempted,
        "stopped_by": result.stopped_by,  # "SIGTERM", "SIGINT in process 1", or ""
        # the run was at ``steps`` already: no step ran, nothing was written
        "nothing_to_do": not result.preempted and result.resumed_from == result.step,
    }
    if config.plot and losses and first:  # the whole run's, from its first step
        plot_loss(os.path.join(out, "metrics.jsonl"), os.path.join(out, "loss.png"), config)
    if config.pipeline is not None and "stage" in repl.mesh.shape and first:
        draw_schedule(config, repl.mesh.shape["stage"], out)
    if losses:
        done = (
            f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, {result.step} steps"
        )
    else:  # e.g. the run was complete already: no step ran, nothing was logged
        done = f"no step to run, the run is at step {result.step} of {config.steps}"
    print(
        f"replicator train {config.name}: {done} in {seconds:.1f} s; outputs in {out}", flush=True
    )
    return summary


class _Started:
    """`rp.fit`'s ``on_step``: whether a training step has run, so that a failure before the
    first one is told apart from one during the run."""

    def __init__(self) -> None:
        self.ran = False

    def __call__(self, step: int) -> None:
        self.ran = True


def _fit(config: TrainConfig, out: str, job: tuple, writers: list):
    """`rp.fit` of the built ``job``; a refusal before its first step is a `SetupError`."""
    repl, step_fn, state, input_fn, tokens = job
    started = _Started()
    try:
        checkpointing = rp.training.CheckpointOptions(
            os.path.abspath(os.path.join(out, "checkpoints")),
            every=config.checkpoint_every,
            keep=config.keep,
            async_save=config.async_checkpoints,
            emergency_after=config.emergency_after,
            start_over_if_unreadable=config.start_over_if_unreadable,
        )
        logging = rp.training.LoggingOptions(
            every=config.log_every,
            first_step=True,  # the loss curve starts where training does
            metrics_path=os.path.join(out, "metrics.jsonl"),
            tensorboard_dir=os.path.join(out, "tensorboard") if config.tensorboard else None,
            writers=writers,
            examples_per_step=config.global_batch,
            tokens_per_step=tokens,
            profile=_profile(config, out),
        )
        return rp.fit(repl, step_fn, state, input_fn, steps=config.steps,
                      checkpointing=checkpointing, logging=logging, on_step=started)  # fmt: skip
    except USER_ERRORS as e:
        if started.ran:
            raise  # a failure during training keeps its traceback
        raise SetupError(str(e)) from e


def _profile(config: TrainConfig, out: str) -> rp.training.Profile | None:
    p = config.profile
    if p is None:
        return None
    return rp.training.Profile(
        os.path.join(out, "profile"), start_step=p.start_step, num_steps=p.num_steps
    )


def _writers(config: TrainConfig, out: str) -> list:
    """The run's metric writers besides TensorBoard: a W&B run in ``out/wandb`` (``wandb:``).

    Raises:
      SetupError: if wandb is not installed.
    """
    w = config.wandb
    if w is None:
        return []
    try:
        writer = rp.training.WandbWriter(
            project=w.project or config.name,
            name=w.name or config.name,
            dir=out,
            mode=w.mode,
            config=dataclasses.asdict(config),
        )
    except ImportError as e:
        raise SetupError(f"wandb: {e}") from e
    return [writer]
