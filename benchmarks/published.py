"""`replicator plan` against published runs: MaxText's measured MFU for its own layouts, next to
replicator's program of the same layout, batch and sequence (priced by the planner's formulas
and compiled for the same TPU target), and the planner's own best layout.

The runs are the rows of MaxText's "optimized models" table (``docs/reference/models/
tiering.md`` in AI-Hypercomputer/maxtext, https://maxtext.readthedocs.io/en/latest/reference/
models/tiering.html), each with the recipe it links to:

* Llama 2 70B on v5p-512 (256 chips): 65.4%, ``benchmarks/maxtext_v5p_model_configs.py``
  (``llama2_70b_v5p_128`` at 92e59fdf5): FSDP over every chip, 4 sequences of 4,096 tokens a
  chip, remat ``save_dot_except_mlpwi``, splash attention, bf16 compute with fp32 weights;
* Llama 3.1 8B on v6e-256: 45.46%, tpu-recipes ``training/trillium/Llama3.1-8B-MaxText/
  v6e-256`` (``llama3_1_8b_8192``): FSDP over 256 chips, 4 sequences of 8,192 tokens a chip,
  splash attention, the layer inputs and q/k/v/out projections offloaded to the host;
* Mixtral 8x7B on v5p-256 (128 chips, 8x4x4): 52.56%, tpu-recipes ``training/v5p/
  Mixtral-8X7B-Maxtext/scripts/run_mixtral-8x7b.sh``: FSDP over every chip, 36 sequences of
  4,096 tokens a chip, remat full, dropless experts through megablox.

For each: the published MFU; replicator's step with MaxText's layout, priced (`rp.planner.Price`,
the modelled time on the chip's profile) and compiled for the target (``replicator explain
--target``: peak memory, XLA's estimate and the roofline's MFU); and ``replicator plan
--target``'s best. Everything is compiled here by libtpu; nothing runs on a TPU, so every
replicator figure is modelled, the published ones measured.

    python benchmarks/published.py                    # every run (about 15 min on 2 cores)
    python benchmarks/published.py --runs llama2_70b --json results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MIXTRAL_8X7B = [
    "model.d_model=4096", "model.layers=32", "model.heads=32", "model.kv_heads=8",
    "model.d_ff=14336", "model.vocab=32000", "model.seq_len=4096", "model.experts=8",
    "model.top_k=2", "model.dtype=bfloat16", "model.remat=full", "model.attention=splash",
]  # fmt: skip
RUNS = {
    "llama2_70b": dict(
        title="Llama 2 70B, v5p-512 (256 chips), 4 x 4,096 tokens a chip",
        target="v5p-512", config="configs/llama2_70b.yaml", overrides=[],
        published=0.654, layout=dict(data=256, zero_stage=3, remat=True),
        differs="remat full (MaxText: save_dot_except_mlpwi)",
    ),
    "llama3_1_8b": dict(
        title="Llama 3.1 8B, v6e-256, 4 x 8,192 tokens a chip",
        target="v6e-256", config="configs/llama3_8b.yaml",
        overrides=["global_batch=1024", "model.attention=splash", "model.remat=full"],
        published=0.4546, layout=dict(data=256, zero_stage=3, remat=True),
        differs="remat full (MaxText: offloads the layer inputs and projections to the host)",
    ),
    "mixtral_8x7b": dict(
        title="Mixtral 8x7B, v5p-256 (128 chips), 36 x 4,096 tokens a chip",
        target="v5p-256", config="configs/mixtral_tiny.yaml",
        overrides=[*MIXTRAL_8X7B, "global_batch=4608", "mesh.data=-1", "mesh.expert=1",
                   "mesh.model=1", "zero_stage=3"],
        published=0.5256, layout=dict(data=128, zero_stage=3, remat=True),
        differs="dropless experts computed densely (MaxText: megablox's grouped matmul)",
    ),
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--no-explain", action="store_true", help="skip the compiled MaxText layout")
    p.add_argument("--no-plan", action="store_true", help="skip the planner's own search")
    return p.parse_args()


def priced(run: dict) -> dict:
    """MaxText's layout priced by the planner's formulas: peak memory and modelled MFU."""
    import replicator as rp
    from replicator._src.planner import pricing
    from replicator._src.report.cost_model import model_time
    from replicator.cli import config as config_lib
    from replicator.cli import jobs
    from replicator.models import gpt

    cfg = config_lib.load(os.path.join(ROOT, run["config"]), run["overrides"])
    shape = gpt.model_shape(jobs.gpt_config(cfg), cfg.global_batch)
    if shape is None:
        return {"priced": None, "why": "not priced: a mixture of experts"}
    price = pricing.price(rp.planner.Layout(**run["layout"]), shape)
    profile = rp.planner.hardware_profile(rp.targets.tpu_target(run["target"]))
    t = model_time(price.step(), profile, model_flops=jobs.model_flops(cfg))
    return {"priced": {"peak_bytes": price.peak_bytes, "seconds": t.total, "mfu": t.mfu}}


def cli(args: list[str], what: str) -> tuple[dict | None, float, str]:
    """``replicator ARGS --json F``: its JSON, wall seconds and the tail of stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "replicator.cli", *args, "--json", out],
                             cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
        seconds = time.perf_counter() - start
        print(f"  {what}: {seconds:.0f} s (exit {run.returncode})", file=sys.stderr, flush=True)
        data = json.load(open(out)) if os.path.exists(out) else None
        return data, seconds, run.stderr[-1500:]


