"""Is each composition lean on a TPU? FLOPs, collective bytes and memory of TPU programs.

``benchmarks/efficiency.py``, ``context.py`` and ``moe.py`` ask whether each composition does
the ideal work and moves the ideal bytes, on 8 emulated CPU devices. Here the same questions are
read from the programs libtpu compiles for a TPU target (default ``v5p-16``: 8 chips), ahead of
time, on this machine: no TPU is attached and nothing runs. The steps are those ``replicator
train`` runs, built from shapes by the CLI's job code (``jobs.abstract_job`` on
``rp.tpu_devices``, the mesh fixed by ``targets.mesh_on_target``) and read by ``repl.explain``
(FLOPs with loops per trip, collectives by kind, axes, dtype and bytes, ``memory_analysis``).

The model is the GPT of ``configs/lm_dp.yaml`` (``lm_pipeline.yaml`` for the pipelines) at
d_model 256, 4 layers, 8 heads, seq 128, global batch 32, Adam. One row per check:

a. FSDP x TP (``zero_stage=3``) on ``{data: 4, model: 2}`` and ``{data: 2, model: 4}``: FLOPs
   per device <= 1.10x plain data parallelism's (``{data: 8}``, ``zero_stage=0``).
b. 1F1B, ZeroBubble and interleaved 1F1B (8 layers, V = 2) on ``{data: 2, stage: 4}``, M = 8,
   without remat: FLOPs <= 1.10x data parallelism's at the same number of layers.
c. 1F1B with ``model.dtype=bfloat16``: the collective-permute bytes over ``stage`` <= 0.55x the
   fp32 program's.
d. ZeRO-1 x TP (``{data: 4, model: 2}``): all-gather bytes over ``model`` (every group that
   spans it) <= 5% of the data-axis volume (reduce-scatter + all-gather + 2 x all-reduce, as
   ``efficiency.data_volume``); then the same without the gathers of the forward and backward
   passes (``op_name`` under ``jvp``, or run once per layer: tensor parallelism's activations),
   i.e. the optimizer update's.
e. Ring attention on ``{data: 2, context: 4}``: the collective-permutes over ``context`` against
   ``2 (C-1)`` K/V blocks per layer forward and ``2 (C-1) + 2 C`` backward, a block ``b x S/C x
   d_model`` words (``context.py``); MoE (8 experts, top 2) on ``{data: 2, expert: 4}``: the
   all-to-alls over ``expert`` against 4 capacity buffers ``[G, E, C, D]`` per block
   (``moe.py``). In words (elements, whatever the dtype on the wire): equal to 1%; in bytes: at
   most the formula's fp32 bytes (the TPU compiler may send in bf16 what only feeds matmuls).
f. The same FSDP x TP step by hand, ``jax.jit`` + ``NamedSharding`` in MaxText's style
   (``efficiency.reference_row``, compiled for the target's devices) beside replicator's on the
   same layout (``model.vocab_parallel=false``: the vocabulary whole, as the reference keeps it):
   FLOPs <= 1.05x, bytes on the wire (ring algorithms: an all-reduce 2 (g-1)/g of its buffer, a
   gather or scatter (g-1)/g; payloads cannot be compared once a compiler splits an all-reduce
   into a reduce-scatter and an all-gather) <= 1.05x, temporaries <= 1.10x (this benchmark's
   bounds).

Each row gives the TPU program's peak memory (arguments + outputs - aliased + temporaries) and
compile seconds, and the same figure read from the CPU program (8 emulated devices; ``--no-cpu``
skips it; XLA:CPU carries bf16 collectives in f32, so row c reads 1.0 there, and
``efficiency.py`` reads the lowered program instead). A check that cannot be computed is a
failing row with its error.

    python benchmarks/tpu_lean.py
    python benchmarks/tpu_lean.py --part a,f --no-cpu --json /tmp/tpu_lean.json
    python benchmarks/tpu_lean.py --target v5e-8
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import sys
import time
import traceback
import types
from collections.abc import Callable
from unittest import mock

import efficiency  # benchmarks/efficiency.py: reference_row, data_volume, by_kind

import replicator as rp
from replicator.cli import config as cfg_lib
from replicator.cli import jobs, targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model.d_model=256", "model.layers=4", "model.heads=8", "model.seq_len=128",
         "global_batch=32"]  # fmt: skip
PIPE = ["pipeline.microbatches=8", "model.remat=none", "zero_stage=0"]
CONTEXT, EXPERT = 4, 4


def itemsize(dtype: str) -> int:
    """Bytes per element of an HLO dtype: ``f32`` 4, ``bf16`` 2, ``pred`` 1."""
    bits = re.sub(r"\D", "", dtype)
    return int(bits) // 8 if bits else 1


def mesh(**axes) -> list[str]:
    return [f"mesh.{k}={v}" for k, v in axes.items()]


# name -> (config, overrides): the steps compiled, each once per platform
PROGRAMS = {
    "DP": ("lm_dp", [*mesh(data=8), "zero_stage=0"]),
    "DP, 8 layers": ("lm_dp", [*mesh(data=8), "zero_stage=0", "model.layers=8"]),
    "FSDP x TP 2": ("lm_dp", [*mesh(data=4, model=2), "zero_stage=3"]),
    "FSDP x TP 4": ("lm_dp", [*mesh(data=2, model=4), "zero_stage=3"]),
    # the hand-written step's layout: the vocabulary whole on every device (gpt.partition_specs)
    "FSDP x TP 2, vocab whole": (
        "lm_dp",
        [*mesh(data=4, model=2), "zero_stage=3", "model.vocab_parallel=false"],
    ),
    "FSDP x TP 4, vocab whole": (
        "lm_dp",
        [*mesh(data=2, model=4), "zero_stage=3", "model.vocab_parallel=false"],
    ),
    "ZeRO-1 x TP 2": ("lm_dp", [*mesh(data=4, model=2), "zero_stage=1"]),
    "1F1B": ("lm_pipeline", [*mesh(data=2, stage=4), *PIPE, "pipeline.schedule=1f1b"]),
    "1F1B bf16": (
        "lm_pipeline",
        [*mesh(data=2, stage=4), *PIPE, "pipeline.schedule=1f1b", "model.dtype=bfloat16"],
    ),
    "ZeroBubble": ("lm_pipeline", [*mesh(data=2, stage=4), *PIPE, "pipeline.schedule=zerobubble"]),
    "Interleaved 1F1B, 8 layers": (
        "lm_pipeline",
        [
            *mesh(data=2, stage=4),
            *PIPE,
            "pipeline.schedule=interleaved",
            "pipeline.repeats=2",
            "model.layers=8",
        ],
    ),
    "ring attention": ("lm_dp", [*mesh(data=2, context=CONTEXT), "model.attention=ring"]),
    "MoE": ("lm_dp", [*mesh(data=2, expert=EXPERT), "model.experts=8", "model.top_k=2"]),
}


@dataclasses.dataclass
class Program:
    """What one compiled step costs per device, read from its program."""

    name: str
    platform: str
    flops: float
    collectives: list  # dicts: kind, axes, dtype, bytes, count, op_name
    peak_bytes: int
    temp_bytes: int
    compile_seconds: float

    def bytes(self, kind=None, has_axis=None, axes=None, where=lambda c: True, words=False):
        """Payload per step of the collectives of ``kind`` whose groups span ``has_axis`` (or
        span exactly ``axes``); with ``words``, in elements of their dtypes."""
        return sum(
            c["bytes"] * c["count"] / (itemsize(c["dtype"]) if words else 1)
            for c in self.collectives
            if (kind is None or c["kind"] == kind)
            and (has_axis is None or has_axis in c["axes"])
            and (axes is None or tuple(c["axes"]) == tuple(axes))
            and where(c)
        )

    def wire_bytes(self) -> float:
        """Bytes one device sends per step with ring algorithms (`hlo.Collective.wire_bytes`):
        an all-reduce 2 (g-1)/g of its buffer, an all-gather, reduce-scatter or all-to-all
        (g-1)/g, a collective-permute all of it. Payloads are not comparable across programs
        that split an all-reduce into a reduce-scatter and an all-gather; these bytes are."""
        total = 0.0
        for c in self.collectives:
            g = c["group_size"]
            share = 2 * (g - 1) / g if c["kind"] == "all-reduce" else (g - 1) / g
            total += c["bytes"] * c["count"] * (1 if c["kind"] == "collective-permute" else share)
        return total


class Programs:
    """Compiles each step once per platform, on demand: ``get(name)``."""

    def __init__(self, target: rp.targets.Target, platform_name: str):
        self.target, self.platform = target, platform_name
        self.devices = None
        if platform_name == "tpu":
            self.devices = list(targets.devices(target.name, target.slices))
        self.cache: dict = {}

    def config(self, name: str):
        path, overrides = PROGRAMS[name]
        cfg = cfg_lib.load(os.path.join(ROOT, "configs", path + ".yaml"), [*MODEL, *overrides])
        return targets.mesh_on_target(cfg, self.target) if self.platform == "tpu" else cfg

    def get(self, name: str) -> Program:
        if name not in self.cache:
            cfg = self.config(name)
            repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=self.devices)
            r = repl.explain(step_fn, state, batch)
            collectives = [dataclasses.asdict(c) for c in r.collectives]
            self.cache[name] = Program(
                name,
                r.platform,
                r.flops,
                collectives,
                r.memory.peak,
                r.memory.temporaries,
                r.compile_seconds,
            )
            print(
                f"# {self.platform}: {name} compiled in {r.compile_seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        return self.cache[name]

    def reference(self, name: str) -> Program:
        """``efficiency.reference_row`` (jax.jit + NamedSharding) of layout ``name`` on these
        devices: it builds its mesh from ``jax.devices()``, which is the target's here."""
        key = name + " (jit by hand)"
        if key not in self.cache:
            cfg = self.config(name)
            devices = self.devices or jax.devices()
            with mock.patch.object(jax, "devices", lambda *a, **k: list(devices)):
                row = efficiency.reference_row(
                    "small", name, dict(cfg.mesh), cfg.zero_stage, variant=""
                )
            collectives = []
            for label, payload in row.collectives.items():  # "kind axes" -> bytes per step
                kind, axes = label.split()[0], tuple(label.split()[1].split("+"))
                g = math.prod(cfg.mesh.get(a, 1) for a in axes)
                collectives.append(
                    {
                        "kind": kind,
                        "axes": axes,
                        "group_size": g,
                        "bytes": payload,
                        "count": 1,
                        "op_name": "",
                    }
                )
            self.cache[key] = Program(
                key, self.platform, row.flops, collectives, -1, row.temp_bytes, row.compile_seconds
            )
            print(
                f"# {self.platform}: {key} compiled in {row.compile_seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        return self.cache[key]


@dataclasses.dataclass
class Check:
    """One row: ``measure(programs) -> (value, detail)`` against ``bound``."""

    part: str
    name: str
    program: str  # the program under test (its peak memory and compile time are shown)
    measure: Callable
    bound: float
    relation: str = "<="  # "<=" or "=" (to 1%)

    def passes(self, value: float) -> bool:
        if self.relation == "=":
            return abs(value - self.bound) <= 0.01 * abs(self.bound)
        return value <= self.bound


def ratio(num: str, den: str, figure: str = "flops") -> Callable:
    def measure(ps):
        a, b = getattr(ps.get(num), figure), getattr(ps.get(den), figure)
        return a / b, f"{a:.4g} / {b:.4g}"

    return measure


def bf16_sends(ps):
    a = ps.get("1F1B bf16").bytes("collective-permute", has_axis="stage")
    b = ps.get("1F1B").bytes("collective-permute", has_axis="stage")
    return a / b, f"{a:,.0f} / {b:,.0f} bytes"


def in_passes(c) -> bool:
    """A collective of the forward or backward pass, not of the update: under ``jvp``, or run
    once per layer (the update has no loop). jax 0.12 names a collective the partitioner made
    by its ``shard_map`` only, so the name alone cannot tell."""
    return "jvp(" in c["op_name"] or c["count"] > 1


def model_gathers(only_update: bool) -> Callable:
    def measure(ps):
        p = ps.get("ZeRO-1 x TP 2")
        where = (lambda c: not in_passes(c)) if only_update else (lambda c: True)
        gathered = p.bytes("all-gather", has_axis="model", where=where)
        passes = p.bytes("all-gather", has_axis="model", where=in_passes)
        volume = efficiency.data_volume(types.SimpleNamespace(collectives=by_kind(p)))
        return gathered / volume, (
            f"{gathered:,.0f} / {volume:,.0f} bytes (the passes' gathers: {passes:,.0f})"
        )

    return measure


def by_kind(p: Program) -> dict:
    """``efficiency.by_kind``'s keys ("kind axes"), the bytes of every dtype together."""
    out: dict = {}
    for c in p.collectives:
        key = f"{c['kind']} {'+'.join(c['axes']) or '-'}"
        out[key] = out.get(key, 0.0) + c["bytes"] * c["count"]
    return out


def ring_sends(ps, *, words: bool):
    cfg = ps.config("ring attention")
    p = ps.get("ring attention")
    b = cfg.global_batch // cfg.mesh["data"]
    block = b * cfg.model.seq_len // CONTEXT * cfg.model.d_model  # words
    want = (2 * (CONTEXT - 1) + 2 * (CONTEXT - 1) + 2 * CONTEXT) * block * cfg.model.layers
    return against(p, "collective-permute", "context", want, words=words)


def moe_sends(ps, *, words: bool):
    cfg = ps.config("MoE")
    model = jobs.gpt_config(cfg)
    groups = cfg.global_batch // cfg.mesh["data"] // EXPERT  # sequences per device
    buffer = groups * model.num_experts * model.routing.capacity(model.seq_len) * model.d_model
    want = 4 * buffer * model.num_moe_layers  # words
    return against(ps.get("MoE"), "all-to-all", "expert", want, words=words)


def against(p: Program, kind: str, axis: str, want_words: int, *, words: bool):
    """The ``kind`` collectives over ``axis`` against the formula's words: in words (elements,
    whatever their dtype), or in bytes against the formula's fp32 bytes."""
    got_words = p.bytes(kind, has_axis=axis, words=True)
    got, want = (got_words, want_words) if words else (p.bytes(kind, has_axis=axis), 4 * want_words)
    by_dtype = {}
    for c in p.collectives:
        if c["kind"] == kind and axis in c["axes"]:
            by_dtype[c["dtype"]] = by_dtype.get(c["dtype"], 0) + c["bytes"] * c["count"]
    dtypes = ", ".join(f"{k} {v:,.0f} B" for k, v in sorted(by_dtype.items()))
    unit = "words" if words else "bytes"
    return got / want, f"{got:,.0f} / {want:,.0f} {unit} ({dtypes})"


def by_hand(name: str, figure: str) -> Callable:
    def measure(ps):
        mine, ref = ps.get(name + ", vocab whole"), ps.reference(name)
        if figure == "wire_bytes":
            a, b = mine.wire_bytes(), ref.wire_bytes()
            pay = mine.bytes() / ref.bytes()
            return a / b, f"{a / 2**20:.2f} / {b / 2**20:.2f} MiB (payload {pay:.3f}x)"
        a, b = getattr(mine, figure), getattr(ref, figure)
        return a / b, f"{a:.4g} / {b:.4g}"

    return measure


def flops(part: str, label: str, program: str, base: str = "DP") -> Check:
    return Check(part, f"{label}: FLOPs / {base}'s", program, ratio(program, base), 1.10)


def sends(label: str, program: str, formula: Callable) -> list[Check]:
    """The sends of ``program`` against ``formula``: in words (equal) and in bytes (at most)."""
    return [
        Check("e", f"{label}: words / formula", program, lambda ps: formula(ps, words=True),
              1.0, "="),
        Check("e", f"{label}: bytes / formula's fp32 bytes", program,
              lambda ps: formula(ps, words=False), 1.0),
    ]  # fmt: skip


CHECKS = [
    flops("a", "FSDP x TP {data: 4, model: 2}", "FSDP x TP 2"),
    flops("a", "FSDP x TP {data: 2, model: 4}", "FSDP x TP 4"),
    flops("b", "1F1B {data: 2, stage: 4}, M 8, no remat", "1F1B"),
    flops("b", "ZeroBubble {data: 2, stage: 4}, M 8, no remat", "ZeroBubble"),
    flops("b", "Interleaved 1F1B V 2, 8 layers, M 8, no remat", "Interleaved 1F1B, 8 layers",
          base="DP, 8 layers"),
    Check("c", "1F1B bf16: collective-permute bytes over stage / fp32's", "1F1B bf16",
          bf16_sends, 0.55),
    Check("d", "ZeRO-1 x TP 2: all-gather bytes over model / data-axis volume",
          "ZeRO-1 x TP 2", model_gathers(only_update=False), 0.05),
    Check("d", "ZeRO-1 x TP 2: the same, the update's gathers only",
          "ZeRO-1 x TP 2", model_gathers(only_update=True), 0.05),
    *sends("ring attention {data: 2, context: 4}: permutes over context", "ring attention",
           ring_sends),
    *sends("MoE 8 experts top 2 {data: 2, expert: 4}: all-to-alls over expert", "MoE",
           moe_sends),
    *[Check("f", f"{n}: {fig} / jit by hand's", n + ", vocab whole", by_hand(n, key), bound)
      for n in ("FSDP x TP 2", "FSDP x TP 4")
      for fig, key, bound in (("FLOPs", "flops", 1.05),
                              ("collective bytes on the wire", "wire_bytes", 1.05),
                              ("temporaries", "temp_bytes", 1.10))],
]  # fmt: skip


def measure(check: Check, ps: Programs) -> dict:
    """The check on one platform's programs; an error is a result too (and fails)."""
    try:
        value, detail = check.measure(ps)
        prog = ps.get(check.program)
        return {
            "value": value,
            "detail": detail,
            "passed": check.passes(value),
            "peak_bytes": prog.peak_bytes,
            "compile_seconds": prog.compile_seconds,
        }
    except Exception as e:  # reported as a failing row
        traceback.print_exc(file=sys.stderr)
        return {"value": None, "detail": f"error: {type(e).__name__}: {e}"[:300], "passed": False}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="all", help="comma-separated checks: a,b,c,d,e,f or all")
    p.add_argument("--target", default="v5p-16", help="a TPU target of 8 chips (default v5p-16)")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU program's figures")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "libtpu"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def table(results: list[dict], cpu: bool) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.4f}"
    head = "| check | measured | bound | result | detail | TPU peak MiB | compile s |"
    lines = [
        head + (" CPU measured | CPU result |" if cpu else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if cpu else ""),
    ]
    for r in results:
        t = r["tpu"]
        peak = t.get("peak_bytes")
        line = (
            f"| {r['part']}. {r['name']} | **{fmt(t['value'])}** | {r['relation']} "
            f"{r['bound']:.2f} | {'pass' if t['passed'] else '**FAIL**'} | {t['detail']} | "
            f"{'-' if peak is None or peak < 0 else f'{peak / 2**20:.1f}'} | "
            f"{t.get('compile_seconds', 0) or 0:.1f} |"
        )
        if cpu:
            c = r["cpu"]
            line += f" {fmt(c['value'])} | {'pass' if c['passed'] else 'FAIL'} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    parts = set("abcdef") if args.part == "all" else set(args.part.split(","))
    if not parts <= set("abcdef"):
        raise SystemExit(f"--part {args.part}: give checks among a,b,c,d,e,f (or all).")
    target = rp.targets.tpu_target(args.target)
    if target.num_devices != 8:
        raise SystemExit(
            f"--target {args.target}: {target.num_devices} chips; these meshes "
            f"need 8 (e.g. v5p-16, v4-16, v5e-8, v6e-8)."
        )
    platforms = {"tpu": Programs(target, "tpu")}
    if not args.no_cpu:
        platforms["cpu"] = Programs(target, "cpu")
    results = []
    for check in (c for c in CHECKS if c.part in parts):
        row = {
            "part": check.part,
            "name": check.name,
            "program": check.program,
            "bound": check.bound,
            "relation": check.relation,
        }
        for name, ps in platforms.items():
            row[name] = measure(check, ps)
        results.append(row)
    seconds = time.perf_counter() - start
    v = versions()
    command = "python " + " ".join(map(shlex.quote, sys.argv))
    print(
        f"Command: `{command}` ({datetime.date.today()}, Python {v['python']}, jax {v['jax']}, "
        f"libtpu {v['libtpu']}, target {target.label}, {seconds:.0f} seconds)\n"
    )
    print(
        "GPT d_model 256, 4 layers, 8 heads, seq 128, global batch 32, Adam; per device per "
        "step, read from the TPU program"
        + (", the CPU program's beside it" if "cpu" in platforms else "")
        + "\n"
    )
    print(table(results, cpu="cpu" in platforms))
    failed = [r for r in results if not r["tpu"]["passed"]]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks pass on the TPU program.")
    if args.json:
        programs = {
            f"{k}: {n}": dataclasses.asdict(p)
            for k, ps in platforms.items()
            for n, p in ps.cache.items()
        }
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": command,
                    "date": str(datetime.date.today()),
                    "versions": v,
                    "target": args.target,
                    "seconds": seconds,
                    "checks": results,
                    "programs": programs,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
