"""MaxText's published runs, each as a replicator config: MaxText's measured MFU beside the TPU
program of the same recipe compiled here (our modelled MFU, XLA's estimate, peak memory and
whether it fits), MaxText's own program where one was compiled here, and ``replicator plan``'s
best layout.

The runs are the eight rows of MaxText's "optimized models" table (``docs/reference/models/
tiering.md`` in AI-Hypercomputer/maxtext), each written as ``configs/published/<row>.yaml``
from the recipe the table links (each file's comment names the recipe, its file and commit):

* ``llama2_70b_v5p-512``: Llama 2 70B, v5p-512 (256 chips), 65.4%;
* ``mixtral_8x7b_v5p-256``: Mixtral 8x7B, v5p-256 (128 chips, 8x4x4), 52.56%;
* ``llama2_70b_v6e-256``: Llama 2 70B, v6e-256, 43.8%;
* ``llama3.1_8b_v6e-256``: Llama 3.1 8B, v6e-256, 45.46%;
* ``llama3.1_70b_v6e-256``: Llama 3.1 70B, v6e-256, 50.33%;
* ``llama3.1_405b_v6e-256``: Llama 3.1 405B, 2 x v6e-256 (the recipe's two slices), 38.55%;
* ``mixtral_8x7b_v6e-256``: Mixtral 8x7B, v6e-256, 35.23%;
* ``mixtral_8x22b_v6e-256``: Mixtral 8x22B, v6e-256, 36.2%.

For each row:

* **explain**: ``replicator explain configs/published/ROW.yaml --target T --json`` (a process
  of its own; the TPU program compiled here by libtpu, nothing runs): ``mfu`` (our modelled
  step, ``step_seconds``), ``xla_mfu`` (XLA's ``optimal_seconds``, per layer from the step with
  one and two layers unrolled), the peak memory per chip against the HBM and ``fits``, the
  host memory an offloading remat keeps. A step the compiler refuses is recorded with the
  compiler's words.
* **MaxText's own program**, from ``--maxtext-json ROW=PATH`` files that
  ``benchmarks/maxtext_reference.py`` wrote for that row: a loop-free step's ``mfu`` as it is,
  or, from steps with two layer counts unrolled (``base_num_decoder_layers=N``), XLA's
  estimate and MaxText's model FLOPs extrapolated per layer to the row's layers.
* **plan**: ``replicator plan configs/published/ROW.yaml --target T --json``: the best layout
  and its modelled MFU (``--no-plan`` skips it).

Results are kept per row in ``--json`` (read first if it exists), so a rerun of some rows
(``--runs``) updates those and prints the whole table. Every replicator and MaxText figure is
modelled from a program compiled here; the published ones are measured on TPUs.

    python benchmarks/published.py --json published.json                  # every row
    python benchmarks/published.py --json published.json --runs llama2_70b_v5p-512 --no-plan
    python benchmarks/published.py --json published.json --runs llama2_70b_v6e-256 \\
        --maxtext-json llama2_70b_v6e-256=l2.json --maxtext-json llama2_70b_v6e-256=l4.json
    python benchmarks/published.py --json published.json --table-only     # print the table
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# row (configs/published/<row>.yaml) -> its target, slices and MaxText's measured MFU
RUNS = {
    "llama2_70b_v5p-512": dict(title="Llama 2 70B, seq 4096", target="v5p-512", published=0.654),
    "mixtral_8x7b_v5p-256": dict(title="Mixtral 8x7B, seq 4096", target="v5p-256",
                                 published=0.5256),
    "llama2_70b_v6e-256": dict(title="Llama 2 70B, seq 4096", target="v6e-256", published=0.438),
    "llama3.1_8b_v6e-256": dict(title="Llama 3.1 8B, seq 8192", target="v6e-256",
                                published=0.4546),
    "llama3.1_70b_v6e-256": dict(title="Llama 3.1 70B, seq 8192", target="v6e-256",
                                 published=0.5033),
    "llama3.1_405b_v6e-256": dict(title="Llama 3.1 405B, seq 8192", target="v6e-256", slices=2,
                                  published=0.3855),
    "mixtral_8x7b_v6e-256": dict(title="Mixtral 8x7B, seq 4096", target="v6e-256",
                                 published=0.3523),
    "mixtral_8x22b_v6e-256": dict(title="Mixtral 8x22B, seq 4096", target="v6e-256",
                                  published=0.362),
}  # fmt: skip
# what a TPU chip's bf16 peak is, for MaxText's MFU (as benchmarks/maxtext_reference.py)
PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
EXPLAIN_KEYS = ("peak_bytes", "hbm_bytes", "fits", "over_bytes", "step_seconds", "xla_seconds",
                "xla_seconds_how", "mfu", "xla_mfu", "model_flops", "host_bytes",
                "host_transfer_bytes", "host_seconds", "fit_hint")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--runs", default=",".join(RUNS), help="comma-separated rows: " + ", ".join(RUNS)
    )
    p.add_argument("--json", help="the results, per row: read first if it exists, then updated")
    p.add_argument("--no-explain", action="store_true", help="keep the rows' explain results")
    p.add_argument("--no-plan", action="store_true", help="skip (keep) the rows' plan results")
    p.add_argument("--quick", action="store_true",
                   help="explain --quick: one compile; XLA's estimate scaled from FLOPs")  # fmt: skip
    p.add_argument(
        "--explain-json",
        action="append",
        default=[],
        metavar="ROW=PATH",
        help="read ROW's explain from a JSON `replicator explain --json` wrote",
    )
    p.add_argument(
        "--maxtext-json",
        action="append",
        default=[],
        metavar="ROW=PATH",
        help="a benchmarks/maxtext_reference.py result for ROW (repeat: 2 layer counts)",
    )
    p.add_argument("--table-only", action="store_true", help="print the table of --json only")
    args = p.parse_args()
    for name in args.runs.split(","):
        if name not in RUNS:
            p.error(f"--runs: no row {name!r}; the rows are {', '.join(RUNS)}")
    for flag in ("explain_json", "maxtext_json"):
        for item in getattr(args, flag):
            row, _, path = item.partition("=")
            if row not in RUNS or not path:
                p.error(f"--{flag.replace('_', '-')} {item!r}: give ROW=PATH, ROW one of "
                        f"{', '.join(RUNS)}")  # fmt: skip
    return args


def config_path(name: str) -> str:
    return os.path.join("configs", "published", f"{name}.yaml")


def target_args(run: dict) -> list[str]:
    slices = run.get("slices", 1)
    return ["--target", run["target"], *(["--slices", str(slices)] if slices > 1 else [])]


def why(stderr: str) -> str:
    """The lines of a failed run's stderr that say why: the CLI's refusal, Python's error or
    the TPU compiler's own words; else its end."""
    said = [line for line in stderr.splitlines()
            if re.match(r"(F\d{4} |\w*(Error|Exception)\b|replicator (explain|plan): )", line)]  # fmt: skip
    return "\n".join(said)[-2000:] or stderr[-2000:]


