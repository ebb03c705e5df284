"""Mixture of experts on the ``expert`` axis, 8 emulated CPU devices: the MoE GPT against a
dense GPT with the same active parameters per token, and the all-to-all bytes against the
routed tokens' bytes.

The MoE GPT has ``--experts`` experts of ``4 d_model`` hidden units in every block
(``moe_every=1``), ``top_k`` of them per token; the dense GPT's MLP has ``top_k * 4 d_model``
hidden units, so each token meets the same number of weights. Both run on ``{"data": 2,
"expert": 4}`` (the expert axis shares out each replica's sequences outside the experts, as a
data axis would), SGD by ``repl.wrap_optimizer``.

1. **Per-device FLOPs, memory and collectives** from ``repl.explain``: the all-to-alls on
   ``expert`` against their formula: each MoE block sends its capacity buffers ``[G, E, C, D]``
   (``G`` the device's sequences, ``C = ceil(capacity_factor * S * top_k / E)``) to the experts
   and back, forward and backward, 4 buffers a block, of which ``(N - 1) / N`` leave a device of
   the ``N``-device axis.
2. **Step time**: the two steps timed side by side, R rounds of K steps in rotated order,
   medians and their ratio. The MoE step does the same matmul FLOPs as the dense one plus the
   router, the dispatch and the combine (gathers), and the all-to-alls.

    python benchmarks/moe.py
    python benchmarks/moe.py --experts 8 --top-k 2 --rounds 5
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import math
import statistics
import time

import numpy as np
import optax

import replicator as rp
from replicator.models import gpt

MESH = {"data": 2, "expert": 4}


def configs(args) -> dict[str, gpt.GPTConfig]:
    base = dict(
        vocab_size=256, seq_len=args.seq, d_model=args.d_model, num_heads=4, num_layers=args.layers
    )
    moe = gpt.GPTConfig(
        **base, num_experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity
    )
    dense = gpt.GPTConfig(**base, d_ff=args.top_k * 4 * args.d_model)
    return {"moe": moe, "dense": dense}


def setup(cfg: gpt.GPTConfig, batch_size: int):
    repl = rp.Replicator(mesh_shape=MESH)
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    loss_fn = lambda p, b: gpt.loss(p, b["tokens"], b["targets"], config=cfg)

    def step(state, batch):
        params, opt, metrics = tx.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt}, {"loss": metrics["loss"]}

    placed = gpt.place(repl, gpt.init(cfg, jax.random.key(0)), config=cfg)
    rng = np.random.default_rng(0)
    t = rng.integers(0, 256, size=(batch_size, cfg.seq_len + 1)).astype(np.int32)
    batch = {"tokens": t[:, :-1], "targets": t[:, 1:]}
    return repl, step, {"params": placed, "opt": tx.init(placed)}, batch


def report(args, cfgs) -> None:
    print(f"\n## Per device per step, {MESH}, batch {args.batch} x {args.seq} tokens")
    print("| model | FLOPs | matmul FLOPs | temporaries | all-to-all bytes (expert) | formula |")
    print("|---|---|---|---|---|---|")
    for name, cfg in cfgs.items():
        repl, step, state, batch = setup(cfg, args.batch)
        r = repl.explain(step, state, batch)
        a2a = sum(c.bytes * c.count for c in r.collectives if c.kind == "all-to-all")
        want = "-"
        if cfg.num_experts:
            n = MESH["expert"]
            groups = args.batch // MESH["data"] // n
            cap = cfg.routing.capacity(cfg.seq_len)
            buffer = groups * cfg.num_experts * cap * cfg.d_model * 4
            formula = 4 * buffer * cfg.num_moe_layers
            want = f"{formula:,} ({a2a / formula:.3f}); on the wire {(n - 1) / n:.2f} of it"
        print(
            f"| {name} | {r.flops:.3e} | {r.matmul_flops:.3e} | "
            f"{r.memory.temporaries / 2**20:.2f} MiB | {a2a:,.0f} | {want} |"
        )


def timing(args, cfgs) -> None:
    runs = {}
    for name, cfg in cfgs.items():
        repl, step, state, batch = setup(cfg, args.batch)
        state, out = repl.run(step, state, batch)
        jax.block_until_ready(out)
        runs[name] = [repl, step, state, batch]
    times = {name: [] for name in runs}
    for r in range(args.rounds):
        order = list(runs)[r % 2 :] + list(runs)[: r % 2]
        for name in order:
            repl, step, state, batch = runs[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, out = repl.run(step, state, batch)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.steps)
            runs[name][2] = state
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\n## Step time, median of {args.rounds} rounds of {args.steps} steps")
    print("| model | step | ratio to dense |")
    print("|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m * 1e3:.1f} ms | {m / med['dense']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("report", "time", "all"), default="all")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", dest="top_k", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=1.25)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--d-model", dest="d_model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    assert math.prod(MESH.values()) == 8
    print(f"jax {jax.__version__}, {len(jax.devices())} emulated CPU devices")
    cfgs = configs(args)
    if args.part in ("report", "all"):
        report(args, cfgs)
    if args.part in ("time", "all"):
        timing(args, cfgs)


if __name__ == "__main__":
    main()
