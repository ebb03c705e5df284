"""The checks of a `TrainConfig` that read several of its sections together: the mesh and the
counts, what each model kind asks of the mesh, the pipeline and the optimizer options, and what
the ``context`` and ``expert`` axes ask of the model, the batch and the schedule. Each takes the
sections and values it reads, and raises a ``ValueError`` naming the keys, as the sections' own
checks do (`replicator.cli.checks`)."""

from __future__ import annotations

import math

from replicator.cli.checks import int_at_least
from replicator.cli.config.constants import (
    DATA_AXES,
    MAX_CPU_DEVICES,
    MAX_STEPS,
    RING_IN_ONE_COND,
)
from replicator.cli.config.sections import ModelConfig, PipelineConfig, ProfileConfig

WHERE = "TrainConfig: "  # `from_dict` puts the file in its place


def check_mesh_and_counts(
    mesh: dict, counts: dict[str, int], profile: ProfileConfig | None
) -> None:
    """The mesh, the device and step counts (``cpu_devices``, ``steps``, ``global_batch``,
    ``accumulate_steps``, ``log_every``, ``checkpoint_every``: name to value), the profile's
    window."""
    where = WHERE
    if not mesh:
        raise ValueError(
            f"{where}mesh must name at least one axis; got {{}}. e.g. mesh: {{data: -1}} (every "
            f"device a replica) or mesh: {{data: 2, stage: 4}}."
        )
    for key, size in mesh.items():
        if not isinstance(key, str) or isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(
                f"{where}mesh must map axis names to sizes (ints); got {key!r}: {size!r}. "
                f"e.g. mesh: {{data: -1}} or mesh: {{data: 2, stage: 4}}."
            )
        if size < 1 and size != -1:
            raise ValueError(
                f"{where}mesh.{key}={size}: an axis size must be an int >= 1, or -1 for the "
                f"remaining devices."
            )
    int_at_least(where, "cpu_devices", counts["cpu_devices"], 0)
    if counts["cpu_devices"] > MAX_CPU_DEVICES:
        raise ValueError(
            f"{where}cpu_devices={counts['cpu_devices']} is more CPU devices than this process can "
            f"emulate (each is a thread pool and its memory; at most {MAX_CPU_DEVICES}); use "
            f"cpu_devices <= {MAX_CPU_DEVICES} (e.g. cpu_devices=8), or 0 for the platform's "
            f"own devices."
        )
    for name in ("steps", "global_batch", "accumulate_steps", "log_every", "checkpoint_every"):
        int_at_least(where, name, counts[name], 1)
    steps = counts["steps"]
    if steps > MAX_STEPS:
        raise ValueError(
            f"{where}steps={steps} is more than the run's step counter holds (an int32, "
            f"at most {MAX_STEPS}); use fewer steps."
        )
    if isinstance(profile, ProfileConfig) and profile.start_step > steps:
        raise ValueError(
            f"{where}profile.start_step={profile.start_step} comes after the run's last "
            f"step (steps={steps}), so nothing would be traced; use profile.start_step "
            f"<= {steps} (step 1 compiles, e.g. profile.start_step={min(3, steps)})."
        )


