"""ZeRO stages 0-3 on 8 emulated devices: per-device memory and collective bytes per step.

The model is an MLP of stacked residual layers (``x + tanh(x W + b)``, width 256) with Adam in
fp32; Psi is its number of parameters. For each ``zero_stage`` the script builds the training
step (``DistributedOptimizer.step``, ``--accumulate-steps`` 1 by default; ZeRO-3 gathers each layer's
parameters inside the layer scan, under ``jax.checkpoint``), compiles it with
``Replicator.explain`` and reports, per device:

* parameters and optimizer state: the bytes of each array's shard on one device;
* gradients: the bytes of the gradient the optimizer keeps and accumulates across micro-batches
  (the full local gradient for stages 0-1, this replica's slice for stages 2-3);
* the compiled program's temporary bytes (``memory_analysis``), for reference;
* collective bytes per step, from ``Replicator.explain`` (the optimized HLO, loops counted per
  trip): an all-reduce of B bytes counts 2B (a reduce-scatter and an all-gather of B), a
  reduce-scatter counts its input, an all-gather its output. This is the per-device volume a
  ring moves, up to the factor (N-1)/N.

The formulas for Adam in fp32 (4 bytes of parameters, 4 of gradients, 8 of moments per
parameter): 16 Psi, 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N, 16 Psi/N; and collectives of 2 Psi words
for stages 0-2, 3 Psi for stage 3.

    python benchmarks/zero.py
    python benchmarks/zero.py --accumulate-steps 4
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import datetime
import json
import shlex
import sys

import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp

WIDTH, LAYERS = 256, 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--accumulate-steps",
        type=int,
        default=1,
        help="micro-batches per step; stages 2-3 reduce-scatter once per micro-batch",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "layers": {
            "w": (rng.normal(size=(LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
            "b": np.zeros((LAYERS, WIDTH), np.float32),
        },
        "head": {"w": (rng.normal(size=(WIDTH, 1)) / np.sqrt(WIDTH)).astype(np.float32)},
    }


@jax.checkpoint
def layer(h, p):
    p = rp.gather_params(p)  # ZeRO-3: this layer's parameters, just in time; else unchanged
    return h + jnp.tanh(h @ p["w"] + p["b"]), None


def loss_fn(params, batch):
    h, _ = jax.lax.scan(layer, batch["x"], params["layers"])
    return jnp.mean((h @ rp.gather_params(params["head"])["w"] - batch["y"]) ** 2)


def shard_bytes(tree) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def measure(repl: rp.Replicator, stage: int, accumulate: int) -> dict:
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=stage, accumulate_steps=accumulate)
    params = init_params()
    params = opt.shard_params(params, stacked=["layers"]) if stage == 3 else repl.replicate(params)
    state = {"params": params, "opt": opt.init(params)}
    n = repl.num_replicas
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(16 * n, WIDTH)).astype(np.float32)}
    batch["y"] = batch["x"][:, :1]

    def step(state, batch):
        params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    report = repl.explain(step, state, batch)  # compiled, not run
    # The gradient buffer accumulated across micro-batches: the full local gradient (stages
    # 0-1), or this replica's slice of each flattened, padded leaf (stages 2-3).
    acc = jax.eval_shape(lambda: jax.tree.map(jnp.zeros_like, params))
    sizes = [int(np.prod(a.shape)) for a in jax.tree.leaves(acc)]
    if stage == 2:
        sizes = [-(-size // n) for size in sizes]
    elif stage == 3:  # the flat leaves are [.., N*c]: their slices
        sizes = [size // n for size in sizes]
    grad_bytes = 4 * sum(sizes)
    kinds = ("all-reduce", "reduce-scatter", "all-gather")
    coll = {kind: int(report.bytes_by(kind=kind)) for kind in kinds}
    return {
        "params": shard_bytes(params),
        "grads": grad_bytes,
        "opt_state": shard_bytes(state["opt"]),
        "temp": report.memory.temporaries,
        "collectives": coll,
        "collective_total": 2 * coll["all-reduce"] + coll["reduce-scatter"] + coll["all-gather"],
    }


def main() -> None:
    args = parse_args()
    repl = rp.Replicator()
    n = repl.num_replicas
    psi = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(init_params()))
    expected = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}
    command = shlex.join(["python", *sys.argv])
    today = datetime.date.today().isoformat()
    print(f"{today}, jax {jax.__version__}, N={n}, Psi={psi:,} parameters, Adam fp32: `{command}`")
    print()
    print("| stage | params | grads | Adam state | total | formula | total/formula | temp |")
    print("|---|---|---|---|---|---|---|---|")
    results = {"date": today, "jax": jax.__version__, "command": command, "psi": psi, "n": n}
    for stage in range(4):
        r = measure(repl, stage, args.accumulate_steps)
        total = r["params"] + r["grads"] + r["opt_state"]
        r |= {"total": total, "formula": expected[stage], "ratio": total / expected[stage]}
        results[f"stage{stage}"] = r
        mib = lambda b: f"{b / 2**20:.3f}"
        print(
            f"| {stage} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['opt_state'])} | "
            f"{mib(total)} | {mib(expected[stage])} | {r['ratio']:.3f} | {mib(r['temp'])} |"
        )
    print("(MiB per device)\n")
    base = results["stage0"]["collective_total"]
    print("| stage | all-reduce | reduce-scatter | all-gather | volume | vs stage 0 |")
    print("|---|---|---|---|---|---|")
    for stage in range(4):
        c = results[f"stage{stage}"]["collectives"]
        total = results[f"stage{stage}"]["collective_total"]
        print(
            f"| {stage} | {c['all-reduce'] / 2**20:.3f} | {c['reduce-scatter'] / 2**20:.3f} | "
            f"{c['all-gather'] / 2**20:.3f} | {total / 2**20:.3f} | {total / base:.2f} |"
        )
    print(f"(MiB per device per step; 2 Psi words = {8 * psi / 2**20:.3f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