def explained(run: dict) -> dict:
    mesh = [f"mesh.data={run['layout']['data']}", f"zero_stage={run['layout']['zero_stage']}"]
    data, seconds, err = cli(["explain", run["config"], *run["overrides"], *mesh, "--target",
                              run["target"]], "explain, MaxText's layout")  # fmt: skip
    if data is None:
        return {"explain": None, "explain_error": err}
    keep = ("peak_bytes", "hbm_bytes", "fits", "step_seconds", "xla_seconds", "mfu", "xla_mfu")
    return {"explain": {k: data.get(k) for k in keep}, "explain_seconds": seconds}


def planned(run: dict) -> dict:
    data, seconds, err = cli(["plan", run["config"], *run["overrides"], "--target",
                              run["target"], "--out", os.devnull], "plan")  # fmt: skip
    if not data or not data.get("ranked"):
        return {"plan": None, "plan_error": err, "plan_seconds": seconds}
    best = data["ranked"][0]
    return {"plan": {"layout": best["layout"], "peak_bytes": best["compiled"]["memory"]["peak"],
                     "mfu": best["time"]["mfu"], "priced_mfu": (best["priced_time"] or {}).get("mfu"),
                     "layouts": len(data["ranked"]) + len(data["rejected"])},
            "plan_seconds": seconds}  # fmt: skip


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def main() -> None:
    args = parse_args()
    results = {"date": datetime.date.today().isoformat(), "runs": {}}
    for name in args.runs.split(","):
        run = RUNS[name]
        print(f"{run['title']}", file=sys.stderr, flush=True)
        row = {"run": run, **priced(run)}
        if not args.no_explain:
            row.update(explained(run))
        if not args.no_plan:
            row.update(planned(run))
        results["runs"][name] = row
    print(
        "| run | published (MaxText, measured) | MaxText's layout, priced | MaxText's layout, "
        "compiled: peak, roofline MFU, XLA's MFU | planner's best: layout, peak, MFU |"
    )
    print("|---|---|---|---|---|")
    for row in results["runs"].values():
        run, p, e, best = row["run"], row.get("priced"), row.get("explain"), row.get("plan")
        cells = [run["title"], _pct(run["published"])]
        cells.append("not priced (experts)" if p is None else
                     f"{_gib(p['peak_bytes'])}, {_pct(p['mfu'])}")  # fmt: skip
        cells.append("-" if e is None else
                     f"{_gib(e['peak_bytes'])}{'' if e['fits'] else ' (over HBM)'}, "
                     f"{_pct(e['mfu'])}, {_pct(e['xla_mfu'])}")  # fmt: skip
        if best is None:
            cells.append("-")
        else:
            lay = " ".join(f"{k}={v}" for k, v in best["layout"].items()
                           if v not in (None, 1, False) and k != "attention")  # fmt: skip
            cells.append(f"`{lay}`, {_gib(best['peak_bytes'])}, {_pct(best['mfu'])}")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
