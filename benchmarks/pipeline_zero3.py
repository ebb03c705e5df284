"""ZeRO-3 inside a pipeline: reduce-scatters per step, their bytes and the peak, per schedule.

The step is the one ``replicator train configs/lm_pipeline.yaml`` runs (the CLI's job, built
from shapes by ``jobs.abstract_job`` and compiled by ``repl.explain``; nothing runs): the GPT
at d_model 256, 8 heads, seq 128, global batch 32, Adam, ``zero_stage=3`` on ``{data: 2,
stage: 4}`` with M = 8 micro-batches; 4 layers (one a stage) for GPipe, 1F1B and ZeroBubble,
8 layers (V = 2 virtual stages a device) for Circular and Interleaved1F1B. Each schedule is
compiled with ``pipeline.scatter_grads=microbatch`` (each micro-batch's backward pass
reduce-scatters its layers' gradients, as autodiff of ``rp.gather_params`` does) and ``step``
(the gradients summed whole over the micro-batches, reduce-scattered once). For each program,
read from it:

* the reduce-scatters over ``data`` per step (executions, loops per trip; in a conditional
  branch counted as often as the branch runs) and their payload (the buffer each device
  scatters), against the ideal: one reduce-scatter of each parameter's gradient a step, i.e.
  the payload of the whole model's gradients a device holds (its stage, the embedding and
  the head, whole over ``data``) and ``(N-1)/N`` of it on the wire; and the all-reduces over
  ``data`` (but the loss's), as the TPU compiler may combine reduce-scatters into one
  all-reduce (``2 (N-1)/N`` of its buffer on the wire): the wire bytes of both against the
  ideal's;
* the all-gathers over ``data`` (executions, payload);
* the peak memory (arguments + outputs - aliased + temporaries) and what ``explain`` finds
  the pipeline holding for the step (the whole stage gradients; GPipe and Circular also the
  stage's weights), against the stage's bytes.

On XLA:CPU (8 emulated devices) by default; ``--target v5p-16`` compiles the same steps for
that TPU (8 chips) through libtpu, ahead of time.

    python benchmarks/pipeline_zero3.py
    python benchmarks/pipeline_zero3.py --target v5p-16 --json /tmp/pipeline_zero3.json
    python benchmarks/pipeline_zero3.py --target v5p-16 --schedules 1f1b \
        --set model.reduce_dtype=bfloat16
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import datetime
import json
import math
import shlex
import sys
import time

import replicator as rp
from replicator.cli import config as cfg_lib
from replicator.cli import jobs, targets

MODEL = ["model.d_model=256", "model.heads=8", "model.seq_len=128", "global_batch=32"]
BASE = [*MODEL, "zero_stage=3", "mesh.data=2", "mesh.stage=4", "pipeline.microbatches=8"]
SCHEDULES = {
    "gpipe": [],
    "1f1b": [],
    "zerobubble": [],
    "circular": ["model.layers=8", "pipeline.repeats=2"],
    "interleaved": ["model.layers=8", "pipeline.repeats=2"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="a TPU target such as v5p-16 (default: XLA:CPU)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated")
    p.add_argument("--remat", default="full", help="model.remat (none, dots, full)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another config override, e.g. model.reduce_dtype=bfloat16")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def whole_bytes(state, n: int) -> dict:
    """Per device, the bytes of the parameters whole over the ``n`` data replicas: the stage
    blocks, and all (the gradients one reduce-scatter a step would carry)."""
    params = state["job"]["params"]
    out = {}
    for key, tree in (("stage", params["stages"]), ("all", params)):
        leaves = jax.tree.leaves(tree)
        out[key] = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize * n
            if "data" in str(x.sharding.spec)
            else math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in leaves
        )
    return out


def measure(schedule: str, scatter: str, args, target, devices) -> dict:
    overrides = [*BASE, f"model.remat={args.remat}", f"pipeline.schedule={schedule}",
                 f"pipeline.scatter_grads={scatter}", *SCHEDULES[schedule], *args.set]  # fmt: skip
    cfg = cfg_lib.load("configs/lm_pipeline.yaml", overrides)
    if target is not None:
        cfg = targets.mesh_on_target(cfg, target)
    repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=devices)
    r = repl.explain(step_fn, state, batch)
    n = r.mesh["data"]
    data = [c for c in r.collectives if "data" in c.axes and "stage" not in c.axes]
    rs = [c for c in data if c.kind == "reduce-scatter"]
    ag = [c for c in data if c.kind == "all-gather"]
    ar = [c for c in data if c.kind == "all-reduce" and c.bytes > 64]  # not the loss's psum
    note = r.pipelines[0]
    held = note.held_bytes or (0, 0)
    sizes = whole_bytes(state, n)
    print(f"# {r.platform}: {schedule} {scatter} compiled in {r.compile_seconds:.1f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    return {
        "schedule": schedule,
        "scatter_grads": scatter,
        "platform": r.platform,
        "replicas": n,
        "rs_count": sum(c.count for c in rs),
        "rs_bytes": sum(c.total_bytes for c in rs),
        "rs_wire": sum(c.wire_bytes for c in rs),
        "rs_dtypes": sorted({c.dtype for c in rs}),
        "ar_count": sum(c.count for c in ar),
        "ar_bytes": sum(c.total_bytes for c in ar),
        "ar_wire": sum(c.wire_bytes for c in ar),
        "ag_count": sum(c.count for c in ag),
        "ag_bytes": sum(c.total_bytes for c in ag),
        "other_data_bytes": sum(c.total_bytes for c in data if c.kind not in ("reduce-scatter",
                                                                           "all-gather")),
        "stage_bytes": sizes["stage"],
        "model_bytes": sizes["all"],
        "peak": r.memory.peak,
        "temporaries": r.memory.temporaries,
        "held_grads": held[0],
        "held_weights": held[1],
        "compile_seconds": r.compile_seconds,
    }  # fmt: skip


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def table(rows: list[dict]) -> str:
    out = [
        "| schedule | scatter_grads | reduce-scatters / step | RS payload MiB | / ideal | "
        "all-reduces / step | AR payload MiB | RS + AR wire MiB | / ideal | all-gathers / step | "
        "AG payload MiB | peak MiB | held grads MiB (stage MiB) | held weights MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n, ideal = r["replicas"], r["model_bytes"]
        wire, wire_ideal = r["rs_wire"] + r["ar_wire"], ideal * (n - 1) / n
        out.append(
            f"| {r['schedule']} | {r['scatter_grads']} | {r['rs_count']:.0f} | "
            f"{mib(r['rs_bytes'])} | **{r['rs_bytes'] / ideal:.2f}** | {r['ar_count']:.0f} | "
            f"{mib(r['ar_bytes'])} | {mib(wire)} | **{wire / wire_ideal:.2f}** | "
            f"{r['ag_count']:.0f} | {mib(r['ag_bytes'])} | {mib(r['peak'])} | "
            f"{mib(r['held_grads'])} ({mib(r['stage_bytes'])}) | {mib(r['held_weights'])} |"
        )
    return "\n".join(out)


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    target = devices = None
    if args.target:
        target = rp.targets.tpu_target(args.target)
        devices = list(targets.devices(target.name, target.slices))
    rows = []
    for schedule in args.schedules.split(","):
        for scatter in ("microbatch", "step"):
            rows.append(measure(schedule, scatter, args, target, devices))
    command = "python " + " ".join(map(shlex.quote, sys.argv))
    where = args.target or "XLA:CPU, 8 emulated devices"
    print(f"Command: `{command}` ({datetime.date.today()}, jax {jax.__version__}, {where}, "
          f"{time.perf_counter() - start:.0f} seconds)\n")  # fmt: skip
    print(
        f"GPT d_model 256, 8 heads, seq 128, batch 32, Adam, ZeRO-3, {{data: 2, stage: 4}}, "
        f"M = 8, remat {args.remat}{''.join(', ' + o for o in args.set)}; ideal: one reduce-scatter of the model's gradients a "
        f"device holds ({mib(rows[0]['model_bytes'])} MiB, 4 layers; wire (N-1)/N of it)\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