def cli(args: list[str], what: str) -> tuple[dict | None, float, str]:
    """``replicator ARGS --json F`` in a process of its own: its JSON, wall seconds and why it
    failed (if it did)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "replicator.cli", *args, "--json", out],
                             cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
        seconds = time.perf_counter() - start
        print(f"  {what}: {seconds:.0f} s (exit {run.returncode})", file=sys.stderr, flush=True)
        data = json.load(open(out)) if os.path.exists(out) else None
        return data, seconds, "" if data else why(run.stderr)


def explain_figures(data: dict) -> dict:
    return {k: data.get(k) for k in EXPLAIN_KEYS if k in data}


def explained(name: str, quick: bool) -> dict:
    run = RUNS[name]
    args = ["explain", config_path(name), *target_args(run), *(["--quick"] if quick else [])]
    data, seconds, err = cli(args, "explain")
    if data is None:
        return {"explain": None, "explain_error": err, "explain_seconds": seconds, "quick": quick}
    return {"explain": explain_figures(data), "explain_seconds": seconds, "quick": quick}


def planned(name: str) -> dict:
    run = RUNS[name]
    data, seconds, err = cli(["plan", config_path(name), *target_args(run), "--out", os.devnull],
                             "plan")  # fmt: skip
    if not data or not data.get("ranked"):
        return {"plan": None, "plan_error": err or "no layout fits", "plan_seconds": seconds}
    best = data["ranked"][0]
    compiled = best.get("compiled") or {}
    return {"plan": {"layout": best.get("layout"),
                     "peak_bytes": (compiled.get("memory") or {}).get("peak"),
                     "mfu": (best.get("time") or {}).get("mfu"),
                     "layouts": len(data["ranked"]) + len(data.get("rejected", []))},
            "plan_seconds": seconds}  # fmt: skip


def maxtext_figures(name: str, paths: list[str]) -> dict | None:
    """MaxText's own program of the row, from maxtext_reference.py's JSON: a loop-free step's
    MFU as it is, or XLA's estimate and the model FLOPs of two unrolled layer counts
    extrapolated per layer to the row's layers."""
    from replicator.cli import config as config_lib

    layers = config_lib.load(os.path.join(ROOT, config_path(name))).model.layers
    results = [json.load(open(p)) for p in paths]
    few = {int(r["overrides"]["base_num_decoder_layers"]): r for r in results
           if "base_num_decoder_layers" in r.get("overrides", {})}  # fmt: skip
    whole = [r for r in results if "base_num_decoder_layers" not in r.get("overrides", {})]
    out: dict = {"maxtext": (results[0].get("maxtext") if results else None),
                 "jax": results[0].get("jax") if results else None,
                 "libtpu": results[0].get("libtpu") if results else None}  # fmt: skip
    for r in whole:
        out["peak_bytes"] = r["peak_memory_bytes"]
        if r.get("mfu") is not None:
            out.update(mfu=r["mfu"], xla_seconds=r["xla_optimal_seconds"], how="its whole step")
    if len(few) >= 2 and "mfu" not in out:
        (n1, a), (n2, b) = sorted(few.items())[:2]
        per = lambda key: (b[key] - a[key]) / (n2 - n1)
        seconds = a["xla_optimal_seconds"] + (layers - n1) * per("xla_optimal_seconds")
        tflops = a["model_tflops"] + (layers - n1) * per("model_tflops")
        peak = PEAK_FLOPS[RUNS[name]["target"].split("-")[0]]
        out.update(mfu=tflops * 1e12 / (seconds * peak), xla_seconds=seconds,
                   how=f"{n1} and {n2} layers unrolled ({a['xla_optimal_seconds'] * 1e3:.4g} and "
                       f"{b['xla_optimal_seconds'] * 1e3:.4g} ms), extrapolated to {layers}")  # fmt: skip
        for n, r in ((n1, a), (n2, b)):
            out[f"peak_bytes_{n}_layers"] = r["peak_memory_bytes"]
    return out if "mfu" in out or "peak_bytes" in out else None


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def table(results: dict) -> str:
    lines = [
        "| row | target | published (measured) | ours: predicted MFU | XLA's MFU | peak GiB / HBM, "
        "fits | MaxText's program, XLA's MFU | plan's best: layout, MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in RUNS:
        row = results["runs"].get(name)
        if row is None:
            continue
        run, e, mt, best = RUNS[name], row.get("explain"), row.get("maxtext"), row.get("plan")
        target = (
            run["target"] if run.get("slices", 1) == 1 else f"{run['slices']} x {run['target']}"
        )
        cells = [f"{run['title']} (`{name}`)", target, f"{100 * run['published']:.4g}%"]
        if e is None:
            error = (row.get("explain_error") or "not run").strip().splitlines()
            cells += [f"does not compile: {error[-1][:140] if error else ''}...", "-", "-"]
        else:
            fits = "fits" if e.get("fits") else "**over HBM**"
            xla = e.get("xla_mfu")
            xla = _pct(xla) if xla is None or xla <= 1 else f"({_pct(xla)}: kernels unseen)"
            cells += [_pct(e.get("mfu")), xla,
                      f"{_gib(e.get('peak_bytes'))} / {_gib(e.get('hbm_bytes'))}, {fits}"]  # fmt: skip
        cells.append("-" if not mt or mt.get("mfu") is None else _pct(mt["mfu"]))
        if best is None:
            cells.append("-" if "plan_error" not in row else f"none: {row['plan_error'][:120]}")
        else:
            lay = " ".join(f"{k}={v}" for k, v in (best.get("layout") or {}).items()
                           if v not in (None, 1, False) and k != "attention")  # fmt: skip
            cells.append(f"`{lay}`, {_pct(best.get('mfu'))}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    results = {"runs": {}}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)
    if not args.table_only:
        explain_json = dict(item.split("=", 1) for item in args.explain_json)
        maxtext_json: dict[str, list[str]] = {}
        for item in args.maxtext_json:
            row, path = item.split("=", 1)
            maxtext_json.setdefault(row, []).append(path)
        for name in args.runs.split(","):
            print(f"{name} on {RUNS[name]['target']}", file=sys.stderr, flush=True)
            row = results["runs"].setdefault(name, {})
            row["date"] = datetime.date.today().isoformat()
            row["versions"] = {k: importlib.metadata.version(k) for k in ("jax", "libtpu")}
            if name in explain_json:
                with open(explain_json[name]) as f:
                    row.update(explain=explain_figures(json.load(f)), explain_seconds=None)
                row.pop("explain_error", None)
            elif not args.no_explain:
                row.pop("explain_error", None)
                row.update(explained(name, args.quick))
            if name in maxtext_json:
                row["maxtext"] = maxtext_figures(name, maxtext_json[name])
            if not args.no_plan:
                row.pop("plan_error", None)
                row.update(planned(name))
            if args.json:  # after each row: a long run keeps what it finished
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1, default=str)
    print(table(results))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
