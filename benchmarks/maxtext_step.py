"""MaxText's own program on replicator's yardstick: `step_seconds` and MFU of a compiled MaxText
step, read as `replicator explain --target` reads ours.

``benchmarks/maxtext_reference.py --hlo FILE`` writes MaxText's compiled step (libtpu, compile
only). This script reads that HLO with the same reader as ``explain`` (`hlo.analyze`: FLOPs and
HBM bytes per kernel with loops counted per trip, JAX's splash attention and megablox kernels
from their shapes, collectives by mesh axis, host transfers) and models its time with the same
function and chip profile (`cost_model.model_time`, the profile's fitted constants). XLA's
``optimal_seconds`` cannot rank these programs: it counts a loop body once and is negative on v6e
with libtpu 0.0.50.1.

``--mesh`` is MaxText's mesh in its axis order, named as replicator's axes: FSDP (``fsdp``,
``fsdp_transpose``) is ``data`` (ZeRO-3 over it), ``tensor`` is ``model``, ``expert`` is
``expert``, and FSDP across slices is ``dcn_data``: its collectives then overlap compute as a
data axis's do in ours (the profile's ``overlap``), and every other axis's are exposed.

    python benchmarks/maxtext_step.py --hlo mt.hlo --target v6e-256 --mesh data=64,expert=4 \\
        --maxtext-json mt.json --model-flops 2.59e15

Prints one JSON object: the step's parts (seconds), its FLOPs, Pallas kernels' FLOPs, bytes
across each axis, host bytes, and the MFU by ``--model-flops`` (per chip; replicator's count for
the same model and batch, ``model_flops`` in ``explain --json``) and by MaxText's own count
(``model_tflops`` of ``--maxtext-json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from replicator._src.core import targets
from replicator._src.report import cost_model, hlo
from replicator._src.report.hardware import hardware_profile


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=64,expert=4"`` as ``{"data": 64, "expert": 4}``, in that order."""
    mesh = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--mesh: {part!r} is not axis=size (such as data=256)")
        mesh[name.strip()] = int(size)
    return mesh


def step_of(text: str, mesh: dict[str, int], slices: int) -> cost_model.CompiledStep:
    """The `CompiledStep` of an optimized HLO module compiled over ``mesh``."""
    costs = hlo.analyze(text, mesh, slices)
    collectives = tuple(
        cost_model.CollectiveCost(c.kind, tuple(c.axes), float(c.wire_bytes), float(c.count),
                                  getattr(c, "across", False))
        for c in costs.collectives
    )  # fmt: skip
    return cost_model.CompiledStep(
        mesh=dict(mesh), memory={}, flops=costs.flops, collectives=collectives,
        bytes_accessed=costs.bytes_accessed, roofline=costs.roofline,
        host_bytes=costs.host_bytes, kernel_flops=costs.kernel_flops,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--hlo", required=True, help="MaxText's compiled step (maxtext_reference.py --hlo)"
    )
    p.add_argument("--target", required=True, help="the TPU it was compiled for, such as v6e-256")
    p.add_argument("--slices", type=int, default=1, help="slices it spans (default 1)")
    p.add_argument(
        "--mesh",
        required=True,
        help="its mesh in MaxText's axis order, named as "
        "replicator's: data=256, or data=64,expert=4, or dcn_data=2,data=64,model=4",
    )
    p.add_argument("--model-flops", type=float, help="the model's FLOPs per chip per step")
    p.add_argument("--maxtext-json", help="maxtext_reference.py's JSON of the same program")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    mesh = parse_mesh(args.mesh)
    target = targets.tpu_target(args.target, slices=args.slices)
    hw = hardware_profile(target)
    with open(args.hlo) as f:
        step = step_of(f.read(), mesh, args.slices)
    t = cost_model.model_time(step, hw, overlap=hw.overlap)
    by_axes: dict[str, float] = {}
    for c in step.collectives:
        key = f"{c.kind} over {','.join(c.axes) or '-'}"
        by_axes[key] = by_axes.get(key, 0.0) + c.wire_bytes
    out = {
        "hlo": args.hlo, "target": args.target, "slices": args.slices, "mesh": mesh,
        "hardware": hw.name, "step_seconds": t.total, "compute_seconds": t.compute,
        "ici_seconds": t.ici, "dcn_seconds": t.dcn, "host_seconds": t.host,
        "hidden_seconds": t.hidden, "flops": step.flops, "kernel_flops": step.kernel_flops,
        "host_bytes": step.host_bytes, "wire_bytes": by_axes,
    }  # fmt: skip
    if args.model_flops:
        out["model_flops"] = args.model_flops
        out["mfu"] = args.model_flops / (t.total * hw.peak_flops)
    if args.maxtext_json:
        with open(args.maxtext_json) as f:
            tflops = json.load(f).get("model_tflops")
        if tflops:
            out["maxtext_model_flops"] = tflops * 1e12
            out["mfu_by_maxtext_count"] = tflops * 1e12 / (t.total * hw.peak_flops)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
