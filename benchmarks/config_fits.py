"""Every shipped config at full size, compiled for the TPU slice it is written for: does it fit?

For each ``configs/*.yaml``, ``replicator explain CONFIG --target TYPE --quick`` runs in a process
of its own (the CLI's own job code, from shapes: nothing is allocated), and libtpu compiles the
whole training step for that TPU slice here, ahead of time. The row gives the peak bytes per
chip against the chip's HBM, whether it fits, the roofline step time, XLA's estimate and the
MFU, and the compile's wall time. The test suite compiles the same configs at two layers on a
small slice (``tests/test_tpu_targets.py``); this is the full-size check.

A config whose mesh has a free axis (``-1``) goes to 8 chips (``v5p-16``), one of fixed sizes to
as many chips. The four large configs go to the slice their layout is written for (`BIG`), with
the changes that make the shipped file fit where it does not as written.

    python benchmarks/config_fits.py                      # every config (about 15 min on 2 cores)
    python benchmarks/config_fits.py --only llama2_70b,llama3_8b --json /tmp/fits.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

BIG = {  # config -> (target, overrides) for the large models, at full size
    # MaxText's v5p-512 layout: ZeRO-3 over 256 chips, remat full, 4 sequences a chip
    "llama2_70b": ("v5p-512", []),
    # Llama 2 7B, ZeRO-3 and remat full, one sequence a chip: the config is written for v5p-8
    "llama2_7b": ("v5p-8", []),
    # as shipped (no ZeRO, no remat: 120 GB of fp32 state and Adam on every chip) it fits no
    # TPU; with ZeRO-1 and remat full, 8 sequences a chip on 64 v5p chips
    "gpt_7b5": ("v5p-128", ["zero_stage=1", "model.remat=full"]),
    # as shipped (no remat) it peaks over 95 GiB even at one sequence a chip; with remat full,
    # one sequence of 8,192 tokens a chip fits on 512 chips
    "llama3_8b": ("v5p-1024", ["model.remat=full"]),
}


def target_for(name: str) -> tuple[str, list[str]]:
    """The TPU slice a config compiles for here, and the overrides it needs to fit."""
    if name in BIG:
        return BIG[name]
    from replicator.cli import config as config_lib

    mesh = config_lib.load(ROOT / "configs" / f"{name}.yaml").mesh
    fixed = math.prod(v for v in mesh.values() if v != -1)
    chips = math.lcm(fixed, 8) if -1 in mesh.values() else fixed
    return (f"v5p-{2 * chips}" if chips >= 4 else f"v5e-{chips}"), []


def measure(name: str) -> dict:
    target, overrides = target_for(name)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        command = [
            sys.executable, "-m", "replicator.cli", "explain", f"configs/{name}.yaml",
            *overrides, "--target", target, "--json", out, "--quick",
        ]  # fmt: skip
        t0 = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - t0
        if run.returncode != 0:
            return {"config": name, "target": target, "overrides": overrides, "error":
                    run.stderr.strip().splitlines()[-1:], "compile_s": seconds}  # fmt: skip
        report = json.loads(pathlib.Path(out).read_text())
    gib = 2**30
    return {
        "config": name,
        "target": target,
        "overrides": overrides,
        "peak_gib": report["peak_bytes"] / gib,
        "hbm_gib": report["hbm_bytes"] / gib,
        "fits": report["fits"],
        "step_s": report["step_seconds"],
        "xla_s": report["xla_seconds"],
        "mfu": report["mfu"],
        "compile_s": seconds,
    }


def row(r: dict) -> str:
    changes = " ".join(r["overrides"]) or "as shipped"
    if "error" in r:
        return f"| {r['config']} | {r['target']} | {changes} | refused: {r['error']} | | | | |"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
    xla = f"{r['xla_s']:.3g}" if r["xla_s"] else "-"
    return (
        f"| {r['config']} | {r['target']} | {changes} | {r['peak_gib']:.2f} of "
        f"{r['hbm_gib']:.0f} GiB | {'yes' if r['fits'] else 'NO'} | {r['step_s']:.3g} | "
        f"{xla} | {mfu} | {r['compile_s']:.0f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated config names (default: every config)")
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args()
    names = sorted(q.stem for q in (ROOT / "configs").glob("*.yaml"))
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    print(f"python benchmarks/config_fits.py {' '.join(sys.argv[1:])}".strip())
    import jax

    print(f"{datetime.date.today()}, jax {jax.__version__}, {os.cpu_count()} cores")
    print("| config | target | changes | peak per chip | fits | roofline step (s) | XLA's "
          "estimate (s) | MFU (roofline) | compile (s) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for name in names:
        rows.append(measure(name))
        print(row(rows[-1]), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
