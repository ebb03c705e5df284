"""``replicator plan CONFIG --devices N --memory 16GiB --hardware tpu-v5e``: the layout for a
config's model on N devices, ranked by modelled step time, written as a config that
``replicator train`` runs.

The layouts come from the config's model sizes (`rp.planner.enumerate_layouts`): for a GPT of long
sequences (``model.seq_len`` at least ``--min-context-seq`` and ``model.d_model``) context axes
too, and for a mixture of experts (``model.experts`` > 0) expert axes. Each is the config with
its ``mesh``, ``zero_stage``, ``pipeline``, ``accumulate_steps``, ``model.remat`` and, over a
context axis, ``model.attention`` replaced, built from shapes by `jobs.abstract_job` and
compiled by `rp.plan` in worker processes with N emulated CPU devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re

import yaml

import replicator as rp
from replicator._src.planner.layouts import chunks_at
from replicator._src.report.step_report import format_bytes
from replicator.cli import config as config_lib
from replicator.cli import jobs, targets
from replicator.cli.config import MAX_CPU_DEVICES, TrainConfig
from replicator.cli.plan_pricing import add_pricing_args, default_workers, pricing_options


def add_parser(commands) -> None:
    """The ``plan`` subcommand's options."""
    p = commands.add_parser(
        "plan",
        help="the fastest layout of a config's model for N devices and a memory budget",
        description="Lists the layouts of CONFIG's model on N devices (data x stage x expert x "
        "context x model, attention over a context axis, ZeRO stage, pipeline schedule and "
        "micro-batches, accumulation, rematerialisation), "
        "rejects those whose state alone cannot fit, compiles the others from shapes on N "
        "emulated CPU devices, models each step's time on the hardware profile (compute at "
        "peak, collective bytes at the bandwidth of the link they cross, pipeline bubble), "
        "prints them ranked with why each rejected one was rejected, and writes the best as a "
        "config for `replicator train`. Example: replicator plan configs/lm_dp.yaml "
        "--devices 8 --memory 64MiB --hardware cpu",
    )
    p.add_argument("config", help="a YAML file (its model, global_batch and optimizer)")
    p.add_argument("overrides", nargs="*", help="key=value, as for train")
    p.add_argument("--devices", type=int, metavar="N",
                   help="devices to plan for (with --target: its chips)")  # fmt: skip
    p.add_argument(
        "--memory", metavar="SIZE",
        help="memory per device, e.g. 16GiB (default: the hardware profile's)",
    )  # fmt: skip
    p.add_argument(
        "--hardware", default="cpu", metavar="NAME_OR_FILE",
        help=f"a profile: {', '.join([*rp.planner.HARDWARE_PROFILES, 'cpu'])} (this machine, "
        "measured), or a YAML file with name, peak_flops, memory_bytes, ici_bandwidth, "
        "dcn_bandwidth, island_size (default: cpu)",
    )  # fmt: skip
    p.add_argument("--out", metavar="PATH", help="where to write the best layout's config "
                   "(default: out_dir/name/plan.yaml)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write every layout's figures as JSON")
    p.add_argument("--wide", action="store_true",
                   help="print every column of the ranked table (the step's compute, bubble, "
                   "ICI and DCN; the priced peak and step), not only those that fit 120 "
                   "columns (peak, step, MFU)")  # fmt: skip
    p.add_argument("--workers", type=int, default=None, metavar="W",
                   help="processes that compile (default: 2, or 1 on one core; with --target, one "
                   "for each 2 cores, up to 2)")  # fmt: skip
    p.add_argument("--overlap", type=float, default=None, metavar="F",
                   help="share (0-1) of the data-axis collectives hidden behind compute "
                   "(default with --target: the chip profile's, as explain's step_seconds reads a TPU "
                   "program, whose collectives run asynchronously; else 0, every one exposed)")  # fmt: skip
    p.add_argument("--schedules", default="gpipe,1f1b,circular,interleaved,zerobubble",
                   help="pipeline schedules to try, comma-separated (default: all; circular "
                   "and interleaved with 2 virtual stages per device)")  # fmt: skip
    p.add_argument("--max-model", type=int, default=None, metavar="T",
                   help="the largest model (tensor-parallel) axis to try (default: 8)")  # fmt: skip
    p.add_argument("--max-stage", type=int, default=None, metavar="K",
                   help="the largest stage (pipeline) axis to try (default: any)")  # fmt: skip
    p.add_argument("--max-context", type=int, default=8, metavar="C",
                   help="the largest context (sequence) axis to try (default: 8)")  # fmt: skip
    p.add_argument("--min-context-seq", type=int, default=None, metavar="S",
                   help="try context axes for a GPT of seq_len >= S tokens, and >= model.d_model "
                   "(default: 512)")  # fmt: skip
    p.add_argument("--attention", default="ring,all_to_all",
                   help="attention across a context axis to try, comma-separated (default: "
                   "ring,all_to_all)")  # fmt: skip
    p.add_argument("--max-expert", type=int, default=None, metavar="E",
                   help="the largest expert axis to try, for model.experts > 0 (default: "
                   "any)")  # fmt: skip
    p.add_argument("--zero-stages", default="0,1,2,3",
                   help="ZeRO stages to try, comma-separated (default: 0,1,2,3)")  # fmt: skip
    p.add_argument("--top", type=int, default=20, help="rows of each table to print")
    add_pricing_args(p)
    targets.add_args(p, what="plan (compile every layout)")


