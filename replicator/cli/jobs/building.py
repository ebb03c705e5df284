"""A config's job built: the `rp.Replicator` of its mesh, its step (with the learning rate and
the optional EMA kept in the state), its state and its data (`build`, and `checked_build` with
the global batch checked against the replicas first); or the same from shapes, allocating
nothing (`abstract_job`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

import replicator as rp
from replicator.cli import data as data_lib
from replicator.cli import optimizers
from replicator.cli.config import MODEL_KINDS, TrainConfig
from replicator.cli.jobs.base import first_of
from replicator.cli.jobs.cnn_job import cnn_job
from replicator.cli.jobs.gpt_job import check_schedule, gpt_job, pipeline_schedule
from replicator.cli.jobs.mlp_job import mlp_job
from replicator.cli.jobs.own_job import own_model


def builtin_job(config: TrainConfig):
    """The built-in job function of ``config.model.kind`` (`gpt_job`, `mlp_job`, `cnn_job`), or
    None."""
    return {"gpt": gpt_job, "mlp": mlp_job, "cnn": cnn_job}.get(config.model.kind)


def inner_steps(config: TrainConfig) -> int:
    """The optimizer steps of the run, which its schedule spans: ``steps``, times
    ``local_steps`` with DiLoCo (each step is that many of the optimizer's)."""
    return config.steps * (config.local_steps or 1)


def _tx_maker(config: TrainConfig) -> Callable:
    steps = inner_steps(config)

    def make_tx(params):  # the weight-decay mask is decided from the whole parameters' shapes
        return optimizers.make_optimizer(config.optimizer, steps=steps, params=params)[0]

    return make_tx


def build(config: TrainConfig):
    """The job a config describes: ``(repl, step_fn, state, input_fn, tokens_per_step)``."""
    kind = config.model.kind
    builtin = builtin_job(config)
    own = None if builtin else own_model(kind)  # imports first
    repl = replicator_of(config)
    make_tx = _tx_maker(config)
    if builtin is not None:
        job = builtin(config, repl, make_tx)
        input_fn = _own_data(config, job.input_fn, vocab=job.vocab)  # checked before the state
        step_fn, state, tokens = job.step_fn, job.init(), job.tokens
    else:  # its parameters are not known before it runs: the mask is decided on them
        step_fn, state, input_fn, tokens = own(config, repl, make_tx(None))
    step_fn, state = _rate_and_ema(repl, step_fn, state, config, make=lambda init: init())
    return repl, step_fn, state, input_fn, tokens


def replicator_of(config: TrainConfig):
    """The `rp.Replicator` of ``config.mesh``; a mesh that does not fit the devices is refused
    naming the keys that fix it (``cpu_devices``, ``mesh.*``), not the API's arguments.

    Raises:
      ValueError: if the mesh does not fit this run's devices.
    """
    try:
        return rp.Replicator(mesh_shape=dict(config.mesh))
    except ValueError as e:
        need = getattr(e, "devices_needed", None)  # the mesh's size against the devices
        if need is None:
            raise
        raise ValueError(_mesh_fix(config, need, e.devices_available)) from None


def _mesh_fix(config: TrainConfig, need: int, have: int) -> str:
    mesh = dict(config.mesh)
    filled = -1 in mesh.values()
    others = math.prod(v for k, v in mesh.items() if k != "data" and v != -1)
    emulated = jax.default_backend() == "cpu" and config.cpu_devices
    sized = f"a multiple of {need}" if filled else str(need)
    head = f"mesh={mesh} needs {sized} devices, but this run has {have}"
    fixes = [f"cpu_devices={need * max(1, math.ceil(have / need)) if filled else need}"]
    if not emulated:
        head += f" {jax.default_backend()} devices"
        fixes = []
    if have % others == 0 and mesh.get("data") != -1:
        fixes.append(f"mesh.data=-1 (every device: data={have // others})")
    fixes = fixes or [f"axis sizes whose product divides {have} (mesh.*=...)"]
    return f"{head}; use {' or '.join(fixes)}. A checkpoint restores onto any mesh."


def checked_build(config: TrainConfig):
    """`build`, with the global batch checked against the replicas (and a pipeline's
    micro-batches against its schedule) before the state is built, and a state too big for
    this machine's memory refused in one line.

    Raises:
      ValueError: naming the keys, for what `check_batch` and the schedule refuse, or a state
        that does not fit in memory.
    """
    if builtin_job(config) is not None:  # before the state is built: a mesh is cheap
        repl = replicator_of(config)
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
    builtin = builtin_job(config)
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
    schedule = optimizers.schedule_fn(config.optimizer, steps=inner_steps(config))
    per_step = config.local_steps or 1  # the optimizer's steps in one (DiLoCo: inner steps)
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
        return new, {**metrics, "learning_rate": schedule(full["step"] * per_step)}

    full = {"job": state, "step": make(lambda: repl.replicate(jnp.zeros((), jnp.int32)))}
    if ema_decay is not None:  # a copy of the parameters, with their shardings (or shapes)
        full["ema"] = jax.tree.map(_copy, state["params"])
    return with_rate, full


def _copy(x):
    return x if isinstance(x, jax.ShapeDtypeStruct) else jnp.copy(x)


def _own_data(config: TrainConfig, builtin, *, vocab: int | None = None):
    """``builtin`` (the kind's own data), or the examples of ``config.data.path``, checked
    against a batch of the built-in data and served resumably (`replicator.cli.data`)."""
    if config.data.path is None:
        return builtin
    found = data_lib.examples(config.data, kind=config.model.kind, seq_len=config.model.seq_len)
    like = first_of(builtin)
    data_lib.check(found, like, path=config.data.path, global_batch=config.global_batch,
                   vocab=vocab, init_from=config.init_from)  # fmt: skip
    return data_lib.input_fn(found, config.data, config.global_batch)
