"""How long ``replicator explain`` takes to plan a mesh on this machine, from 8 to 256 devices.

Each row runs ``replicator explain CONFIG key=value ... --json`` in a fresh process (the number
of emulated CPU devices is fixed when JAX starts) and reports the wall time of the whole command
(start-up, building the state, tracing, compiling, reading the program), the compile time the
report states, and a few of the report's figures.

    python benchmarks/explain.py
    python benchmarks/explain.py --json results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPT_PP = ["model.layers=16", "pipeline.microbatches=8"]  # 8 stages: 8 layers and M >= 8
CASES = [
    ("lm_dp.yaml", ["mesh.data=8"]),
    ("lm_pipeline.yaml", []),
    ("mlp_zero.yaml", ["mesh.data=64"]),
    ("lm_pipeline.yaml", ["mesh.data=8", "mesh.stage=8", *GPT_PP, "global_batch=256"]),
    ("lm_pipeline.yaml", ["mesh.data=16", "mesh.stage=8", *GPT_PP, "global_batch=512"]),
    ("lm_pipeline.yaml", ["mesh.data=32", "mesh.stage=8", *GPT_PP, "global_batch=1024"]),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    args = parse_args()
    today = datetime.date.today().isoformat()
    print(f"{today}: `{shlex.join(['python', *sys.argv])}`\n")
    print("| command | devices | wall s | compile s | peak MiB/device | GFLOPs/device | "
          "collective MiB/device | bubble |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config, overrides in CASES:
            path = pathlib.Path(tmp) / "report.json"
            cmd = ["replicator", "explain", f"configs/{config}", *overrides]
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "replicator.cli", *cmd[1:], "--json", str(path)],
                cwd=ROOT, check=True, capture_output=True, text=True,
            )  # fmt: skip
            wall = time.perf_counter() - start
            r = json.loads(path.read_text())
            bubble = r["pipelines"][0]["bubble_fraction"] if r["pipelines"] else None
            row = {
                "command": shlex.join(cmd),
                "devices": r["num_devices"],
                "wall_seconds": wall,
                "compile_seconds": r["compile_seconds"],
                "peak_bytes": r["memory"]["peak"],
                "flops": r["flops"],
                "collective_bytes": r["collective_bytes"],
                "bubble": bubble,
            }
            results.append(row)
            print(
                f"| `{row['command']}` | {row['devices']} | {wall:.1f} | "
                f"{row['compile_seconds']:.1f} | {mib(row['peak_bytes'])} | "
                f"{row['flops'] / 1e9:.3f} | {mib(row['collective_bytes'])} | "
                f"{'-' if bubble is None else f'{bubble:.3f}'} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": today, "results": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
