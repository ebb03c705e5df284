"""Parameters and optimizer state in host memory, read from the TPU program: what leaves HBM.

For one config and TPU target, ``replicator explain CONFIG --target T --quick --json`` runs in
a process of its own three times: as written, with ``offload_optimizer=true``, and with
``offload_params=true offload_optimizer=true``. Each row gives what libtpu's program holds per
chip: the HBM peak, the host memory, the bytes it moves between host and chip per step, the
step time (fitted roofline, the host link overlapping compute) and the MFU.

    python benchmarks/offload.py                                       # Llama 2 7B on v5p-8
    python benchmarks/offload.py --config configs/llama2_70b.yaml --target v5p-512 \\
        --json /tmp/offload.json

Use an interpreter with jax 0.12 and libtpu 0.0.50.1 (Python 3.12): the CLI is started with
``sys.executable``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = {
    "as written": [],
    "offload_optimizer": ["offload_optimizer=true"],
    "offload_params + offload_optimizer": ["offload_params=true", "offload_optimizer=true"],
}


def explain(config: str, target: str, overrides: list[str]) -> dict:
    """One ``replicator explain --quick --json`` report, and its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "report.json"
        command = [sys.executable, "-m", "replicator.cli", "explain", config, *overrides,
                   "--target", target, "--quick", "--json", str(out)]  # fmt: skip
        env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        start = time.perf_counter()
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
        report = json.loads(out.read_text())
    report["wall_seconds"] = time.perf_counter() - start
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/llama2_7b.yaml")
    p.add_argument("--target", default="v5p-8")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    rows = []
    for name, overrides in VARIANTS.items():
        r = explain(args.config, args.target, overrides)
        rows.append({
            "variant": name, "peak_gib": r["memory"]["peak"] / 2**30,
            "host_gib": r["memory"]["host"] / 2**30, "host_link_gib": r["host_bytes"] / 2**30,
            "host_seconds": r["host_seconds"], "step_seconds": r["step_seconds"],
            "mfu": r["mfu"], "fits": r["fits"], "wall_seconds": r["wall_seconds"],
        })  # fmt: skip
        print(f"{name}: {rows[-1]}", file=sys.stderr)
    import jax

    print(f"{args.config} on {args.target}, jax {jax.__version__}, "
          f"{datetime.date.today().isoformat()}")  # fmt: skip
    print("| variant | peak a chip | host memory a chip | host link a step | step (roofline) "
          "| MFU | fits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_gib']:.2f} GiB | {r['host_gib']:.2f} GiB | "
              f"{r['host_link_gib']:.2f} GiB ({r['host_seconds'] * 1e3:.0f} ms) | "
              f"{r['step_seconds'] * 1e3:.0f} ms | {100 * r['mfu']:.1f}% | {r['fits']} |")  # fmt: skip
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
