"""The jobs behind ``replicator train CONFIG``: a config becomes a model, an input_fn, a step_fn
and a `rp.fit` run, with metrics, checkpoints and pictures in ``out_dir/name``; or, for planning,
the same step_fn with its state and batch as shapes (`abstract_job`), allocating nothing.

Built on the public API only (``replicator``, ``replicator.models``). The config is checked
before it gets here (`replicator.cli.config`); what is refused here is what only the library can
see: the mesh against the devices, the batch against the replicas, the run directory, the
checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import replicator as rp
from replicator.cli import data as data_lib
from replicator.cli import optimizers, runs
from replicator.cli.config import MAX_CPU_DEVICES, MODEL_KINDS, ModelConfig, TrainConfig
from replicator.models import cnn, gpt, hf, llama, mlp

# What the library raises for a config, a mesh, a run directory or a checkpoint it refuses.
# NotImplementedError: jax's own refusal of a mesh it cannot lay out on a TPU torus
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotImplementedError, rp.RunDirLockedError)
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


class _Job(NamedTuple):
    """A built-in job before its state exists: what `build` and `abstract_job` share."""

    step_fn: Callable  # step_fn(state, batch) -> (state, metrics), one replica's step
    init: Callable[[], Any]  # builds the state: arrays when called, shapes under repl.abstract
    input_fn: Callable  # the kind's own data; reads nothing until it is iterated
    batch: Callable[[], dict]  # the global batch, as jax.ShapeDtypeStruct leaves
    tokens: int | None  # tokens per step, for the metrics
    vocab: int | None  # token ids below it (checked in data.path's examples)


def _builtin(config: TrainConfig):
    """The built-in job function of ``config.model.kind`` (`_gpt`, `_mlp`, `_cnn`), or None."""
    return {"gpt": _gpt, "mlp": _mlp, "cnn": _cnn}.get(config.model.kind)


def _tx_maker(config: TrainConfig) -> Callable:
    def make_tx(params):  # the weight-decay mask is decided from the whole parameters' shapes
        return optimizers.make_optimizer(config.optimizer, steps=config.steps, params=params)[0]

    return make_tx


def build(config: TrainConfig):
    """The job a config describes: ``(repl, step_fn, state, input_fn, tokens_per_step)``."""
    kind = config.model.kind
    builtin = _builtin(config)
    own = None if builtin else own_model(kind)  # imports first
    repl = rp.Replicator(mesh_shape=dict(config.mesh))
    make_tx = _tx_maker(config)
    if builtin is not None:
        job = builtin(config, repl, make_tx)
        input_fn = _own_data(config, job.input_fn, vocab=job.vocab)  # checked before the state
        step_fn, state, tokens = job.step_fn, job.init(), job.tokens
    else:  # its parameters are not known before it runs: the mask is decided on them
        step_fn, state, input_fn, tokens = own(config, repl, make_tx(None))
    step_fn, state = _rate_and_ema(repl, step_fn, state, config, make=lambda init: init())
    return repl, step_fn, state, input_fn, tokens


def abstract_job(config: TrainConfig, *, devices: list | None = None):
    """The job a config describes, built from shapes: ``(repl, step_fn, state, batch)``.

    The same code as `build` (the job's one init function runs under ``repl.abstract``), so
    nothing is allocated and no data is read: a model too big for this machine can be planned
    with ``repl.explain(step_fn, state, batch)``, whose report equals that of `build`'s state.
    The mesh must fit ``jax.devices()`` (emulate CPU devices before JAX starts, as `explain`
    does).

    Args:
      config: a built-in model kind's config.
      devices: the mesh's devices (default ``jax.devices()``), e.g. a TPU target's
        (``rp.tpu_devices("v5p-16")``) to compile for it on any machine.

    Returns:
      ``state`` is `build`'s state (with its ``"step"`` and ``"ema"`` entries) as
      ``jax.ShapeDtypeStruct`` leaves with their shardings, and ``batch`` the global batch as
      ``jax.ShapeDtypeStruct`` leaves (the built-in data's shapes, which ``data.path``'s
      examples must have).

    Raises:
      ValueError: for your own ``module:function`` job (it builds its state itself), or what
        `build` refuses of the mesh and the model.
    """
    builtin = _builtin(config)
    if builtin is None:
        raise ValueError(
            f"abstract_job: model.kind={config.model.kind!r} is your own job, which builds its "
            f"state itself; only the built-in kinds ({', '.join(map(repr, MODEL_KINDS))}) "
            f"build from shapes. Use jobs.explain(config), which builds the state."
        )
    repl = rp.Replicator(mesh_shape=dict(config.mesh), devices=devices)
    job = builtin(config, repl, _tx_maker(config))
    state = repl.abstract(job.init)
    step_fn, state = _rate_and_ema(repl, job.step_fn, state, config, make=repl.abstract)
    return repl, step_fn, state, job.batch()


def _rate_and_ema(repl, step_fn, state, config: TrainConfig, *, make: Callable):
    """``step_fn`` that also returns the step's learning rate as the ``learning_rate`` metric,
    from a step counter kept in the state (``state["step"]``, saved with it), and with
    ``ema_decay`` keeps ``state["ema"] = d * ema + (1 - d) * params`` after each update (element
    by element: exact under ZeRO, sharded as the parameters are, and checkpointed).

    ``state`` is the job's, as arrays or as shapes; ``make`` builds the added state the same
    way: ``make(init)`` calls ``init``, or is ``repl.abstract``."""
    schedule = optimizers.schedule_fn(config.optimizer, steps=config.steps)
    ema_decay = config.optimizer.ema_decay
    if ema_decay is not None and not (isinstance(state, dict) and "params" in state):
        raise ValueError(
            "optimizer.ema_decay: the job's state has no 'params' entry to average; return a "
            "state dict with the parameters under 'params', or drop ema_decay."
        )

    def with_rate(full, batch):
        inner, metrics = step_fn(full["job"], batch)
        new = {"job": inner, "step": full["step"] + 1}
        if ema_decay is not None:
            new["ema"] = jax.tree.map(
                lambda e, p: ema_decay * e + (1 - ema_decay) * p, full["ema"], inner["params"]
            )
        return new, {**metrics, "learning_rate": schedule(full["step"])}

    full = {"job": state, "step": make(lambda: repl.replicate(jnp.zeros((), jnp.int32)))}
    if ema_decay is not None:  # a copy of the parameters, with their shardings (or shapes)
        full["ema"] = jax.tree.map(_copy, state["params"])
    return with_rate, full


def _copy(x):
    return x if isinstance(x, jax.ShapeDtypeStruct) else jnp.copy(x)


def own_model(kind: str):
    """The job function that ``model.kind: "module:function"`` names, imported from the working
    directory or the Python path.

    ``function(config, repl, tx)`` receives the `TrainConfig`, the `rp.Replicator` built from
    ``mesh`` and the optax transformation of the ``optimizer`` keys (to wrap with
    ``repl.wrap_optimizer``; its weight-decay mask is decided by `optimizers.decay_mask` on the
    parameters it is given; the peak rate is ``config.optimizer.learning_rate``), and returns
    ``(step_fn, state, input_fn, tokens_per_step)`` as the built-in jobs do (``tokens_per_step``
    may be None); ``rp.fit`` then trains it with the config's steps, checkpoints and logs.

    Raises:
      ValueError: if the module cannot be imported or has no such function.
    """
    module_name, _, name = kind.partition(":")
    if os.getcwd() not in sys.path:  # the `replicator` script's path starts at its own directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"model.kind={kind!r}: cannot import {module_name} ({type(e).__name__}: {e}); run "
            f"from the directory that holds it, or add it to PYTHONPATH."
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"model.kind={kind!r}: {module_name} has no function {name}.")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:  # the wrong function: say so, rather than its TypeError when called
        raise ValueError(
            f"model.kind={kind!r}: {name} must take (config, repl, tx), and its signature is "
            f"{inspect.signature(fn)}; name your job function (see jobs.own_model)."
        ) from None
    except ValueError:  # a builtin without a signature: called as it is
        pass

    def job(config, repl, tx):
        out = fn(config, repl, tx)
        if not isinstance(out, tuple) or len(out) != 4:
            raise ValueError(
                f"model.kind={kind!r}: {name}(config, repl, tx) must return (step_fn, state, "
                f"input_fn, tokens_per_step); got {type(out).__name__}."
            )
        return out

    return job


def explain(config: TrainConfig, *, json_path: str | None = None):
    """Compiles the config's training step for its mesh on emulated CPU devices and returns its
    `StepReport` (also written to ``json_path``), without training. A built-in model on its
    built-in data is built from shapes (`abstract_job`): nothing is allocated, so a model too
    big for this machine (configs/llama3_8b.yaml) is explained too."""
    if json_path:
        check_writable(json_path, flag="--json")
    _devices(config, cpu_only=True)
    if _builtin(config) is not None and config.data.path is None:  # from shapes: a model
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
        _plot(losses, os.path.join(out, "loss.png"), config)
    if config.pipeline is not None and "stage" in repl.mesh.shape and jax.process_index() == 0:
        _draw_schedule(config, repl.mesh.shape["stage"], out)
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
    if _builtin(config) is not None:  # before the state is built: a mesh is cheap
        repl = rp.Replicator(mesh_shape=dict(config.mesh))
        pipelined = config.model.kind == "gpt" and config.pipeline is not None
        if pipelined and "stage" in repl.mesh.shape:  # the schedule's rules first
            _check_schedule(config, _schedule(config), repl.mesh.shape["stage"])
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
    if _builtin(config) is None:  # your own job reads its own batches
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


def _sliced(make: Callable[[int], Iterator[dict]], ctx, global_batch: int) -> Iterator[dict]:
    """This input pipeline's rows of the global batches ``make(global_batch)`` yields: the data
    does not depend on how many processes read it (a job resized by the launcher sees the same
    batches)."""
    per = ctx.per_pipeline_batch_size(global_batch)
    lo = ctx.input_pipeline_id * per
    for batch in make(global_batch):
        yield {k: v[lo : lo + per] for k, v in batch.items()}


def _profile(config: TrainConfig, out: str) -> rp.Profile | None:
    p = config.profile
    if p is None:
        return None
    return rp.Profile(os.path.join(out, "profile"), start_step=p.start_step, num_steps=p.num_steps)


def _writers(config: TrainConfig, out: str) -> list:
    """The run's metric writers besides TensorBoard: a W&B run in ``out/wandb`` (``wandb:``).

    Raises:
      SetupError: if wandb is not installed.
    """
    w = config.wandb
    if w is None:
        return []
    try:
        writer = rp.WandbWriter(
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


def _schedule(config: TrainConfig):
    """The ``pipeline:`` section's schedule; ``repeats`` is read by circular and interleaved."""
    p = config.pipeline
    if p.schedule == "circular":
        return rp.pipeline.Circular(repeats=p.repeats)
    if p.schedule == "interleaved":
        return rp.pipeline.Interleaved1F1B(repeats=p.repeats)
    return {
        "gpipe": rp.pipeline.GPipe(),
        "1f1b": rp.pipeline.OneFOneB(),
        "zerobubble": rp.pipeline.ZeroBubble(),
    }[p.schedule]


def _check_schedule(config: TrainConfig, schedule, num_stages: int) -> None:
    """Refuses, before anything is traced, micro-batches that the schedule cannot run on
    ``num_stages`` stages (1F1B, ZeroBubble, circular: M >= K; interleaved: M a multiple of K):
    the library's message, then the config keys to change."""
    p = config.pipeline
    try:
        schedule.plan(num_stages, p.microbatches)  # NumPy tick tables: the schedule's own rules
    except ValueError as e:
        raise ValueError(
            f"{e} In the config: pipeline.microbatches={p.microbatches} with mesh.stage="
            f"{num_stages} and pipeline.schedule={p.schedule}."
        ) from e


def model_flops(cfg: TrainConfig) -> float | None:
    """The model's training FLOPs per step (for the MFU), for the GPT; None for the others."""
    if cfg.model.kind != "gpt":
        return None
    return gpt.flops_per_token(gpt_config(cfg)) * cfg.global_batch * cfg.model.seq_len


def gpt_config(config: TrainConfig) -> gpt.GPTConfig:
    """The `gpt.GPTConfig` of a ``kind: gpt`` config's ``model:`` section."""
    m = config.model
    options = dict(
        seq_len=m.seq_len,
        dtype=jnp.dtype(m.dtype),
        remat=m.remat,
        attention=m.attention,
        zigzag=m.zigzag,
        scan_layers=m.scan_layers,
        reduce_dtype=m.reduce_dtype,
        num_experts=m.experts,
        moe_every=m.moe_every,
        top_k=m.top_k,
        capacity_factor=m.capacity_factor,
        aux_weight=m.aux_weight,
    )
    if config.init_from is not None:  # the checkpoint's sizes, rotary scaling and experts
        return llama.from_hf_config(hf.read_config(config.init_from), **_own(m, options))
    if m.family == "llama":
        return llama.config(
            vocab_size=m.vocab,
            d_model=m.d_model,
            num_layers=m.layers,
            num_heads=m.heads,
            d_ff=m.d_ff or 4 * m.d_model,
            num_kv_heads=m.kv_heads,
            rope_theta=m.rope_theta,
            norm_eps=m.norm_eps,
            tie_embeddings=m.tie_embeddings,
            **options,
        )
    sizes = dict(vocab_size=m.vocab, d_model=m.d_model, num_heads=m.heads, num_layers=m.layers)
    return gpt.GPTConfig(**sizes, d_ff=m.d_ff, **options)


def _own(m, options: dict) -> dict:
    """``options`` without what a checkpoint sets: its experts, and a Mixtral's dropless
    routing without load-balancing loss unless the config sets ``capacity_factor`` or
    ``aux_weight``."""
    defaults, out = ModelConfig(), dict(options)
    for key in ("num_experts", "top_k"):
        out.pop(key)
    for key in ("capacity_factor", "aux_weight"):
        if getattr(m, key) == getattr(defaults, key):
            out.pop(key)
    return out


def _gpt(config: TrainConfig, repl, make_tx) -> _Job:
    """The GPT on any mesh a config can give: data parallel (ZeRO 0-3, accumulation), tensor
    parallel over ``model``, the sequence over ``context``, the experts of a mixture of experts
    over ``expert``, and pipelined over ``stage`` (ZeRO 0-3, with ``model`` and ``context``)."""
    m, model = config.model, gpt_config(config)
    init_params = lambda: gpt.init(model, jax.random.key(0))
    text = functools.cache(lambda: gpt.stdlib_text(2_000_000))  # read when first iterated

    def input_fn(ctx):
        make = lambda n: gpt.token_batches(text(), batch_size=n, seq_len=m.seq_len, seed=0)
        yield from _sliced(make, ctx, config.global_batch)

    def batch():
        shape = jax.ShapeDtypeStruct((config.global_batch, m.seq_len), jnp.int32)
        return {"tokens": shape, "targets": shape}

    tokens, zero3 = config.global_batch * m.seq_len, config.zero_stage == 3
    if "stage" not in repl.mesh.shape:
        opt = repl.wrap_optimizer(
            make_tx(jax.eval_shape(init_params)),
            zero_stage=config.zero_stage,
            accumulate_steps=config.accumulate_steps,
            clip_global_norm=config.clip_global_norm,
        )
        loss_fn = lambda p, b: gpt.loss(p, b["tokens"], b["targets"], config=model)

        def step_fn(state, batch):
            p, o, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
            return {"params": p, "opt": o}, metrics

        if model.num_experts:
            step_fn = _moe_step(model, opt, config.accumulate_steps)

        def init():
            rules = _rules(config, repl, model)  # heads, MLP (and the vocabulary): "model"

            def place():  # ZeRO-3: split over the replicas, each block's layer gathered alone
                placed = gpt.place(repl, init_params(), config=model, rules=rules)
                stacked, split = gpt.zero_stacked(model), gpt.zero_split(model)
                return opt.shard_params(placed, stacked=stacked, split=split) if zero3 else placed

            placed = _from_checkpoint(config, repl, place) if config.init_from else place()
            return {"params": placed, "opt": opt.init(placed)}

        return _Job(step_fn, init, input_fn, batch, tokens, m.vocab)

    schedule = _schedule(config)  # the config has a pipeline: section with a stage axis
    k, v = repl.mesh.shape["stage"], schedule.repeats
    _check_schedule(config, schedule, k)
    grad_fn = gpt.pipeline_value_and_grad(
        model,
        num_microbatches=config.pipeline.microbatches,
        schedule=schedule,
        remat=m.remat,
        scatter_grads=config.pipeline.scatter_grads,
    )
    staged = lambda: gpt.pipeline_params(init_params(), num_stages=k, repeats=v)
    # The stage blocks [V, K, L/(V K), ...] are split over "stage"; ZeRO shards their state
    # (and with zero_stage=3 the blocks themselves, layer by layer) over the replicas too.
    tx = repl.wrap_optimizer(
        make_tx(jax.eval_shape(staged)),
        zero_stage=config.zero_stage,
        clip_global_norm=config.clip_global_norm,
    )

    def pipeline_step_fn(state, batch):
        loss, grads = grad_fn(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    def pipeline_init():
        def place():
            placed = gpt.place_pipeline(
                repl, init_params(), num_stages=k, repeats=v, config=model,
                rules=_rules(config, repl, model),
            )  # fmt: skip
            return tx.shard_params(placed) if zero3 else placed

        placed = _from_checkpoint(config, repl, place) if config.init_from else place()
        return {"params": placed, "opt": tx.init(placed)}

    return _Job(pipeline_step_fn, pipeline_init, input_fn, batch, tokens, m.vocab)


def _rules(config: TrainConfig, repl, model: gpt.GPTConfig) -> dict:
    """Megatron's layout (`gpt.MEGATRON_RULES`), with the vocabulary over ``model`` too when
    ``model.vocab_parallel`` and it divides by the axis (on a mesh without ``context`` and
    ``expert`` axes):
    each device then computes its share of the logits rather than all of them."""
    shape = dict(repl.mesh.shape)
    t = shape.get("model", 1)
    split = config.model.vocab_parallel and t > 1 and model.vocab_size % t == 0
    # XLA's SPMD partitioner aborts (a check failure: ExpandDeviceGroupsWithIota with jax
    # 0.10.2, spmd_partitioner_util.cc with jax 0.12) on the vocabulary over `model` with the
    # tokens over `data` and `context` (or `expert`).
    split = split and shape.get("expert", 1) == shape.get("context", 1) == 1
    return {**gpt.MEGATRON_RULES, "vocab": "model"} if split else dict(gpt.MEGATRON_RULES)


def _from_checkpoint(config: TrainConfig, repl, place: Callable[[], dict]) -> dict:
    """The parameters of ``config.init_from`` (a Hugging Face Llama), placed as ``place()``
    places fresh ones (under ZeRO-3, its parts: no device ever holds a whole weight it does
    not keep): each process reads only the slices its devices hold. Under
    ``repl.abstract`` (explain, plan) nothing is read: the shapes are those of ``place``."""
    if isinstance(jnp.zeros(()), jax.core.Tracer):  # under repl.abstract: shapes only
        return place()
    return hf.load(config.init_from, repl.abstract(place))


def _moe_step(model: gpt.GPTConfig, opt, accumulate_steps: int) -> Callable:
    """The mixture-of-experts GPT's ``step_fn``: `DistributedOptimizer.step`'s update, and
    what the routing did: ``loss`` (the mean over replicas of the loss optimized, cross-entropy
    plus ``aux_weight`` x ``aux_loss``, as ``opt.step`` logs it), ``cross_entropy``,
    ``aux_loss`` (the load-balancing loss, mean over sequences and MoE blocks) and
    ``dropped_fraction`` (token-choices over capacity / all token-choices, over the whole
    global batch). ``opt.step`` takes a scalar loss only, so the gradients are taken here
    (``has_aux``), with ``accumulate_steps`` micro-batches summed in a ``lax.scan`` as
    ``opt.step`` does, and reduced by ``opt.update``; ``grad_norm`` is not reported."""

    def loss_and_stats(params, batch):
        return gpt.loss_and_stats(params, batch["tokens"], batch["targets"], config=model)

    grad_fn = jax.value_and_grad(loss_and_stats, has_aux=True)

    def step_fn(state, batch):
        params = state["params"]
        if accumulate_steps == 1:
            (loss, stats), grads = grad_fn(params, batch)
        else:  # the mean of the micro-batches' losses and gradients, the sums of their counts
            micro = jax.tree.map(lambda a: a.reshape(accumulate_steps, -1, *a.shape[1:]), batch)

            def add(total, mb):
                return jax.tree.map(jnp.add, total, grad_fn(params, mb)), None

            zeros = jax.tree.map(
                jnp.zeros_like,
                jax.eval_shape(grad_fn, params, jax.tree.map(lambda a: a[0], micro)),
            )
            (loss, stats), grads = jax.lax.scan(add, zeros, micro)[0]
            mean = lambda a: a / accumulate_steps
            loss, grads = mean(loss), jax.tree.map(mean, grads)
            stats |= {k: mean(stats[k]) for k in ("cross_entropy", "aux_loss")}  # counts: sums
        updates, opt_state = opt.update(grads, state["opt"], params)
        params = optax.apply_updates(params, updates)
        means = {"loss": loss} | {k: stats[k] for k in ("cross_entropy", "aux_loss")}
        counts = rp.all_reduce({k: stats[k] for k in ("dropped", "routed")}, "sum")
        metrics = rp.all_reduce(means, "mean") | {
            "dropped_fraction": counts["dropped"] / jnp.maximum(counts["routed"], 1)
        }
        return {"params": params, "opt": opt_state}, metrics

    return step_fn


def _mlp(config: TrainConfig, repl, make_tx) -> _Job:
    m = config.model

    def init_params():  # host arrays (the model is small)
        rng = np.random.default_rng(0)
        normal = lambda *shape, div: (rng.normal(size=shape) / div).astype(np.float32)
        embed = {"w": normal(16, m.d_model, div=4)}  # drawn in this order
        w = normal(m.layers, m.d_model, m.d_model, div=np.sqrt(m.d_model))
        layers = {"w": w, "b": np.zeros((m.layers, m.d_model), np.float32)}
        head = {"w": normal(m.d_model, 1, div=np.sqrt(m.d_model))}
        return {"embed": embed, "layers": layers, "head": head}

    @jax.checkpoint
    def layer(h, p):
        p = rp.gather_params(p)  # ZeRO-3: one layer's parameters at a time
        return h + jnp.tanh(h @ p["w"] + p["b"]), None

    def loss_fn(p, batch):
        h = batch["x"] @ rp.gather_params(p["embed"])["w"]
        h, _ = jax.lax.scan(layer, h, p["layers"])
        return jnp.mean((h @ rp.gather_params(p["head"])["w"] - batch["y"]) ** 2)

    opt = repl.wrap_optimizer(
        make_tx(jax.eval_shape(init_params)),
        zero_stage=config.zero_stage,
        accumulate_steps=config.accumulate_steps,
        clip_global_norm=config.clip_global_norm,
    )

    def init():
        params = init_params()
        if config.zero_stage == 3:
            placed = opt.shard_params(params, stacked=["layers"])
        else:
            placed = repl.replicate(params)
        return {"params": placed, "opt": opt.init(placed)}

    def input_fn(ctx):
        make = lambda n: mlp.regression_batches(n, seed=1)
        yield from _sliced(make, ctx, config.global_batch)

    def step_fn(state, batch):
        p, o, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": p, "opt": o}, metrics

    return _Job(step_fn, init, input_fn, _first_batch(input_fn), None, None)


def _cnn(config: TrainConfig, repl, make_tx) -> _Job:
    """The CNN with cross-replica BatchNorm on `shape_images`, data parallel: the BatchNorm
    statistics travel in the state next to the parameters, and are the same on every replica."""

    def new_model():
        return cnn.CNN(
            in_channels=1, num_classes=len(cnn.SHAPES), width=config.model.width, rngs=nnx.Rngs(0)
        )

    graphdef, shapes, _ = nnx.split(nnx.eval_shape(new_model), nnx.Param, nnx.BatchStat)
    tx = repl.wrap_optimizer(
        make_tx(shapes), zero_stage=config.zero_stage, clip_global_norm=config.clip_global_norm
    )

    def input_fn(ctx):
        yield from _sliced(lambda n: cnn.shape_batches(n, seed=1000), ctx, config.global_batch)

    def step_fn(state, batch):
        (loss, (stats, accuracy)), grads = cnn.value_and_grad(
            graphdef, state["params"], state["stats"], batch
        )
        updates, opt = tx.update(grads, state["opt"], state["params"])  # mean over replicas
        params = optax.apply_updates(state["params"], updates)
        metrics = rp.all_reduce({"loss": loss, "accuracy": accuracy}, "mean")
        return {"params": params, "stats": stats, "opt": opt}, metrics

    def init():
        _, params, stats = nnx.split(new_model(), nnx.Param, nnx.BatchStat)
        params, stats = repl.replicate(params), repl.replicate(stats)
        return {"params": params, "stats": stats, "opt": tx.init(params)}

    return _Job(step_fn, init, input_fn, _first_batch(input_fn), None, len(cnn.SHAPES))


def _first(input_fn: Callable) -> dict:
    """``input_fn``'s first global batch (one input pipeline)."""
    batches = input_fn(rp.InputContext())
    first = next(iter(batches))
    if hasattr(batches, "close"):
        batches.close()
    return first


def _first_batch(input_fn: Callable) -> Callable[[], dict]:
    """The shapes of ``input_fn``'s first global batch, generated when called."""
    return lambda: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), _first(input_fn)
    )


