"""The TPU programs of the families' full-size training steps, compiled here for a v5p.

Gemma 2 9B (``configs/gemma2_9b.yaml``, v5p-128) and Qwen3-30B-A3B
(``configs/qwen3_30b_a3b.yaml``, v5p-64): each step compiled ahead of time by libtpu (nothing
runs), read as ``replicator explain --target`` reads it. Per chip and step: peak memory against
the chip's HBM, the step's time and MFU on ``explain``'s roofline, and two checks of the
program itself:

* **no ``S x S`` array**: no array of the program has two dimensions of the sequence's length
  (splash runs the sliding-window layers with its local mask, built tile by tile from indices);
* **expert FLOPs against the routed rows**: the grouped matmuls' FLOPs (the Pallas kernels of a
  step with XLA's attention, so that they are the only kernels) over what the routed rows need,
  ``3 passes x 2 x 3 d f x tokens x top_k`` a layer (forward, and the backward's two matmuls;
  without remat, as that step is compiled): 1.0 is every row computed once, none padded.

    python benchmarks/families_tpu.py                         # both, full size
    python benchmarks/families_tpu.py --layers 2 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = {"gemma2_9b": "v5p-128", "qwen3_30b_a3b": "v5p-64"}


def compiled(config: str, target: str, overrides: list[str]):
    """``(report, hlo text)`` of the config's training step compiled for ``target``."""
    import replicator as rp
    from replicator._src.report import hlo
    from replicator.cli import config as config_lib
    from replicator.cli import jobs

    cfg = config_lib.load(os.path.join(ROOT, "configs", f"{config}.yaml"), overrides)
    from replicator.cli import targets as cli_targets

    repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=rp.tpu_devices(target))
    texts, analyze = [], hlo.analyze
    hlo.analyze = lambda text, *a, **k: texts.append(text) or analyze(text, *a, **k)
    flops = cli_targets.model_flops_per_chip(cfg, len(repl.mesh.devices.flat))
    try:
        report = repl.explain(step_fn, state, batch, model_flops=flops)
    finally:
        hlo.analyze = analyze
    return cfg, report, texts[-1]


def kernel_flops_from_shapes(report, text: str) -> float:
    """The Pallas kernels' FLOPs read from their operands' shapes (padded rows included), as
    another library's program is read: the program's own FLOPs tags taken out."""
    from replicator._src.report import hlo

    return float(
        hlo.analyze(
            re.sub(r"replicator_kernel_flops_\d+", "kernel", text), report.mesh
        ).kernel_flops
    )


def square_arrays(text: str, seq: int) -> list[str]:
    """The shapes of the program with two dimensions of ``seq`` (an ``S x S`` array)."""
    shapes = re.findall(r"\b(?:bf16|f32|s32|pred|s8|u8)\[([\d,]+)\]", text)
    return sorted({s for s in shapes if [int(d) for d in s.split(",")].count(seq) >= 2})


def expert_ratios(config: str, target: str) -> dict:
    """The grouped matmuls' FLOPs over the routed rows' (the module docstring's ratio), of a
    step of 2 layers (the same rows a layer; without remat a whole model would not fit): as
    the program's tags count them (the rows each kernel is given) and from the kernels' shapes
    (the rows padded to their tiles too)."""
    over = ["model.layers=2", "model.attention=dot_product", "model.remat=false",
            "model.moe_chunks=1"]  # fmt: skip
    cfg, report, text = compiled(config, target, over)
    m = cfg.model
    tokens = cfg.global_batch * m.seq_len / report.num_devices
    routed = 3 * 2 * 3 * m.d_model * m.d_ff * tokens * m.top_k * m.layers
    return {
        "expert_flops_over_routed": round(report.kernel_flops / routed, 4),
        "expert_flops_over_routed_from_shapes": round(
            kernel_flops_from_shapes(report, text) / routed, 4
        ),
    }


def figures(config: str, target: str, layers: int | None) -> dict:
    over = [] if layers is None else [f"model.layers={layers}"]
    start = time.perf_counter()
    cfg, report, text = compiled(config, target, over)
    t = report.target
    out = {
        "config": config, "target": target, "layers": cfg.model.layers,
        "compile_seconds": round(time.perf_counter() - start, 1),
        "peak_gib": round(t.peak_bytes / 2**30, 2), "hbm_gib": round(t.hbm_bytes / 2**30, 2),
        "fits": t.fits, "step_ms": round(1000 * t.step_seconds, 1),
        "mfu": None if t.mfu is None else round(100 * t.mfu, 1),
        "seq_by_seq_arrays": square_arrays(text, cfg.model.seq_len),
        "kernel_flops": report.kernel_flops,
    }  # fmt: skip
    if cfg.model.experts:
        out |= expert_ratios(config, target)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, help="compile this many layers (default: the config's)")
    p.add_argument("--only", choices=sorted(RUNS), action="append", help="one config")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args()
    rows = []
    for c in args.only or RUNS:
        rows.append(figures(c, RUNS[c], args.layers))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        stamp = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
        with open(args.json, "w") as f:
            json.dump({**stamp, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
