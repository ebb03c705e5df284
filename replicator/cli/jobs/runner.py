"""``replicator train`` and ``explain`` of a config: the devices emulated, the processes joined
(and the job shrunk by an elastic launch), the job built and checked against the replicas,
`rp.fit` with the run's logs, writers and profile, and what it refuses before the first step
raised as a `SetupError`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import jax

import replicator as rp
from replicator.cli import runs
from replicator.cli.config import MAX_CPU_DEVICES, TrainConfig
from replicator.cli.jobs.building import abstract_job, build, builtin_job
from replicator.cli.jobs.gpt_job import check_schedule, pipeline_schedule
from replicator.cli.jobs.pictures import draw_schedule, plot_loss

# What the library raises for a config, a mesh, a run directory or a checkpoint it refuses.
# NotImplementedError: jax's own refusal of a mesh it cannot lay out on a TPU torus
USER_ERRORS = (
    ValueError,
    TypeError,
    FileNotFoundError,
    NotImplementedError,
    rp.training.RunDirLockedError,
)
# What it raises during training that its message says all of (what failed, what to do).
RUN_ERRORS = (rp.CheckpointWriteError,)


class SetupError(Exception):
    """`run` refused the job before its first training step: the config, the mesh, the input's
    batch size, the run directory (locked by another run) or its checkpoint (another state).

    The message is the refusal's; ``__cause__`` is the library's error. The CLI prints it
    without a traceback. A failure after the first step is raised as it is.
    """


def _devices(config: TrainConfig, *, cpu_only: bool) -> None:
    """Emulates ``config``'s CPU devices if JAX has not started yet.

    Emulated CPU devices only change the CPU platform: on a TPU or GPU host ``jax.devices()`` is
    still the accelerators, unless ``cpu_only`` (explain: plan any mesh on this machine's CPU,
    with as many emulated devices as the mesh has, or ``cpu_devices`` if a size is -1). Once JAX
    has started (a JAX computation ran in this process), its devices stay as they are.
    """
    sizes = list(config.mesh.values())
    n = math.prod(sizes) if cpu_only and sizes and min(sizes) > 0 else config.cpu_devices
    if n > MAX_CPU_DEVICES:
        raise ValueError(
            f"mesh {config.mesh} has {n} devices, and explain emulates one CPU device for each "
            f"in this process, at most {MAX_CPU_DEVICES}; explain a mesh of at most "
            f"{MAX_CPU_DEVICES} devices."
        )
    if n:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # JAX has started: "should be updated before backends are ..."
            return
    if cpu_only:
        jax.config.update("jax_platforms", "cpu")


def explain(config: TrainConfig, *, json_path: str | None = None):
    """Compiles the config's training step for its mesh on emulated CPU devices and returns its
    `StepReport` (also written to ``json_path``), without training. A built-in model on its
    built-in data is built from shapes (`abstract_job`): nothing is allocated, so a model too
    big for this machine (configs/llama3_8b.yaml) is explained too."""
    if json_path:
        check_writable(json_path, flag="--json")
    _devices(config, cpu_only=True)
    if builtin_job(config) is not None and config.data.path is None:  # from shapes: a model
        repl, step_fn, state, batch = abstract_job(config)  # too big to build here explains too
        check_batch(config, repl)
    else:  # your own job or data: built, and its first batch read
        repl, step_fn, state, input_fn, _ = _built(config)
        batches = input_fn(repl.input_context())
        batch = next(iter(batches))  # the first global batch (this process's part of it)
        if hasattr(batches, "close"):
            batches.close()
    report = repl.explain(step_fn, state, batch)
    report = dataclasses.replace(report, step=f"{config.name} ({config.model.kind})")
    if json_path:
        with open(json_path, "w") as f:
            f.write(report.to_json() + "\n")
    return report


def run(config: TrainConfig) -> dict:
    """Trains as ``config`` says; returns a summary (first and last loss, steps, seconds).

    Everything the job needs is checked before the run directory is created, and a run refused
    before its first step removes the directory it created: it leaves nothing on disk.

    Raises:
      SetupError: if the library refuses the job before the first step (see `SetupError`).
    """
    config = _joined(config)
    out = os.path.join(config.out_dir, config.name)
    try:
        runs.check_out_dir(config.out_dir, config.name)
        repl, step_fn, state, input_fn, tokens = _built(config)
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
    }
    if config.plot and losses and jax.process_index() == 0:
        plot_loss(losses, os.path.join(out, "loss.png"), config)
    if config.pipeline is not None and "stage" in repl.mesh.shape and jax.process_index() == 0:
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


def _fit(config: TrainConfig, out: str, job: tuple, writers: list):
    """`rp.fit` of the built ``job``; a refusal before its first step is a `SetupError`."""
    repl, step_fn, state, input_fn, tokens = job
    with _first_step(repl) as started:
        try:
            return rp.fit(
                repl,
                step_fn,
                state,
                input_fn,
                steps=config.steps,
                checkpoint_dir=os.path.abspath(os.path.join(out, "checkpoints")),
                checkpoint_every=config.checkpoint_every,
                async_checkpoints=config.async_checkpoints,
                keep=config.keep,
                emergency_after=config.emergency_after,
                start_over_if_unreadable=config.start_over_if_unreadable,
                log_every=config.log_every,
                metrics_path=os.path.join(out, "metrics.jsonl"),
                examples_per_step=config.global_batch,
                tokens_per_step=tokens,
                tensorboard_dir=os.path.join(out, "tensorboard") if config.tensorboard else None,
                profile=_profile(config, out),
                writers=writers,
            )
        except USER_ERRORS as e:
            if started:
                raise  # a failure during training keeps its traceback
            raise SetupError(str(e)) from e


def _built(config: TrainConfig):
    """`build`, with the global batch checked against the replicas and a state too big for
    this machine's memory refused in one line."""
    if builtin_job(config) is not None:  # before the state is built: a mesh is cheap
        repl = rp.Replicator(mesh_shape=dict(config.mesh))
        pipelined = config.model.kind == "gpt" and config.pipeline is not None
        if pipelined and "stage" in repl.mesh.shape:  # the schedule's rules first
            check_schedule(config, pipeline_schedule(config), repl.mesh.shape["stage"])
        check_batch(config, repl)
    try:
        job = build(config)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(
            f"the job's state does not fit in this machine's memory ({str(e).splitlines()[0]}); "
            f"use smaller model sizes (model.d_model, model.layers, model.vocab), or more devices "
            f"with zero_stage=3."
        ) from e
    return job


