"""``replicator plan CONFIG --devices N --memory 16GiB --hardware tpu-v5e``: the layout for a
config's model on N devices, ranked by modelled step time, written as a config that
``replicator train`` runs.

The layouts come from the config's model sizes (`rp.enumerate_layouts`): for a GPT of long
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
import os

import yaml

import replicator as rp
from replicator.cli import config as config_lib
from replicator.cli.config import TrainConfig


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
    p.add_argument("--devices", type=int, required=True, metavar="N", help="devices to plan for")
    p.add_argument(
        "--memory", metavar="SIZE",
        help="memory per device, e.g. 16GiB (default: the hardware profile's)",
    )  # fmt: skip
    p.add_argument(
        "--hardware", default="cpu", metavar="NAME_OR_FILE",
        help=f"a profile: {', '.join([*rp.HARDWARE, 'cpu'])} (this machine, measured), or a "
        "YAML file with name, peak_flops, memory_bytes, ici_bandwidth, dcn_bandwidth, "
        "island_size (default: cpu)",
    )  # fmt: skip
    p.add_argument("--out", metavar="PATH", help="where to write the best layout's config "
                   "(default: out_dir/name/plan.yaml)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write every layout's figures as JSON")
    p.add_argument("--workers", type=int, default=None, metavar="W",
                   help="processes that compile (default: 2, or 1 on one core)")  # fmt: skip
    p.add_argument("--overlap", type=float, default=0.0, metavar="F",
                   help="share (0-1) of the data-axis collectives hidden behind compute "
                   "(default 0: every collective exposed)")  # fmt: skip
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


def run(args: argparse.Namespace) -> int:
    """Plans, prints the table, writes the best config; the exit code (1 if nothing fits)."""
    cfg = config_lib.load(args.config, args.overrides)
    n = args.devices
    if n < 1:
        raise ValueError(f"--devices must be 1 or more; got {n}.")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be 1 or more; got {args.workers}.")
    families = layouts_for(cfg, n, args)
    if args.hardware == "cpu":  # measured here, with the N devices the plan emulates
        import jax

        jax.config.update("jax_num_cpu_devices", n)
        jax.config.update("jax_platforms", "cpu")
    profile = rp.hardware(args.hardware)
    budget = args.memory if args.memory is not None else profile.memory_bytes
    raw = dataclasses.asdict(cfg)
    raw.pop("learning_rate")  # short for optimizer.learning_rate, which holds it
    build = functools.partial(build_layout, raw)
    report = rp.plan(
        build, families, hardware=profile, memory=budget, model_flops=model_flops(cfg),
        overlap=args.overlap, workers=args.workers or min(2, os.cpu_count() or 1),
        progress=True,
    )  # fmt: skip
    print(report.table(top=args.top))
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


def layouts_for(cfg: TrainConfig, n: int, args: argparse.Namespace):
    """The families of layouts the config's model allows on ``n`` devices."""
    m = cfg.model
    schedules = tuple(s for s in args.schedules.split(",") if s)
    try:
        zero = tuple(int(z) for z in args.zero_stages.split(",") if z)
    except ValueError:
        raise ValueError(
            f"--zero-stages={args.zero_stages!r}: give ZeRO stages as comma-separated numbers, "
            f"e.g. --zero-stages 1,3."
        ) from None
    common = dict(global_batch=cfg.global_batch, schedules=schedules, max_stage=args.max_stage)
    if m.kind == "gpt":
        return rp.enumerate_layouts(
            n, num_layers=m.layers, num_heads=m.heads, hidden=m.d_ff or 4 * m.d_model,
            zero_stages=zero, max_model=8 if args.max_model is None else args.max_model,
            **_token_options(m, args), **common,
        )  # fmt: skip
    if m.kind == "mlp":  # data parallel with ZeRO; its layers are always rematerialised
        return rp.enumerate_layouts(
            n, num_layers=1, zero_stages=zero, max_model=1, remat=(False,), **common
        )
    if m.kind == "cnn":  # BatchNorm over the whole batch: ZeRO 0-2, no accumulation
        zero = tuple(z for z in zero if z < 3) or (0,)
        return rp.enumerate_layouts(
            n, num_layers=1, zero_stages=zero, max_model=1, accumulate_steps=(1,),
            remat=(False,), **common,
        )  # fmt: skip
    raise ValueError(
        f"model.kind={m.kind!r}: plan lays out the built-in kinds (gpt, mlp, cnn); for your own "
        f"model call rp.plan(build, rp.enumerate_layouts(...)) with a build(layout) of yours."
    )


def _model_keys() -> set[str]:
    """The keys the config's ``model:`` section knows (``attention``, ``experts`` and the rest
    of the context and expert keys where this version of the config has them)."""
    return {f.name for f in dataclasses.fields(config_lib.ModelConfig)}


def _token_options(m, args: argparse.Namespace) -> dict:
    """`rp.enumerate_layouts`' context and expert options for the GPT section ``m``: its
    sequence, its experts (``model.experts``, 0 if the config has no such key), its zigzag, and
    the attentions asked for that the config can say (``ring`` alone, the GPT's default,
    without a ``model.attention`` key)."""
    attention = tuple(a for a in args.attention.split(",") if a)
    bad = [a for a in attention if a not in ("ring", "all_to_all")]
    if bad or not attention:
        raise ValueError(
            f"--attention={args.attention!r}: give ring, all_to_all or both, comma-separated."
        )
    if "attention" not in _model_keys():
        attention = tuple(a for a in attention if a == "ring") or ("ring",)
    options = dict(
        seq_len=m.seq_len, d_model=m.d_model, attention=attention,
        zigzag=bool(getattr(m, "zigzag", True)), max_context=args.max_context,
        num_experts=int(getattr(m, "experts", 0) or 0), max_expert=args.max_expert,
    )  # fmt: skip
    if args.min_context_seq is not None:  # else the library's rule (512 tokens)
        options["min_context_seq"] = args.min_context_seq
    return options


def with_layout(raw: dict, layout: rp.Layout) -> dict:
    """The config ``raw`` (``dataclasses.asdict`` of a `TrainConfig`) with ``layout``'s keys."""
    out = dict(raw)
    out["mesh"] = dict(layout.mesh_shape)
    out["zero_stage"] = layout.zero_stage
    out["accumulate_steps"] = layout.accumulate_steps
    out["cpu_devices"] = layout.num_devices
    if layout.stage > 1:
        out["pipeline"] = {"schedule": layout.schedule, "microbatches": layout.microbatches,
                           "repeats": max(layout.repeats, 2)}  # fmt: skip
    else:
        out["pipeline"] = None
    if raw["model"]["kind"] == "gpt":
        out["model"] = {**raw["model"], "remat": layout.remat}
        if layout.context > 1 and ("attention" in raw["model"] or layout.attention != "ring"):
            out["model"]["attention"] = layout.attention
    return out


def build_layout(raw: dict, layout: rp.Layout):
    """``rp.plan``'s build: the config ``raw`` with ``layout``, built from shapes."""
    from replicator.cli import jobs

    cfg = config_lib.from_dict(TrainConfig, with_layout(raw, layout), where="plan")
    return jobs.abstract_job(cfg)


def model_flops(cfg: TrainConfig) -> float | None:
    """The model's training FLOPs per step (for the MFU), for the GPT; None for the others."""
    if cfg.model.kind != "gpt":
        return None
    from replicator.models import gpt

    m = cfg.model
    from replicator.cli import jobs

    return gpt.flops_per_token(jobs.gpt_config(cfg)) * cfg.global_batch * m.seq_len


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


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
