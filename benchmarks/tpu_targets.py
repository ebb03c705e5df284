"""replicator and MaxText, the same training step compiled for the same TPU target, side by side.

Both programs are compiled here, ahead of time, by libtpu (no TPU is attached and nothing runs):

* replicator's: ``replicator explain CONFIG --target TYPE`` in this process (the CLI's own job
  code, from shapes), with its layers scanned; XLA's estimate is read from the step with one
  and with two layers unrolled, extrapolated per layer (as the report says), and, with
  ``--unrolled``, from the whole step with its layers unrolled too;
* MaxText's: ``benchmarks/maxtext_reference.py`` under ``--maxtext-python`` (an environment
  with ``maxtext`` and libtpu: MaxText is a benchmark here, never a dependency), with its layers
  scanned (memory; XLA's estimate extrapolated from its step with 1 and 2 layers unrolled, as
  replicator's) and unrolled (XLA's estimate read whole), or read from ``--maxtext-json`` files
  that script wrote.

Per chip and per step: peak memory (``memory_analysis``: arguments + outputs - aliased +
temporaries), the model's FLOPs by each library's count (6 N T + causal attention), XLA's FLOPs
and its ``optimal_seconds`` (which leave out the Pallas splash-attention kernels both use), the
MFU on that estimate, and the compile time. The default is Llama 2 7B on v5p-8 (4 chips), FSDP
over the 4 chips, one sequence of 4,096 tokens per chip, remat full, AdamW, fp32 weights and
bf16 compute: ``configs/llama2_7b.yaml`` against MaxText's ``llama2-7b``.

    python benchmarks/tpu_targets.py --maxtext-python /path/to/maxtext-venv/bin/python
    python benchmarks/tpu_targets.py --maxtext-json scan.json --maxtext-json unrolled.json
    python benchmarks/tpu_targets.py --config configs/llama3_8b.yaml --target v5p-64 --no-maxtext
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "llama2_7b.yaml"))
    p.add_argument("--target", default="v5p-8")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.add_argument("--maxtext-model", default="llama2-7b", help="MaxText's model_name")
    p.add_argument("--maxtext-python", help="an interpreter with maxtext and libtpu installed")
    p.add_argument("--maxtext-json", action="append", default=[],
                   help="maxtext_reference.py results to read instead (scanned and unrolled)")  # fmt: skip
    p.add_argument("--no-maxtext", action="store_true", help="replicator's figures only")
    p.add_argument("--unrolled", action="store_true",
                   help="also compile replicator's step with its layers unrolled")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def replicator_figures(config_path: str, target_name: str, overrides: list[str]) -> dict:
    import replicator as rp
    from replicator.cli import config as config_lib
    from replicator.cli import targets

    target = rp.targets.tpu_target(target_name)
    config = config_lib.load(config_path, overrides)
    start = time.perf_counter()
    report = targets.explain(config, target)
    seconds = time.perf_counter() - start
    t = report.target
    return {
        "library": "replicator",
        "layers": "scanned",
        "peak_memory_bytes": report.memory.peak,
        "model_tflops": t.model_flops / 1e12 if t.model_flops else None,
        "xla_flops": report.xla_flops,
        "flops_per_trip": report.flops,
        "kernel_flops": report.kernel_flops,
        "xla_seconds": t.xla_seconds,
        "xla_seconds_how": t.xla_seconds_how,
        "mfu": t.xla_mfu,
        "step_seconds": t.step_seconds,
        "roofline_mfu": t.mfu,
        "compile_seconds": report.compile_seconds,
        "explain_seconds": seconds,
        "fits": t.fits,
    }


def maxtext_figures(args: argparse.Namespace, layers: int) -> list[dict]:
    """MaxText's rows: its step scanned and unrolled, and, from its step with 1 and with 2
    layers unrolled (``base_num_decoder_layers``), XLA's estimate of the scanned step
    extrapolated to ``layers`` as replicator's report extrapolates its own."""
    results = [json.load(open(path)) for path in args.maxtext_json]
    if not results and args.maxtext_python and not args.no_maxtext:
        runs = [("true", []), ("false", [])]
        runs += [("false", [f"base_num_decoder_layers={n}", "override_model_config=true"])
                 for n in (1, 2)]  # fmt: skip
        for scan, extra in runs:
            cmd = [args.maxtext_python, os.path.join(HERE, "maxtext_reference.py"),
                   "--model", args.maxtext_model, "--topology", args.target,
                   "--scan-layers", scan, *extra]  # fmt: skip
            print("running:", " ".join(cmd), file=sys.stderr, flush=True)
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout[out.stdout.index("{") :]))
    few = {}  # layer count -> XLA's estimate of the step with that many layers unrolled
    for r in results:
        n = r.get("overrides", {}).get("base_num_decoder_layers")
        if n is not None:
            few[int(n)] = r["xla_optimal_seconds"]
    results = [r for r in results if "base_num_decoder_layers" not in r.get("overrides", {})]
    rows = []
    for r in results:
        scanned = r.get("scan_layers") in (True, "true")
        row = {
            "library": f"MaxText {r.get('maxtext', '')}".strip(),
            "layers": "scanned" if scanned else "unrolled",
            "peak_memory_bytes": r["peak_memory_bytes"],
            "model_tflops": r["model_tflops"],
            "xla_flops": r["xla_flops"],
            "xla_seconds": None if scanned else r["xla_optimal_seconds"],
            "xla_seconds_how": "counts the layer loop once" if scanned else "as XLA gives it",
            "mfu": None if scanned else r["mfu"],
            "compile_seconds": r["compile_seconds"],
            "jax": r.get("jax"), "libtpu": r.get("libtpu"),
        }  # fmt: skip
        if scanned and 1 in few and 2 in few:  # the loop counted once: read per layer instead
            x1, x2 = few[1], few[2]
            seconds = x1 + (layers - 1) * (x2 - x1)
            row["xla_seconds"] = seconds
            row["xla_seconds_how"] = (
                f"optimal_seconds of its step with 1 and 2 layers unrolled ({x1 * 1e3:.4g} "
                f"and {x2 * 1e3:.4g} ms), extrapolated to {layers} layers"
            )
            row["mfu"] = r["model_tflops"] * 1e12 / (seconds * r["peak_flops_per_chip"])
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def gib(x):
        return f"{x / 2**30:.2f} GiB ({x / 1e9:.2f} GB)"

    def fmt(x, f):
        return "-" if x is None else f(x)

    lines = [
        "| program | layers | peak memory per chip | model TFLOP per chip | XLA's FLOPs | XLA's "
        "estimate | MFU on it | compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['library']} | {r['layers']} | {gib(r['peak_memory_bytes'])} | "
            f"{fmt(r['model_tflops'], lambda x: f'{x:.1f}')} | "
            f"{fmt(r['xla_flops'], lambda x: f'{x:.3e}')} | "
            f"{fmt(r['xla_seconds'], lambda x: f'{x:.3f} s')} | "
            f"{fmt(r['mfu'], lambda x: f'{x:.1%}')} | {r['compile_seconds']:.0f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.no_maxtext and (args.maxtext_json or args.maxtext_python):
        raise SystemExit("--no-maxtext with --maxtext-json/--maxtext-python: choose one.")
    ours = replicator_figures(args.config, args.target, args.overrides)
    rows = [ours]
    if args.unrolled:
        unrolled = replicator_figures(
            args.config, args.target, [*args.overrides, "model.scan_layers=false"]
        )
        unrolled["layers"] = "unrolled"
        rows.append(unrolled)
    from replicator.cli import config as config_lib

    layers = config_lib.load(args.config, args.overrides).model.layers
    mt_rows = maxtext_figures(args, layers)
    rows += mt_rows
    versions = {
        "jax": importlib.metadata.version("jax"),
        "libtpu": importlib.metadata.version("libtpu"),
    }
    print(f"# {os.path.relpath(args.config, ROOT)} on {args.target}, {datetime.date.today()}, "
          f"jax {versions['jax']}, libtpu {versions['libtpu']}")  # fmt: skip
    print(table(rows))
    print(f"\nreplicator's XLA estimate: {ours['xla_seconds_how']}")
    for r in mt_rows:
        if r["layers"] == "scanned" and r["xla_seconds"] is not None:
            print(f"{r['library']}'s XLA estimate, scanned: {r['xla_seconds_how']}")
    print(f"replicator's roofline: {ours['step_seconds']:.3f} s, MFU {ours['roofline_mfu']:.1%}")
    print("command: python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "versions": versions, "argv": sys.argv[1:]}, f, indent=2)


if __name__ == "__main__":
    main()