def check_batch(config: TrainConfig, repl) -> None:
    """Refuses, naming the keys, a ``global_batch`` that does not split over the replicas, or a
    replica's share that does not split into ``accumulate_steps`` (or, in a pipeline,
    ``pipeline.microbatches``) micro-batches: what the built-in jobs' data and step need."""
    if builtin_job(config) is None:  # your own job reads its own batches
        return
    n, b = repl.num_replicas, config.global_batch
    if b % n:
        raise ValueError(
            f"global_batch={b} does not split over the {n} replicas of mesh "
            f"{dict(repl.mesh.shape)} (its data axes); use a multiple of {n} (e.g. "
            f"global_batch={n * math.ceil(b / n)})."
        )
    per = b // n
    key, k = "accumulate_steps", config.accumulate_steps
    if "stage" in repl.mesh.shape and config.pipeline is not None and config.model.kind == "gpt":
        key, k = "pipeline.microbatches", config.pipeline.microbatches
    if per % k:
        unit = n * k
        raise ValueError(
            f"global_batch={b} over {n} replica{'s' * (n > 1)} is {per} examples per replica, "
            f"which do not split into {key}={k} micro-batches; use global_batch a multiple of "
            f"{unit} (e.g. global_batch={unit * math.ceil(b / unit)}), or {key} dividing {per}."
        )


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


def _joined(config: TrainConfig) -> TrainConfig:
    """Joins the job's other processes, if any (under ``replicator launch``, or a cluster JAX
    detects), after setting the emulated devices (unless the launcher sets them); returns
    ``config`` as a job shrunk by ``replicator launch --min-processes`` runs it."""
    if not os.environ.get("REPLICATOR_CPU_DEVICES"):
        _devices(config, cpu_only=False)
    try:
        info = rp.distributed.initialize()
    except RuntimeError as e:
        raise SetupError(str(e)) from e
    if info.elastic_factor == 1:
        return config
    return elastic(config, info.elastic_factor, info.planned_count)


def elastic(config: TrainConfig, factor: int, planned: int) -> TrainConfig:
    """``config`` on ``1 / factor`` of its processes: the data axes shrink by ``factor``, and
    ``elastic_batch: keep`` keeps the global batch in ``factor`` times more micro-batches
    (accumulation, or a pipeline's micro-batches; a CNN, whose BatchNorm takes statistics over
    the whole batch, takes a larger batch per replica instead), ``shrink`` shrinks it.

    >>> c = elastic(TrainConfig(mesh={"data": 8}, accumulate_steps=2), 2, 4)  # doctest: +ELLIPSIS
    replicator train run: on 1/2 of the 4 processes (elastic_batch: keep): ...
    >>> c.mesh, c.accumulate_steps, c.global_batch
    ({'data': 4}, 4, 32)
    """
    mesh, left = dict(config.mesh), factor
    for axis in ("data", "dcn_data"):
        if mesh.get(axis, 0) > 0:
            g = math.gcd(mesh[axis], left)
            mesh[axis], left = mesh[axis] // g, left // g
    if left != 1 and -1 not in mesh.values():
        raise SetupError(
            f"{config.name}: the job runs on 1/{factor} of its {planned} processes (a host is "
            f"lost), and mesh {config.mesh} has no data axis that shrinks by {factor}; use "
            f"mesh.data: -1 (the remaining devices)."
        )
    changes: dict[str, Any] = {"mesh": mesh}
    if config.elastic_batch == "shrink":
        if config.global_batch % factor:
            raise SetupError(
                f"{config.name}: elastic_batch: shrink on 1/{factor} of the processes needs "
                f"global_batch={config.global_batch} to divide by {factor}; use elastic_batch: "
                f"keep, or a global_batch that does."
            )
        changes["global_batch"] = config.global_batch // factor
    elif "stage" in mesh:
        pipeline = config.pipeline
        changes["pipeline"] = dataclasses.replace(
            pipeline, microbatches=pipeline.microbatches * factor
        )
    elif config.model.kind != "cnn":
        changes["accumulate_steps"] = config.accumulate_steps * factor
    print(
        f"replicator train {config.name}: on 1/{factor} of the {planned} processes "
        f"(elastic_batch: {config.elastic_batch}): {changes}",
        flush=True,
    )
    return dataclasses.replace(config, **changes)


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


@contextlib.contextmanager
def _first_step(repl) -> Iterator[list]:
    """A list that becomes non-empty (true) once ``repl.run`` has returned a first time."""
    started: list = []
    run = repl.run

    def counted(*args, **kwargs):
        out = run(*args, **kwargs)
        if not started:
            started.append(True)
        return out

    repl.run = counted
    try:
        yield started
    finally:
        del repl.run
