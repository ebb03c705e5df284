"""Scaling on paper: a config's TPU program on 1, 2, 4 and 8 slices, what crosses the DCN and
what it costs.

Each point is ``replicator explain CONFIG --target T --slices S --quick`` in a process of its
own (libtpu compiles the whole step for S slices here; nothing runs), with the global batch
grown with the slices (weak scaling: the same sequences a chip, as MaxText's
``per_device_batch_size``). It records the peak a chip, the step, its DCN seconds (the
collectives across slices at the profile's DCN bandwidth a chip, before overlap), the bytes
across slices a chip by collective, and the MFU:

    python benchmarks/slices.py --json slices.json                    # both curves
    python benchmarks/slices.py --json slices.json --curves llama2_70b_v5p-512 --slices 1,2
    python benchmarks/slices.py --json slices.json --table-only       # print the table again

Needs the ``tpu`` extra (libtpu). A 70B program compiles in about 100 s on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# curve -> its config, target, global batch on one slice and slice counts
CURVES = {
    "llama2_70b_v5p-512": dict(title="Llama 2 70B, seq 4096", config="configs/llama2_70b.yaml",
                               target="v5p-512", batch=1024, slices=(1, 2, 4, 8)),
    "llama3.1_70b_v6e-256": dict(title="Llama 3.1 70B, seq 8192",
                                 config="configs/published/llama3.1_70b_v6e-256.yaml",
                                 target="v6e-256", batch=1280, slices=(1, 2, 4)),
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="results, merged into the file if it exists")
    p.add_argument("--curves", default=",".join(CURVES), help="comma-separated curve names")
    p.add_argument("--slices", default=None, help="slice counts, e.g. 1,2 (default: each curve's)")
    p.add_argument("--table-only", action="store_true", help="print the table of --json only")
    args = p.parse_args()
    for name in args.curves.split(","):
        if name not in CURVES:
            p.error(f"--curves: no curve {name!r}; the curves are {', '.join(CURVES)}")
    return args


def explain(curve: dict, slices: int) -> dict:
    """One point: `replicator explain --quick --json` of the curve's config on ``slices``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        args = ["explain", curve["config"], f"global_batch={curve['batch'] * slices}",
                "--target", curve["target"], "--slices", str(slices), "--quick", "--json", out]  # fmt: skip
        env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "replicator.cli", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True)  # fmt: skip
        seconds = time.perf_counter() - start
        if not os.path.exists(out):
            return {"error": run.stderr[-2000:], "seconds": seconds}
        data = json.load(open(out))
    across: dict[str, float] = {}
    for c in data.get("collective_summary", []):
        if "dcn_data" in c["axes"]:
            across[c["kind"]] = across.get(c["kind"], 0.0) + c["wire_bytes"]
    return {
        "chips": data["num_devices"], "fits": data["fits"], "peak_bytes": data["peak_bytes"],
        "step_seconds": data["step_seconds"], "dcn_seconds": data["dcn_seconds"],
        "ici_seconds": data.get("ici_seconds"), "compute_seconds": data.get("compute_seconds"),
        "hidden_seconds": data.get("hidden_seconds"), "mfu": data["mfu"], "dcn_bytes": across,
        "hardware": data.get("hardware"), "seconds": seconds,
    }  # fmt: skip


def table(results: dict) -> str:
    lines = [
        "| run | target | slices | chips | global batch | fits | peak a chip | step | DCN | "
        "across slices, a chip a step | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, points in results.get("curves", {}).items():
        curve = CURVES[name]
        for s, p in sorted(points.items(), key=lambda kv: int(kv[0])):
            if "error" in p:
                lines.append(f"| {curve['title']} | {curve['target']} | {s} | | "
                             f"{curve['batch'] * int(s)} | error: {p['error'][-100:]} | | | | | |")  # fmt: skip
                continue
            gib = p["peak_bytes"] / 2**30
            across = ", ".join(f"{k} {v / 2**30:.3g} GiB" for k, v in sorted(p["dcn_bytes"].items())
                               if v >= 2**20) or "-"  # fmt: skip
            lines.append(
                f"| {curve['title']} | {curve['target']} | {s} | {p['chips']:,} | "
                f"{curve['batch'] * int(s):,} | {'yes' if p['fits'] else 'no'} | {gib:.2f} GiB | "
                f"{p['step_seconds'] * 1e3:,.0f} ms | {p['dcn_seconds'] * 1e3:,.0f} ms | "
                f"{across} | {p['mfu']:.1%} |"
            )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    results = json.load(open(args.json)) if os.path.exists(args.json) else {}
    if not args.table_only:
        results.update(
            date=datetime.date.today().isoformat(), jax=importlib.metadata.version("jax"),
            libtpu=importlib.metadata.version("libtpu"),
        )  # fmt: skip
        curves = results.setdefault("curves", {})
        for name in args.curves.split(","):
            curve = CURVES[name]
            counts = curve["slices"] if args.slices is None else map(int, args.slices.split(","))
            for s in counts:
                print(f"{name}: {s} slice(s)", file=sys.stderr, flush=True)
                curves.setdefault(name, {})[str(s)] = explain(curve, s)
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    print(f"jax {results.get('jax')}, libtpu {results.get('libtpu')}, {results.get('date')}")
    print(table(results))


if __name__ == "__main__":
    main()
