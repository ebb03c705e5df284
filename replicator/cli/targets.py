"""``--target TYPE [--slices N]``: explain and plan a config's step for a TPU slice, here.

The step is the one ``replicator train`` runs (`jobs.abstract_job`, from shapes: nothing is
allocated), compiled by libtpu for the target's devices (``rp.tpu_devices``) on this machine.
When it does not fit the chip's HBM, the report names the smallest change that does, found by
compiling the step again with each change alone, smallest first.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

import jax

import replicator as rp
from replicator.cli.config import TrainConfig

# Called with what is compiled next ("step", "per_layer", or a hint's override) before each
# compile: `isolated` tells from it what a compile that ended the process was compiling.
on_compile = None


def add_args(parser, *, what: str) -> None:
    parser.add_argument(
        "--target", metavar="TYPE",
        help=f"{what} for a TPU slice, compiled here by libtpu (pip install "
        '"replicator[tpu]"): an accelerator type as gcloud spells it, e.g. v4-8, v5e-8, '
        "v5e-256, v5p-16 (8 chips: v4 and v5p count TensorCores), v5p-512, v6e-256",
    )  # fmt: skip
    parser.add_argument(
        "--slices", type=int, default=1, metavar="N",
        help="TPU slices joined over the data-centre network (the mesh's dcn_data axis); with "
        "--target (default: 1)",
    )  # fmt: skip


def check_args(args) -> rp.targets.Target | None:
    """The target ``--target``/``--slices`` name, or None; refuses ``--slices`` alone."""
    if args.target is None:
        if args.slices != 1:
            raise ValueError("--slices counts TPU slices of a --target; give --target too.")
        return None
    return rp.targets.tpu_target(args.target, slices=args.slices)


@functools.cache
def devices(name: str, slices: int) -> tuple:
    """The target's devices, once per process; JAX itself stays on this machine's CPU."""
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # JAX has started: its devices stay as they are
        pass
    return tuple(rp.tpu_devices(name, slices=slices))


def mesh_on_target(config: TrainConfig, target: rp.targets.Target) -> TrainConfig:
    """``config`` with its mesh over the target's devices: a ``dcn_data`` axis of the slices
    when the mesh has none (and several slices; with ``pipeline.across_slices``, the stages
    cross them instead), and the mesh's size checked.

    Raises:
      ValueError: for a mesh whose fixed sizes do not make the target's chips.
    """
    mesh = dict(config.mesh)
    staged = config.pipeline is not None and config.pipeline.across_slices
    if target.slices > 1 and staged:  # the stages across the slices (`mesh.build_mesh`)
        stages = mesh.get("stage", 1)
        if "dcn_data" in mesh or stages % target.slices or stages < target.slices:
            raise ValueError(
                f"pipeline.across_slices lays mesh.stage across the {target.slices} slices: "
                f"give mesh.stage a multiple of {target.slices} and no mesh.dcn_data; got mesh "
                f"{mesh}."
            )
    elif target.slices > 1 and "dcn_data" not in mesh:
        mesh = {"dcn_data": target.slices, **mesh}
    sizes = [v for v in mesh.values() if v != -1]
    fixed = math.prod(sizes)
    free = len(sizes) < len(mesh)
    if (free and target.num_devices % fixed) or (not free and fixed != target.num_devices):
        raise ValueError(
            f"mesh {mesh} does not make the {target.num_devices} chips of {target.label}; give "
            f"an axis -1 (e.g. mesh.data=-1) or sizes whose product is {target.num_devices}."
        )
    return dataclasses.replace(config, mesh=mesh)


def model_flops_per_chip(config: TrainConfig, num_devices: int) -> float | None:
    from replicator.cli import jobs

    total = jobs.model_flops(config)
    return None if total is None else total / num_devices


def explain(
    config: TrainConfig, target: rp.targets.Target, *, hints: bool = True, per_layer: bool = True
):
    """The `StepReport` of ``config``'s step compiled for ``target``; with ``hints``, one that
    does not fit carries the smallest change that does (``report.target.fit_hint``); with
    ``per_layer``, XLA's estimate of a scanned step is read per layer (`_per_layer_xla_seconds`:
    two more compiles)."""
    from replicator.cli.jobs.building import builtin_job

    if builtin_job(config) is None or config.data.path is not None:
        raise ValueError(
            f"--target: model.kind={config.model.kind!r} with data.path builds and reads real "
            f"arrays; a target compiles from shapes only, which the built-in kinds (gpt, llama, "
            f"mlp, cnn) on their built-in data do. Drop data.path, or explain on the CPU."
        )
    config = mesh_on_target(config, target)
    try:
        report = _compile(config, target, "step")
    except rp.targets.DoesNotFitError as e:  # the TPU compiler refused it: no program to report
        if not hints:
            raise
        hint = fit_hint(config, target, None)
        raise rp.targets.DoesNotFitError(
            f"{config.name} does not fit {target.label}: the TPU compiler refused the step: "
            f"{e.shortfall}. {hint}.", target=e.target, shortfall=e.shortfall,
        ) from None  # fmt: skip
    if per_layer:
        report = _per_layer_xla_seconds(config, target, report)
    if hints and not report.target.fits:
        hint = fit_hint(config, target, report)
        report = dataclasses.replace(
            report, target=dataclasses.replace(report.target, fit_hint=hint)
        )
    return dataclasses.replace(report, step=f"{config.name} ({config.model.label})")


def _compile(config: TrainConfig, target: rp.targets.Target, what: str):
    from replicator.cli import jobs

    if on_compile is not None:
        on_compile(what)
    repl, step_fn, state, batch = jobs.abstract_job(
        config, devices=list(devices(target.name, target.slices))
    )
    jobs.check_batch(config, repl)
    flops = model_flops_per_chip(config, target.num_devices)
    return repl.explain(step_fn, state, batch, model_flops=flops)


def _per_layer_xla_seconds(config: TrainConfig, target: rp.targets.Target, report):
    """XLA's estimate of a step whose layers are scanned, from the same step with one and with
    two layers unrolled (XLA reads those whole), extrapolated per layer: ``x1 + (L - 1) (x2 -
    x1)``. Accumulation's micro-batches are unrolled in those two programs too
    (`accumulation.unrolled`). Kept as `TargetReport` scaled it where that cannot be read: no
    scanned layers, a pipeline, or other loops in the small programs."""
    from replicator._src.optim import accumulation

    t, m = report.target, config.model
    if (
        t.xla_seconds is None or "scaled" not in t.xla_seconds_how or m.kind not in ("gpt", "llama")
        or not m.scan_layers or config.mesh.get("stage", 1) > 1 or m.layers < 3
    ):  # fmt: skip
        return report
    small = []
    for layers in (1, 2):
        model = dataclasses.replace(m, layers=layers, scan_layers=False)
        try:
            with accumulation.unrolled():  # its micro-batches straight-line too: no loop
                r = _compile(dataclasses.replace(config, model=model), target, "per_layer")
        except Exception:  # e.g. a layer count the mesh cannot take: keep the scaled figure
            return report
        x = r.target.xla_seconds
        if x is None or "scaled" in r.target.xla_seconds_how:  # other loops run in it
            return report
        small.append(x)
    x1, x2 = small
    seconds = x1 + (m.layers - 1) * (x2 - x1)
    k = config.accumulate_steps
    micro = f" and its {k} micro-batches" if k > 1 else ""
    how = (
        f"cost_analysis()['optimal_seconds'] of the step with 1 and 2 layers{micro} unrolled "
        f"({x1 * 1e3:.4g} and {x2 * 1e3:.4g} ms), extrapolated to {m.layers} layers"
    )
    if "; it leaves out" in t.xla_seconds_how:  # Pallas kernels: say so here too
        how += t.xla_seconds_how[t.xla_seconds_how.index("; it leaves out") :]
    mfu = None if t.model_flops is None else t.model_flops / (seconds * t.peak_flops)
    return dataclasses.replace(
        report, target=dataclasses.replace(t, xla_seconds=seconds, xla_seconds_how=how, xla_mfu=mfu)
    )


def _changes(config: TrainConfig) -> list[tuple[str, dict]]:
    """Single changes that cut memory, smallest first: each ``(override, replace kwargs)``."""
    out = []
    for z in range(config.zero_stage + 1, 4):
        out.append((f"zero_stage={z}", {"zero_stage": z}))
    if config.model.kind in ("gpt", "llama") and config.model.remat not in (True, "full"):
        model = dataclasses.replace(config.model, remat="full")
        out.append(("model.remat=full", {"model": model}))
    model_axis = config.mesh.get("model", 1)
    data = config.mesh.get("data", 1)
    if config.model.kind in ("gpt", "llama") and (data == -1 or data % 2 == 0):
        mesh = dict(config.mesh, model=model_axis * 2)
        if data != -1:
            mesh["data"] = data // 2
        out.append((f"mesh.model={model_axis * 2}", {"mesh": mesh}))
    out.append(
        (f"accumulate_steps={config.accumulate_steps * 2}",
         {"accumulate_steps": config.accumulate_steps * 2})
    )  # fmt: skip
    return out


def fit_hint(config: TrainConfig, target: rp.targets.Target, report=None) -> str:
    """The first of `_changes` whose step fits, compiled; or each one's peak if none does."""
    from replicator._src.report.step_report import format_bytes

    tried = []
    for override, change in _changes(config):
        print(f"  does not fit: trying {override} ...", file=sys.stderr, flush=True)
        try:
            changed = _compile(dataclasses.replace(config, **change), target, override)
        except rp.targets.DoesNotFitError as e:
            tried.append(f"{override}: {e.shortfall}")
            continue
        except Exception as e:  # refused (e.g. heads not divisible): not a way to fit
            tried.append(f"{override}: refused ({str(e).splitlines()[0][:120]})")
            continue
        if changed.target.fits:
            return (
                f"smallest change that fits: {override} (peak "
                f"{format_bytes(changed.target.peak_bytes)})"
            )
        tried.append(f"{override}: peak {format_bytes(changed.target.peak_bytes)}")
    return "no single change fits: " + "; ".join(tried)