def run(args: argparse.Namespace) -> int:
    """Plans, prints the table, writes the best config; the exit code (1 if nothing fits).

    Every option is checked, and a budget that the state alone cannot fit is refused, before
    anything compiles."""
    cfg = config_lib.load(args.config, args.overrides)
    n = check_args(args)
    ladders = layouts_for(cfg, n, args)
    if not ladders:
        raise ValueError(no_layouts(cfg, n, args))
    budget = None if args.memory is None else parse_size(args.memory, "--memory")
    pricing = pricing_options(cfg, args)
    target = targets.check_args(args)
    if target is not None:  # compiled for the TPU here; its chip is the profile
        cfg = targets.mesh_on_target(cfg, target)
    elif args.hardware == "cpu":  # measured here, with the N devices the plan emulates
        import jax

        jax.config.update("jax_num_cpu_devices", n)
        jax.config.update("jax_platforms", "cpu")
    profile = rp.planner.hardware_profile(args.hardware if target is None else target)
    budget = profile.memory_bytes if budget is None else budget
    check_state_fits(cfg, n, budget, given=args.memory is not None)
    raw = dataclasses.asdict(cfg)
    raw.pop("learning_rate", None)  # a short form: optimizer.learning_rate holds it
    build = functools.partial(build_layout, raw, target=target)
    overlap = args.overlap if args.overlap is not None else profile.overlap * (target is not None)
    timing = rp.planner.TimingOptions(overlap=overlap, model_flops=jobs.model_flops(cfg))
    report = rp.plan(
        build, ladders, hardware=profile, memory=budget, timing=timing, pricing=pricing,
        target=target, workers=args.workers or default_workers(target), progress=True,
    )  # fmt: skip
    print(report.table(top=args.top, wide=args.wide))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json() + "\n")
        print(f"wrote {args.json}")
    if report.best is None:
        return 1
    out = args.out or os.path.join(cfg.out_dir, cfg.name, "plan.yaml")
    write_config(with_layout(raw, report.best), out, report)
    print(f"wrote {out}: replicator train {out}")
    return 0