def _own_data(config: TrainConfig, builtin, *, vocab: int | None = None):
    """``builtin`` (the kind's own data), or the examples of ``config.data.path``, checked
    against a batch of the built-in data and served resumably (`replicator.cli.data`)."""
    if config.data.path is None:
        return builtin
    found = data_lib.examples(config.data, kind=config.model.kind, seq_len=config.model.seq_len)
    like = _first(builtin)
    data_lib.check(found, like, path=config.data.path, global_batch=config.global_batch,
                   vocab=vocab, init_from=config.init_from)  # fmt: skip
    return data_lib.input_fn(found, config.data, config.global_batch)


def _draw_schedule(config: TrainConfig, num_stages: int, out: str) -> None:
    """The pipeline schedule as ``schedule.txt`` (ASCII) and, with ``plot``, ``schedule.png``."""
    args = (_schedule(config), num_stages, config.pipeline.microbatches)
    png = os.path.join(out, "schedule.png") if config.plot else None
    try:
        picture = rp.pipeline.render(*args, path=png)
    except ImportError:
        print('replicator train: no schedule.png (pip install "replicator[plot]")', file=sys.stderr)
        picture = rp.pipeline.render(*args)
    with open(os.path.join(out, "schedule.txt"), "w") as f:
        f.write(picture + "\n")


def _plot(losses, path: str, config: TrainConfig) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('replicator train: no loss plot (pip install "replicator[plot]")', file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*losses))
    ax.set(xlabel="step", ylabel="loss", title=f"{config.name}: {config.model.kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
