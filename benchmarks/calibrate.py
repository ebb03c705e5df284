"""Fit a chip generation's step-time constants to MaxText's measured runs.

`explain`'s ``step_seconds`` is the TPU program's roofline with three constants per chip
generation, each in the hardware profile (`rp.planner.Hardware`): ``matmul_efficiency`` (the
share of the peak the compiler's kernels reach), ``kernel_efficiency`` (the Pallas kernels'
share: splash attention, grouped matmuls) and ``overlap`` (the share of the data axes'
collectives and the host transfers hidden behind compute). This script fits them to the
published runs: for each row, the JSON `replicator explain CONFIG --target T --json` wrote for
the recipe's config (configs/published/), and the MFU MaxText measured. It prints the fitted
constants per generation, each row's predicted MFU, and each row's error when it is left out of
the fit (the constants fitted on the other rows of its generation).

    python benchmarks/calibrate.py --report llama2_70b_v5p-512=70b.json --report ...
    python benchmarks/calibrate.py --from-published published.json   # benchmarks/published.py's

A generation fits as many constants as it has rows, at most three, in that order: one row
``matmul_efficiency`` alone (and says it cannot be left out), two with ``kernel_efficiency``,
three or more all three. The fit ignores the constants the built-in profiles already carry
(`rp.planner.HARDWARE_PROFILES`: these, written in).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

from replicator._src.report.cost_model import CollectiveCost, CompiledStep, model_time
from replicator.planner import hardware_profile

#: MaxText's measured MFU (docs/reference/models/tiering.md), by configs/published/ name.
PUBLISHED = {
    "llama2_70b_v5p-512": 0.654, "mixtral_8x7b_v5p-256": 0.5256, "llama2_70b_v6e-256": 0.438,
    "llama3.1_8b_v6e-256": 0.4546, "llama3.1_70b_v6e-256": 0.5033,
    "llama3.1_405b_v6e-256": 0.3855, "mixtral_8x7b_v6e-256": 0.3523,
    "mixtral_8x22b_v6e-256": 0.362,
}  # fmt: skip
GRID = {
    "matmul_efficiency": [x / 200 for x in range(100, 201)],  # 0.50 .. 1.00
    "kernel_efficiency": [x / 50 for x in range(10, 51)],  # 0.20 .. 1.00
    "overlap": [x / 10 for x in range(11)],  # 0 .. 1
}
ORDER = ("matmul_efficiency", "kernel_efficiency", "overlap")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    generation: str  # the hardware profile, e.g. "tpu-v6e"
    step: CompiledStep
    model_flops: float
    published: float


def row_from_report(name: str, report: dict) -> Row:
    """A row from `replicator explain --json`'s report of the recipe's config."""
    step = CompiledStep(
        mesh=report["mesh"], memory=report["memory"], flops=report["flops"],
        collectives=tuple(CollectiveCost(c["kind"], tuple(c["axes"]), c["wire_bytes"], c["count"])
                          for c in report["collectives"]),
        roofline=tuple(tuple(k) for k in report["roofline"]),
        host_bytes=report.get("host_transfer_bytes", 0.0),
        kernel_flops=report.get("kernel_flops", 0.0),
    )  # fmt: skip
    return Row(name, report["hardware"], step, report["model_flops"], PUBLISHED[name])


def predicted(row: Row, constants: dict) -> float:
    roofline = dict.fromkeys(ORDER, 1.0) | {"fitted_on": ""}  # the profile's own fit set aside
    hw = dataclasses.replace(hardware_profile(row.generation), **(roofline | constants))
    t = model_time(row.step, hw, overlap=hw.overlap)
    return row.model_flops / (hw.peak_flops * t.total)


def fit(rows: list[Row], names: tuple[str, ...]) -> dict:
    """The constants ``names`` (the others at 1) that minimise the largest MFU error."""
    best, best_err = {}, float("inf")
    for values in itertools.product(*(GRID[n] for n in names)):
        c = dict(zip(names, values, strict=True))
        err = max(abs(predicted(r, c) - r.published) for r in rows)
        if err < best_err:
            best, best_err = c, err
    return best


def fitted_names(count: int) -> tuple[str, ...]:
    return ORDER[: max(1, min(3, count))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", action="append", default=[], metavar="ROW=PATH",
                   help="a row's `replicator explain --json` report")  # fmt: skip
    p.add_argument("--json", help="write the constants and the rows' errors here")
    args = p.parse_args()
    rows = []
    for spec in args.report:
        name, _, path = spec.partition("=")
        with open(path) as f:
            rows.append(row_from_report(name, json.load(f)))
    if not rows:
        p.error("give --report ROW=PATH for at least one row")
    out = {}
    for gen in sorted({r.generation for r in rows}):
        mine = [r for r in rows if r.generation == gen]
        names = fitted_names(len(mine))  # as many constants as rows, at most 3
        constants = fit(mine, names)
        print(f"{gen}: fitted on {', '.join(r.name for r in mine)}: "
              + ", ".join(f"{k}={v:.3f}" for k, v in constants.items()))  # fmt: skip
        rows_out = []
        for r in mine:
            others = [o for o in mine if o is not r]
            loo = None
            if others:
                loo = predicted(r, fit(others, fitted_names(len(others))))
            mfu = predicted(r, constants)
            rows_out.append({"row": r.name, "published": r.published, "predicted": mfu,
                             "left_out": loo})  # fmt: skip
            left = "-" if loo is None else f"{loo:.1%} ({(loo - r.published) * 100:+.1f})"
            print(f"  {r.name}: published {r.published:.2%}, predicted {mfu:.1%} "
                  f"({(mfu - r.published) * 100:+.1f} points); left out: {left}")  # fmt: skip
        out[gen] = {"constants": constants, "rows": rows_out}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