def check_args(args: argparse.Namespace) -> int:
    """Refuses, naming the option, a value out of range; returns ``--devices`` (the target's
    chips with ``--target``)."""
    target = targets.check_args(args)
    n = args.devices if target is None or args.devices is not None else target.num_devices
    if n is None:
        raise ValueError("give --devices N (devices to plan for), or --target TYPE.")
    if target is not None and n != target.num_devices:
        raise ValueError(
            f"--devices {n} with --target {target.label}, which has {target.num_devices} chips; "
            f"drop --devices."
        )
    if n < 1:
        raise ValueError(f"--devices must be 1 or more; got {n}.")
    if target is None and n > MAX_CPU_DEVICES:
        raise ValueError(
            f"--devices {n}: each layout compiles on as many emulated CPU devices, at most "
            f"{MAX_CPU_DEVICES} in one process; plan for at most {MAX_CPU_DEVICES} devices."
        )
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be 1 or more; got {args.workers}.")
    for flag, value, none in (
        ("--max-model", args.max_model, " (1: no tensor parallelism)"),
        ("--max-stage", args.max_stage, " (1: no pipeline)"),
        ("--max-context", args.max_context, " (1: no context axis)"),
        ("--max-expert", args.max_expert, " (1: no expert axis)"),
        ("--min-context-seq", args.min_context_seq, ""),
        ("--top", args.top, ""),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be 1 or more{none}; got {value}.")
    if args.overlap is not None and not 0 <= args.overlap <= 1:
        raise ValueError(
            f"--overlap must be a share from 0 to 1 (of the collectives hidden behind compute); "
            f"got {args.overlap}."
        )
    bad = [s for s in args.schedules.split(",") if s not in config_lib.SCHEDULES]
    if bad or not args.schedules.strip(","):
        raise ValueError(
            f"--schedules {args.schedules!r}: give one or more of "
            f"{','.join(config_lib.SCHEDULES)}, comma-separated (e.g. --schedules 1f1b,gpipe)."
        )
    for path, flag in ((args.out, "--out"), (args.json, "--json")):
        if path:
            jobs.check_writable(path, flag=flag)
    return n


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_SIZE = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str, flag: str) -> int:
    """``16GiB``, ``80GB``, ``512MiB`` or bytes, as bytes; a ``ValueError`` naming ``flag`` for
    anything else, or a size that is not > 0.

    >>> parse_size("16GiB", "--memory"), parse_size("1.5e3", "--memory")
    (17179869184, 1500)
    """
    match = _SIZE.fullmatch(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(
            f"{flag} {text}: memory={text!r} is not a size; write bytes as a number or with a "
            f"unit, e.g. {flag} 16GiB, 80GB or 512MiB (units: {', '.join(u for u in _UNITS if u)})."
        )
    size = float(match.group(1)) * unit
    if not math.isfinite(size) or size < 1:
        raise ValueError(
            f"{flag} {text}: a memory budget must be 1 byte or more, e.g. {flag} 16GiB."
        )
    return int(size)


def layouts_for(cfg: TrainConfig, n: int, args: argparse.Namespace):
    """The ladders of layouts the config's model allows on ``n`` devices."""
    m = cfg.model
    schedules = tuple(s for s in args.schedules.split(",") if s)
    try:
        zero = tuple(int(z) for z in args.zero_stages.split(",") if z)
    except ValueError:
        zero = ()
    if not zero or not set(zero) <= {0, 1, 2, 3}:
        raise ValueError(
            f"--zero-stages={args.zero_stages!r}: give ZeRO stages 0, 1, 2 or 3, comma-separated, "
            f"e.g. --zero-stages 1,3."
        )
    planner = rp.planner
    slices = _slices(args)
    if cfg.global_batch % slices:
        raise ValueError(
            f"--slices {slices}: global_batch={cfg.global_batch} does not split over {slices} "
            f"slices (each holds as many replicas); give a global_batch that is a multiple of "
            f"{slices}."
        )
    enumerate_layouts = functools.partial(planner.enumerate_layouts, slices=slices)
    if m.kind == "gpt":
        sizes, attention, limits = _gpt_options(m, cfg.global_batch, args)
        search = planner.SearchOptions(
            schedules=schedules, zero_stages=zero, attention=attention, remat=_remats(cfg, args)
        )
        return enumerate_layouts(n, sizes=sizes, search=search, limits=limits)
    sizes = planner.ModelSizes(global_batch=cfg.global_batch, num_layers=1)
    limits = planner.AxisLimits(max_model=1, max_stage=args.max_stage)
    if m.kind == "mlp":  # data parallel with ZeRO; its layers are always rematerialised
        search = planner.SearchOptions(schedules=schedules, zero_stages=zero, remat=(False,))
        return enumerate_layouts(n, sizes=sizes, search=search, limits=limits)
    if m.kind == "cnn":  # BatchNorm over the whole batch: ZeRO 0-2, no accumulation
        zero = tuple(z for z in zero if z < 3) or (0,)
        search = planner.SearchOptions(
            schedules=schedules, zero_stages=zero, accumulate_steps=(1,), remat=(False,)
        )
        return enumerate_layouts(n, sizes=sizes, search=search, limits=limits)
    raise ValueError(
        f"model.kind={m.kind!r}: plan lays out the built-in kinds (gpt, mlp, cnn); for your own "
        f"model call rp.plan(build, rp.planner.enumerate_layouts(...)) with a build(layout) of "
        f"yours."
    )


def _slices(args: argparse.Namespace) -> int:
    """The target's slices (``--slices``; 1 without a target): every layout then puts its
    replicas across them (``dcn_data``), the rest of its axes inside a slice."""
    return getattr(args, "slices", 1) if getattr(args, "target", None) is not None else 1


def _remats(cfg: TrainConfig, args: argparse.Namespace) -> tuple:
    """The remat policies to try: none, dots and full; for a TPU target, MaxText's
    ``save_dot_except_mlpwi`` too, and for a SwiGLU MLP ``save_dot_offload_mlpwi_0`` (its gate
    projection kept in host memory), which a layout takes where HBM is short."""
    own = _own_remat(cfg)
    if getattr(args, "target", None) is None:
        return (False, "dots", *own, True)
    gated = jobs.gpt_config(cfg).gated
    offload = ("save_dot_offload_mlpwi_0",) if gated else ()
    return (False, "dots", *offload, "save_dot_except_mlpwi", *own, True)


def _own_remat(cfg: TrainConfig) -> tuple:
    """The config's own remat policy where it is one by name (a mapping, such as a MaxText
    recipe's, or a preset the search does not try by itself): the plan tries it too."""
    remat = getattr(cfg.model, "remat", None)
    if not isinstance(remat, (dict, str)) or remat in ("none", "full", "dots"):
        return ()
    from replicator._src.planner.layouts import remat_policy

    policy = remat_policy(remat, "model.remat")
    return () if isinstance(policy, bool) else (policy,)


def no_layouts(cfg: TrainConfig, n: int, args: argparse.Namespace) -> str:
    """Why no layout of ``n`` devices suits the config, with the options that limit them and
    the nearest device counts that have layouts."""
    m = cfg.model
    rules = [f"a data axis that divides global_batch={cfg.global_batch}"]
    if m.kind == "gpt":
        rules += [
            f"a stage axis that divides model.layers={m.layers}",
            f"a model axis that divides model.heads={m.heads} and the MLP's "
            f"{m.d_ff or 4 * m.d_model} units",
        ]
    limits = [
        f"{flag} {value}"
        for flag, value in (("--max-model", args.max_model), ("--max-stage", args.max_stage))
        if value is not None
    ]
    near = []
    step = _slices(args)  # device counts the slices divide
    for other in sorted(range(step, min(2 * n, MAX_CPU_DEVICES) + 1, step),
                        key=lambda k: abs(k - n)):  # fmt: skip
        if other != n and layouts_for(cfg, other, args):
            near.append(other)
        if len(near) == 2:
            break
    within = f", within {' and '.join(limits)}" if limits else ""
    fix = f"use --devices {' or '.join(map(str, sorted(near)))}" if near else "change the sizes"
    if limits:
        fix += f", or raise {' and '.join(limit.split()[0] for limit in limits)}"
    return (
        f"no layout of {n} devices suits {args.config}: each needs {', '.join(rules)}{within}; "
        f"{fix}."
    )


def check_state_fits(cfg: TrainConfig, n: int, budget: int, *, given: bool) -> None:
    """Refuses, before anything compiles, a budget below the state's share of one device: the
    parameters and optimizer state (and the step counter, the EMA) from their shapes, split
    over all ``n`` devices as ZeRO-3 would (no layout holds less), activations aside."""
    if cfg.model.kind not in ("gpt", "mlp", "cnn"):
        return
    model = cfg.model
    if getattr(model, "reduce_dtype", None) is not None:  # ZeRO-3's alone: none at stage 0
        model = dataclasses.replace(model, reduce_dtype=None)
    whole = dataclasses.replace(
        cfg, mesh={"data": -1}, zero_stage=0, accumulate_steps=1, pipeline=None, model=model
    )
    _, _, state, _ = jobs.abstract_job(whole)
    import jax
    import numpy as np

    total = sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    least = math.ceil(total / n)
    if least <= budget:
        return
    more = math.ceil(total / budget)
    devices = f", or --devices {more} or more" if more <= MAX_CPU_DEVICES else ""
    raise ValueError(
        f"{'--memory' if given else 'the hardware profile'} {format_bytes(budget)} per device "
        f"cannot hold the model's parameters and optimizer state alone: {format_bytes(total)}, "
        f"at least {format_bytes(least)} per device on {n} devices (split {n} ways, as ZeRO-3 "
        f"does), before any activation; give --memory more than {format_bytes(least)}"
        f"{devices}."
    )


def _model_keys() -> set[str]:
    """The keys the config's ``model:`` section knows (``attention``, ``experts`` and the rest
    of the context and expert keys where this version of the config has them)."""
    return {f.name for f in dataclasses.fields(config_lib.ModelConfig)}


def _gpt_options(m, global_batch: int, args: argparse.Namespace):
    """`rp.planner.enumerate_layouts`' ``sizes``, ``search.attention`` and ``limits`` for the
    GPT section ``m``: its sizes, sequence, experts (``model.experts``, 0 if the config has no
    such key) and zigzag; the attentions asked for that the config can say (``ring`` alone, the
    GPT's default, without a ``model.attention`` key); the axis limits (a ``model`` axis of at
    most 8 unless told, and none of ``model`` or ``context`` for splash attention, which runs
    on whole heads and sequences on one device each: `replicator._src.sharded.splash`; an
    ``expert`` axis splits sequences, as MaxText's Mixtral recipes do)."""
    attention = tuple(a for a in args.attention.split(",") if a)
    bad = [a for a in attention if a not in ("ring", "all_to_all")]
    if bad or not attention:
        raise ValueError(
            f"--attention={args.attention!r}: give ring, all_to_all or both, comma-separated."
        )
    if "attention" not in _model_keys():
        attention = tuple(a for a in attention if a == "ring") or ("ring",)
    sizes = rp.planner.ModelSizes(
        global_batch=global_batch, num_layers=m.layers, num_heads=m.heads,
        hidden=m.d_ff or 4 * m.d_model, seq_len=m.seq_len, d_model=m.d_model,
        num_experts=int(getattr(m, "experts", 0) or 0), zigzag=bool(getattr(m, "zigzag", True)),
    )  # fmt: skip
    limits = dict(
        max_model=8 if args.max_model is None else args.max_model, max_stage=args.max_stage,
        max_context=args.max_context, max_expert=args.max_expert,
    )  # fmt: skip
    if args.min_context_seq is not None:  # else the library's rule (512 tokens)
        limits["min_context_seq"] = args.min_context_seq
    if getattr(m, "attention", None) == "splash":
        limits.update(max_model=1, max_context=1)
    return sizes, attention, rp.planner.AxisLimits(**limits)


def with_layout(raw: dict, layout: rp.planner.Layout) -> dict:
    """The config ``raw`` (``dataclasses.asdict`` of a `TrainConfig`) with ``layout``'s keys."""
    out = dict(raw)
    out["mesh"] = dict(layout.mesh_shape)
    out["zero_stage"] = layout.zero_stage
    out["zero_axes"] = ["data"] if layout.hybrid else None
    out["accumulate_steps"] = layout.accumulate_steps
    out["cpu_devices"] = layout.num_devices
    if layout.stage > 1:
        out["pipeline"] = {"schedule": layout.schedule, "microbatches": layout.microbatches,
                           "repeats": max(layout.repeats, 2)}  # fmt: skip
    else:
        out["pipeline"] = None
    if raw["model"]["kind"] == "gpt":
        remat = layout.remat
        if isinstance(remat, str) and "=" in remat:  # a policy by name, as the config writes it
            from replicator._src.planner.layouts import actions_of

            remat = actions_of(remat)
        out["model"] = {**raw["model"], "remat": remat}
        moe, loss = chunks_at(
            layout, raw["model"].get("moe_chunks") or 1, raw["model"].get("loss_chunks") or 1
        )  # the chunks the plan priced: with accumulation, a chunk holds what the config's does
        out["model"]["moe_chunks"], out["model"]["loss_chunks"] = moe, loss
        if layout.context > 1 and ("attention" in raw["model"] or layout.attention != "ring"):
            out["model"]["attention"] = layout.attention
    return out


def build_layout(raw: dict, layout: rp.planner.Layout, target: rp.targets.Target | None = None):
    """``rp.plan``'s build: the config ``raw`` with ``layout``, built from shapes (on the
    target's devices with ``target``)."""
    from replicator.cli import jobs

    cfg = config_lib.from_dict(TrainConfig, with_layout(raw, layout), where="plan")
    devices = None if target is None else list(targets.devices(target.name, target.slices))
    return jobs.abstract_job(cfg, devices=devices)


def write_config(raw: dict, path: str, report) -> None:
    """Writes ``raw`` as YAML with a header saying where it came from."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    best = report.ranked[0]
    t = best.time
    mfu = "" if t.mfu is None else f", modelled MFU {t.mfu:.1%}"
    header = (
        f"# Written by `replicator plan` for {report.num_devices} devices of "
        f"{report.hardware.name}, {format_bytes(report.memory_budget)} each.\n"
        f"# Best of {len(report.ranked)} layouts that fit: {best.layout}; peak "
        f"{format_bytes(best.peak_bytes)} per device, modelled step {t.total * 1e3:.4g} ms{mfu}.\n"
    )
    with open(path, "w") as f:
        f.write(header)
        yaml.safe_dump(raw, f, sort_keys=False)
