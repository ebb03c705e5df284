"""Attention kernels on a TPU target: XLA's blockwise kernel against the splash Pallas kernel.

Llama 3 8B's shapes (``configs/llama3_8b.yaml``) cut to ``--layers`` layers, compiled for a TPU
target (default ``v5p-8``: 4 chips) by ``replicator explain --target`` (the CLI's own code, in
this process), with the attention's kernel chosen by `kernels.forced`: ``xla`` (the blockwise
kernel, 64-key tiles and an online softmax, as every path ran before) or ``splash`` (the TPU's
Pallas kernel: whole sequences, each block of the ring, each device's heads after the
all-to-all). One row per program:

1. ``--part memory``: the program's temporaries per device at sequence 4,096 and 8,192 on
   ``{data: 4}`` (one sequence per chip, attention on one device): neither kernel holds the
   ``S x S`` scores, so both grow with ``S``, not ``S^2``.
2. ``--part time``: the step's time by the library's roofline (``step_seconds``) and by XLA's
   estimate (``xla_seconds``, which does not see into Pallas kernels: the report adds their
   FLOPs, ``kernel_flops``, at the chip's peak) at 8,192 tokens, on ``{data: 4}`` (one device's
   attention) and ``{data: 2, context: 2}`` with ``ring`` and ``all_to_all``.
3. ``--part ring``: the ring's ``collective-permute`` bytes over ``context`` against the formula
   with the key/value heads: per layer, forward ``2 (C - 1)`` blocks of K and V, backward ``2
   (C - 1) + 2 C`` (K, V, then dK, dV home), a block ``b x S / C x kv_heads x head_dim`` words:
   K and V in the compute dtype (bf16), dK and dV in fp32 round the ring (they are summed
   there) and in bf16 on their last hop home (the TPU compiler sends them after their cast).

    python benchmarks/attention_kernels.py
    python benchmarks/attention_kernels.py --part ring --target v5p-16
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_platforms", "cpu")

import argparse
import contextlib
import io
import json
import os
import tempfile
import time

from replicator._src.sharded import kernels
from replicator.cli import main as cli

CONFIG = "configs/llama3_8b.yaml"


def explain(args, kernel: str, seq: int, mesh: dict, attention: str) -> dict:
    """The JSON report of ``replicator explain --target`` for one program (kept in
    ``--cache``, so that the parts share their programs)."""
    key = f"{args.target} {args.layers} {kernel} {seq} {json.dumps(mesh)} {attention}"
    cache = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache) as f:
            cache = json.load(f)
    if key not in cache:
        cache[key] = _explain(args, kernel, seq, mesh, attention)
        if args.cache:
            with open(args.cache, "w") as f:
                json.dump(cache, f)
    return cache[key]


def _explain(args, kernel: str, seq: int, mesh: dict, attention: str) -> dict:
    batch = mesh.get("data", 1) * args.per_replica
    overrides = [
        f"model.layers={args.layers}", f"model.seq_len={seq}", f"model.attention={attention}",
        f"global_batch={batch}", *(f"mesh.{a}={n}" for a, n in mesh.items()),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        argv = ["explain", CONFIG, *overrides, "--target", args.target, "--json", path]
        if args.quick:
            argv.append("--quick")
        t0 = time.perf_counter()
        with kernels.forced(kernel), contextlib.redirect_stdout(io.StringIO()):
            cli(argv)
        with open(path) as f:
            report = json.load(f)
    report["compile_seconds"] = time.perf_counter() - t0
    return report


def field(report: dict, *names):
    for name in names:
        for part in (report, report.get("target", {}) or {}, report.get("memory", {}) or {}):
            if isinstance(part, dict) and name in part:
                return part[name]
    return None


def row(label: str, r: dict) -> str:
    temps = field(r, "temporaries")
    step, xla = field(r, "step_seconds"), field(r, "xla_seconds")
    kflops = field(r, "kernel_flops") or 0.0
    fmt = lambda s: "n/a" if s is None else f"{s * 1e3:.1f} ms"
    return (
        f"| {label} | {temps / 2**30:.2f} GiB | {fmt(step)} | {fmt(xla)} | {kflops:.3g} | "
        f"{r['compile_seconds']:.0f} s |"
    )


HEADER = "| program | temporaries | step_seconds | xla_seconds | kernel FLOPs | compile |\n|---|---|---|---|---|---|"


def memory(args) -> None:
    print(f"\n## Temporaries per device, {args.layers} layers, {{data: 4}}, {args.target}")
    print(HEADER)
    for seq in (4096, 8192):
        for kernel in ("xla", "splash"):
            r = explain(args, kernel, seq, {"data": 4}, "ring")
            print(row(f"S={seq} {kernel}", r), flush=True)


def step_time(args) -> None:
    print(f"\n## Step time, S=8192, {args.layers} layers, {args.target}")
    print(HEADER)
    cases = [({"data": 4}, "ring"), ({"data": 2, "context": 2}, "ring"),
             ({"data": 2, "context": 2}, "all_to_all")]  # fmt: skip
    for mesh, attention in cases:
        for kernel in ("xla", "splash"):
            r = explain(args, kernel, 8192, mesh, attention)
            label = f"{json.dumps(mesh)} {attention if 'context' in mesh else ''} {kernel}"
            print(row(label, r), flush=True)


def ring(args) -> None:
    print(f"\n## Ring collective-permute bytes over context, S=8192, {args.target}")
    print("| kernel | forward bytes | formula | backward bytes | formula |")
    print("|---|---|---|---|---|")
    c, seq, kv, hd = 2, 8192, 8, 128
    block = args.per_replica * seq // c * kv * hd * 2  # bf16
    for kernel in ("xla", "splash"):
        r = explain(args, kernel, seq, {"data": 2, "context": c}, "ring")
        ops = [x for x in r["collectives"] if x["kind"] == "collective-permute"
               and "context" in x["axes"]]  # fmt: skip
        fwd = sum(x["bytes"] * x["count"] for x in ops if "transpose" not in x["op_name"])
        bwd = sum(x["bytes"] * x["count"] for x in ops if "transpose" in x["op_name"])
        want_f = 2 * (c - 1) * block * args.layers  # K, V in bf16; dK, dV summed in fp32 on
        want_b = (2 * (c - 1) + 4 * (c - 1) + 2) * block * args.layers  # the ring, bf16 home
        print(f"| {kernel} | {fwd:,} | {want_f:,} ({fwd / want_f:.3f}) | {bwd:,} | "
              f"{want_b:,} ({bwd / want_b:.3f}) |", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="memory,time,ring")
    p.add_argument("--target", default="v5p-8")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--per-replica", dest="per_replica", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="explain --quick: one compile each")
    p.add_argument("--cache", default="", help="a JSON file of the reports compiled so far")
    args = p.parse_args()
    print(f"jax {jax.__version__}, target {args.target}")
    parts = {"memory": memory, "time": step_time, "ring": ring}
    for part in args.part.split(","):
        parts[part](args)


if __name__ == "__main__":
    main()
