"""How long ``replicator explain`` takes to plan a mesh on this machine, from 8 to 256 devices,
and a 7.5-billion-parameter model with ZeRO 0-3 on 64 devices planned from shapes.

Each row runs ``replicator explain CONFIG key=value ... --json`` in a fresh process (the number
of emulated CPU devices is fixed when JAX starts) and reports the wall time of the whole command
(start-up, building the state, tracing, compiling, reading the program), the compile time the
report states, and a few of the report's figures.

The second table plans 112 stacked 8192x8192 layers (7.52e9 parameters, 30 GB in fp32) with
Adam and one batch row per device: the state is built with ``repl.abstract`` (nothing is
allocated) and each ZeRO stage's step compiled by ``repl.explain`` in a fresh process.
Per-device argument bytes (parameters and optimizer state; the gradient is a temporary) are set
against the ZeRO paper's formulas for fp32 Adam: 12 Psi (stage 0), 4 Psi + 8 Psi / N (stages 1
and 2), 12 Psi / N (stage 3); the collective volume (an all-reduce counted as a reduce-scatter
and an all-gather) with the paper's 2 Psi words (stages 0-2) and 3 Psi (stage 3).

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


DEVICES, LAYERS, WIDTH = 64, 112, 8192


def zero_worker(stage: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    import optax

    import replicator as rp

    start = time.perf_counter()
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.adam(1e-4), zero_stage=stage)

    def init():
        key = jax.random.key(0)
        params = {"layers": {"w": jax.random.normal(key, (LAYERS, WIDTH, WIDTH)) / WIDTH**0.5}}
        if stage == 3:
            params = opt.shard_params(params, stacked=["layers"])
        else:
            params = repl.replicate(params)
        return {"params": params, "opt": opt.init(params)}

    @jax.checkpoint
    def layer(h, p):
        return jnp.tanh(h @ rp.gather_params(p)["w"]), None

    def loss_fn(params, batch):
        h, _ = jax.lax.scan(layer, batch["x"], params["layers"])
        return jnp.mean((h - batch["y"]) ** 2)

    def step(state, batch):
        params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    state = repl.abstract(init)
    rows = jax.ShapeDtypeStruct((DEVICES, WIDTH), jnp.float32)
    report = repl.explain(step, state, {"x": rows, "y": rows})
    seconds = time.perf_counter() - start
    print(json.dumps({
        "stage": stage,
        "seconds": seconds,
        "arguments": report.memory.arguments,
        "temporaries": report.memory.temporaries,
        "peak": report.memory.peak,
        "collective_bytes": report.collective_bytes,
        # all-reduce = reduce-scatter + all-gather: the paper's volume counts it twice
        "volume_bytes": report.collective_bytes + report.bytes_by(kind="all-reduce"),
        "params": LAYERS * WIDTH * WIDTH,
    }))  # fmt: skip


def zero_plan() -> list[dict]:
    """The 7.5e9-parameter ZeRO 0-3 plans from shapes, one fresh process per stage."""
    print(
        "\n7.5e9 parameters (112 stacked 8192x8192 layers, Adam, fp32), 64 devices, from shapes:\n"
    )
    results = []
    print("| ZeRO stage | plan s (wall) | arguments GiB/device | paper GiB/device | ratio | "
          "peak GiB/device | collective volume GiB/device/step | paper volume GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    gib = 2**30
    for stage in (0, 1, 2, 3):
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, __file__, "--zero-worker", str(stage)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - start
        r = json.loads(out.stdout.strip().splitlines()[-1])
        psi, n = r["params"], DEVICES
        paper = {0: 12 * psi, 1: 4 * psi + 8 * psi / n, 2: 4 * psi + 8 * psi / n}.get(
            stage, 12 * psi / n
        )
        print(
            f"| {stage} | {wall:.1f} | {r['arguments'] / gib:.2f} | {paper / gib:.2f} | "
            f"{r['arguments'] / paper:.4f} | {r['peak'] / gib:.2f} | "
            f"{r['volume_bytes'] / gib:.2f} | {(3 if stage == 3 else 2) * 4 * psi / gib:.2f} |",
            flush=True,
        )
        results.append(r | {"wall_seconds": wall, "paper_bytes": paper})
    return results


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
    zero = zero_plan()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": today, "results": results, "zero_7b": zero}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zero-worker"]:
        zero_worker(int(sys.argv[2]))
    else:
        main()