def check_model_fits_the_job(
    model: ModelConfig,
    mesh: dict,
    pipeline: PipelineConfig | None,
    *,
    zero_stage: int,
    accumulate_steps: int,
) -> None:
    """What a model kind asks of the mesh, the pipeline and the optimizer options."""
    where, kind = WHERE, model.kind
    if kind == "gpt" and "stage" in mesh and pipeline is None:
        raise ValueError(
            f"{where}a mesh with a 'stage' axis needs a pipeline: section, e.g. pipeline: "
            f"{{schedule: 1f1b, microbatches: 4}}."
        )
    if kind in ("mlp", "cnn") and "model" in mesh:
        raise ValueError(
            f"{where}model.kind={kind!r} has no tensor-parallel layout; use a mesh without "
            f"'model' (e.g. mesh: {{data: -1}}), or model.kind='gpt'."
        )
    t = mesh.get("model", 1)
    if kind == "gpt" and t > 1 and model.heads % t:
        raise ValueError(
            f"{where}model.heads={model.heads} does not split over mesh.model={t} (each "
            f"device holds whole attention heads); use heads a multiple of {t} (e.g. heads="
            f"{t * math.ceil(model.heads / t)}), or a smaller model axis."
        )
    d_ff = model.d_ff
    if kind == "gpt" and t > 1 and d_ff is not None and d_ff % t:
        raise ValueError(
            f"{where}model.d_ff={d_ff} does not split over mesh.model={t} (each device holds "
            f"d_ff / {t} of the MLP's hidden units); use d_ff a multiple of {t} (e.g. d_ff="
            f"{t * math.ceil(d_ff / t)}), or a smaller model axis."
        )
    if kind == "gpt" and "stage" in mesh and accumulate_steps != 1:
        raise ValueError(
            f"{where}accumulate_steps={accumulate_steps} does not apply to a pipeline "
            f"(mesh has a 'stage' axis), which splits each replica's batch into micro-batches "
            f"already; use pipeline.microbatches instead (e.g. pipeline.microbatches="
            f"{accumulate_steps * (pipeline.microbatches if pipeline else 4)}"
            f") with accumulate_steps=1."
        )
    if kind == "cnn" and "stage" in mesh:
        raise ValueError(f"{where}model.kind='cnn' is data parallel; use a mesh without 'stage'.")
    if kind == "cnn" and (zero_stage == 3 or accumulate_steps != 1):
        raise ValueError(
            f"{where}model.kind='cnn' supports zero_stage 0, 1 or 2 and accumulate_steps=1 "
            f"(its BatchNorm takes statistics over the whole batch); got zero_stage="
            f"{zero_stage}, accumulate_steps={accumulate_steps}."
        )
    scatter = pipeline.scatter_grads if pipeline else "microbatch"
    if scatter != "microbatch" and (zero_stage != 3 or "stage" not in mesh):
        why = [f"zero_stage={zero_stage}"] * (zero_stage != 3)
        why += ["no pipeline (the mesh has no 'stage' axis)"] * ("stage" not in mesh)
        fix = ["zero_stage=3"] * (zero_stage != 3) + ["mesh.stage=K"] * ("stage" not in mesh)
        raise ValueError(
            f"{where}pipeline.scatter_grads={scatter!r} is when ZeRO-3 reduce-scatters the "
            f"pipeline stages' gradients; with {' and '.join(why)} it would change nothing. "
            f"Use {' with '.join(fix)}, or pipeline.scatter_grads=microbatch."
        )


def check_context_and_experts(
    model: ModelConfig,
    mesh: dict,
    pipeline: PipelineConfig | None,
    *,
    global_batch: int,
    accumulate_steps: int,
) -> None:
    """What the ``context`` and ``expert`` axes ask of the model, the batch and the schedule.

    A size of -1 (the remaining devices) is not known here: what needs it is left to the
    library, which refuses it before the first step."""
    where, m = WHERE, model
    c, e, kind = mesh.get("context", 1), mesh.get("expert", 1), m.kind
    for axis in ("context", "expert"):
        if kind in ("mlp", "cnn") and axis in mesh:
            what = "the sequence" if axis == "context" else "a mixture of experts"
            raise ValueError(
                f"{where}mesh.{axis}: model.kind={kind!r} has no {axis} axis (it splits "
                f"{what} of model.kind='gpt'); use a mesh without {axis!r} (e.g. mesh: "
                f"{{data: -1}}), or model.kind='gpt'."
            )
    if kind != "gpt":
        return
    if m.experts and "stage" in mesh:
        raise ValueError(
            f"{where}model.experts={m.experts}: the mixture-of-experts GPT has no pipeline "
            f"layout (its load-balancing loss and routing counts do not travel between "
            f"stages); use a mesh without 'stage' (e.g. mesh: {{data: 2, expert: 4}}), or "
            f"model.experts=0."
        )
    if e != 1 and not m.experts:
        raise ValueError(
            f"{where}mesh.expert={e} with model.experts=0: a dense GPT has no experts to "
            f"split, and the axis would only split each replica's sequences as data does; "
            f"use mesh.data for that (e.g. mesh: {{data: -1}}), or set model.experts (a "
            f"multiple of mesh.expert, e.g. model.experts={8 if e == -1 else 2 * e})."
        )
    if c != 1 and e != 1:
        raise ValueError(
            f"{where}mesh.context={c} with mesh.expert={e}: a context axis and an expert "
            f"axis together are not supported yet; use one of them (e.g. mesh: {{data: 2, "
            f"context: 4}} or mesh: {{data: 2, expert: 4}})."
        )
    schedule = pipeline.schedule if pipeline and "stage" in mesh else None
    if c != 1 and m.attention == "ring" and schedule in RING_IN_ONE_COND:
        raise ValueError(
            f"{where}model.attention='ring' with mesh.context={c} cannot run under "
            f"pipeline.schedule={schedule!r} (it runs each stage's work under a condition, "
            f"which the ring's collectives cannot be in); use model.attention=all_to_all, "
            f"or pipeline.schedule gpipe or circular."
        )
    if c > 1:
        _check_context_axis(m, mesh, c)
    if e > 1:
        _check_expert_axis(m, mesh, e, global_batch=global_batch, k=accumulate_steps)


def _check_context_axis(m: ModelConfig, mesh: dict, c: int) -> None:
    where, t = WHERE, mesh.get("model", 1)
    if m.attention == "all_to_all" and t > 0 and (m.heads // t) % c:
        per = f"heads / mesh.model = {m.heads // t}" if t > 1 else f"heads={m.heads}"
        raise ValueError(
            f"{where}model.attention='all_to_all' splits the heads over mesh.context={c}, "
            f"but {per} do not split {c} ways; use model.heads a multiple of {c * t} (e.g. "
            f"model.heads={c * t * math.ceil(m.heads / (c * t))}), or model.attention=ring."
        )
    zigzag = m.attention == "ring" and m.zigzag
    parts = 2 * c if zigzag else c
    if m.seq_len % parts:
        why = (
            f"2 x mesh.context = {parts} chunks (the zigzag layout of a ring)"
            if zigzag
            else f"mesh.context={c} chunks"
        )
        raise ValueError(
            f"{where}model.seq_len={m.seq_len} does not split into {why}; use seq_len a "
            f"multiple of {parts} (e.g. model.seq_len={parts * math.ceil(m.seq_len / parts)})"
            f"{', or model.zigzag=false' if zigzag and m.seq_len % c == 0 else ''}."
        )


def _check_expert_axis(m: ModelConfig, mesh: dict, e: int, *, global_batch: int, k: int) -> None:
    where = WHERE
    if m.experts % e:
        raise ValueError(
            f"{where}model.experts={m.experts} does not split over mesh.expert={e} (each "
            f"device holds experts / {e} of them); use model.experts a multiple of {e} (e.g. "
            f"model.experts={e * math.ceil(m.experts / e)}), or a smaller expert axis."
        )
    data = [mesh.get(axis, 1) for axis in DATA_AXES]
    if min(data) < 1:
        return  # a -1 data axis: the library checks the batch against the devices
    replicas = math.prod(data)
    if global_batch % (replicas * k * e):
        over = f"{replicas} data replica{'s' * (replicas > 1)}"
        if k > 1:
            over += f" and accumulate_steps={k} micro-batches"
        unit = replicas * k * e
        raise ValueError(
            f"{where}global_batch={global_batch} over {over} gives "
            f"{global_batch / replicas / k:g} sequences a step, which do not split over "
            f"mesh.expert={e} (each expert device routes whole sequences); use global_batch "
            f"a multiple of {unit} (e.g. global_batch="
            f"{unit * math.ceil(global_batch / unit)}), or a smaller expert axis."
        )


def check_local_steps(config) -> None:
    """``local_steps`` (DiLoCo) and its outer step: a count, and only the layouts whose
    optimizer step it wraps (no ZeRO, pipeline, experts or offload: each keeps a worker's state
    or steps apart from `DistributedOptimizer.step`). The ``dcn_data`` axis it averages over
    may come from ``--slices`` after this: the step refuses a mesh without one."""
    where, H = WHERE, config.local_steps
    if H is None:
        return
    int_at_least(where, "local_steps", H, 1)
    for key in ("outer_learning_rate", "outer_momentum"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"{where}{key} must be a number >= 0; got {value!r}.")
    if config.model.kind not in ("gpt", "mlp"):
        raise ValueError(
            f"{where}local_steps={H} is built into the gpt and mlp jobs' steps; "
            f"model.kind={config.model.kind!r} steps with its own optimizer. Unset local_steps, "
            f"or call repl.wrap_optimizer(tx, local_steps={H}) in your own step."
        )
    others = {
        "zero_stage": config.zero_stage != 0,
        "mesh.stage": "stage" in config.mesh,
        "model.experts": bool(getattr(config.model, "experts", 0)),
        "offload_params": config.offload_params,
        "offload_optimizer": config.offload_optimizer,
    }
    if bad := [k for k, v in others.items() if v]:
        raise ValueError(
            f"{where}local_steps={H} takes each slice's optimizer steps with data parallelism "
            f"inside the slice only; {', '.join(bad)} is not built with it. Unset local_steps, "
            f"or use zero_stage=0 without a pipeline, experts or offload."
        )


def check_zero_axes(config) -> None:
    """``zero_axes`` (hybrid ZeRO): replica axis names, with ZeRO, on a job that passes them
    to its optimizer (the built-in kinds); the step refuses what its mesh cannot hold."""
    where, axes = WHERE, config.zero_axes
    if axes is None:
        return
    if isinstance(axes, str) or not axes or not all(a in DATA_AXES for a in axes):
        raise ValueError(
            f"{where}zero_axes={axes!r} must be a list of replica axes ({', '.join(DATA_AXES)}),"
            f" e.g. zero_axes: [data] with mesh: {{dcn_data: 2, data: -1}}; or null."
        )
    if not config.zero_stage:
        raise ValueError(f"{where}zero_axes={axes!r} says where ZeRO splits; set zero_stage.")
    if config.model.kind not in ("gpt", "mlp", "cnn"):
        raise ValueError(
            f"{where}zero_axes is passed to the built-in jobs' optimizers; model.kind="
            f"{config.model.kind!r} makes its own: call repl.wrap_optimizer(tx, zero_axes=...)."
        )
