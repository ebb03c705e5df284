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

3. **Dropless** (``--part dropless``): ``replicator explain configs/mixtral_tiny.yaml`` (4
   SwiGLU experts, top-2, ``capacity_factor: null``) on its mesh ``{data: 2, expert: 2, model:
   2}`` and on ``{data: 4, model: 2}``: the experts' matmul FLOPs and the ``expert``
   all-to-all bytes against the routed rows' (the ideal). The FLOPs are linear in the capacity
   path's slots: the steps at ``capacity_factor`` 1.0 (the routed rows exactly, ``S k / E``
   slots) and 0.5 give the rest of the step and the experts' ideal. ``--root`` runs another
   checkout's code (the figures before a change). ``--target v5p-16`` (or ``v5p-256``,
   ``v6e-256``) explains Mixtral 8x7B's shapes at 2 layers for a TPU instead, ZeRO-3, 8
   sequences of 4,096 tokens a chip, on MaxText's layout (FSDP over every chip) and with a
   4-way ``expert`` axis (`LAYOUTS`); the ideal is its formula.

    python benchmarks/moe.py
    python benchmarks/moe.py --experts 8 --top-k 2 --rounds 5
    python benchmarks/moe.py --part dropless [--root OTHER_CHECKOUT] [--target v5p-16|v5p-256|v6e-256]
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXTRAL_8X7B = [
    "model.d_model=4096", "model.layers=2", "model.heads=32", "model.kv_heads=8",
    "model.d_ff=14336", "model.vocab=32000", "model.seq_len=4096", "model.experts=8",
    "model.top_k=2", "model.dtype=bfloat16", "model.remat=full", "model.attention=splash",
    "mesh.model=1", "zero_stage=3",
]  # fmt: skip
PER_CHIP = 8  # sequences of 4,096 tokens a chip
LAYOUTS = {  # MaxText's (FSDP over every chip), then a 4-way expert axis
    "v5p-16": ({"data": 8, "expert": 1}, {"data": 2, "expert": 4}),
    "v5p-256": ({"data": 128, "expert": 1}, {"data": 32, "expert": 4}),  # 8x4x4: 128 chips
    "v6e-256": ({"data": 256, "expert": 1}, {"data": 64, "expert": 4}),
}


def explain(root: str, overrides: list[str], target: str | None = None) -> dict:
    """``replicator explain configs/mixtral_tiny.yaml OVERRIDES --json`` run in ``root``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        args = ["configs/mixtral_tiny.yaml", *overrides, "--json", out]
        args += ["--target", target, "--quick"] if target else []
        env = dict(os.environ, PYTHONPATH=root, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        run = subprocess.run([sys.executable, "-m", "replicator.cli", "explain", *args],
                             cwd=root, env=env, capture_output=True, text=True)  # fmt: skip
        if run.returncode:
            raise RuntimeError(run.stderr[-2000:])
        return json.load(open(out))


def expert_bytes(report: dict) -> float:
    is_a2a = lambda c: c["kind"].endswith("all-to-all") and c["axes"] == ["expert"]
    return sum(c["bytes"] * c["count"] for c in report["collectives"] if is_a2a(c))


def dropless_cpu(root: str) -> None:
    print(f"\n## mixtral_tiny, XLA:CPU, code of {root}: per device per step")
    print("| mesh | experts' matmul FLOPs | ideal | ratio | expert all-to-all bytes | ideal |")
    print("|---|---|---|---|---|---|")
    for mesh in (["mesh.data=2", "mesh.expert=2"], ["mesh.data=4", "mesh.expert=1"]):
        at = {cf: explain(root, [*mesh, f"model.capacity_factor={cf}"]) for cf in (1.0, 0.5)}
        per_slot = (at[1.0]["matmul_flops"] - at[0.5]["matmul_flops"]) / 16  # 32 - 16 slots
        rest = at[1.0]["matmul_flops"] - 32 * per_slot
        ideal, ideal_bytes = 32 * per_slot, expert_bytes(at[1.0])
        got = explain(root, [*mesh, "model.capacity_factor=null"])
        experts, a2a = got["matmul_flops"] - rest, expert_bytes(got)
        ratio = f"{a2a / ideal_bytes:.3f}" if ideal_bytes else "-"
        print(f"| {' '.join(mesh)} | {experts:.4e} | {ideal:.4e} | {experts / ideal:.4f} | "
              f"{a2a:,.0f} ({ratio}) | {ideal_bytes:,.0f} |")  # fmt: skip


def splash_flops(heads=32, head_dim=128, seq=4096, layers=2) -> int:
    """Splash attention's FLOPs a chip as the HLO reader counts its kernels: the forward's
    (``4 d`` a live query-key pair a head), again under remat, 1.5x for ``dq`` and 2x for
    ``dkv``: 5.5 forwards a layer."""
    from replicator._src.sharded.splash import live_pairs

    return int(5.5 * layers * 4 * head_dim * live_pairs(seq) * heads * PER_CHIP)


def dropless_tpu(root: str, target: str, expert_only: bool = False) -> None:
    """Mixtral 8x7B at 2 layers, `PER_CHIP` sequences a chip, on each of `LAYOUTS[target]`: the
    experts' ideal is 3 matmuls of 2 x rows x d x f FLOPs each, forward, recomputed (remat
    full) and twice backward. The experts' FLOPs are the kernels' less splash attention's
    (`splash_flops`, the same a chip on every layout); MaxText's layout (no ``expert`` axis)
    computes the ideal exactly, which checks that."""
    rows = PER_CHIP * 4096 * 2  # a chip's routed rows, top-2
    ideal = 2 * 4 * 3 * 2 * rows * 4096 * 14336  # 2 layers, 4 passes, 3 matmuls
    print(f"\n## Mixtral 8x7B at 2 layers on {target}, code of {root}: per chip per step")
    print(f"the experts' ideal {ideal:.4e} FLOPs ({rows:,} routed rows a chip)")
    print("| mesh | matmul FLOPs | experts' FLOPs / ideal | expert all-to-all bytes | peak | MFU |")
    print("|---|---|---|---|---|---|")
    for mesh in LAYOUTS[target][expert_only:]:
        chips = math.prod(mesh.values())
        overrides = [*MIXTRAL_8X7B, f"global_batch={PER_CHIP * chips}"]
        overrides += [f"mesh.{k}={v}" for k, v in mesh.items()]
        got = explain(root, overrides, target)
        experts = got["kernel_flops"] - splash_flops()
        print(f"| {mesh} | {got['matmul_flops']:.4e} | {experts / ideal:.4f} | "
              f"{expert_bytes(got):,.0f} | {got['peak_bytes'] / 2**30:.2f} GiB | "
              f"{got['mfu']:.1%} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("report", "time", "all", "dropless"), default="all")
    parser.add_argument("--root", default=ROOT, help="the checkout whose code --part dropless runs")
    parser.add_argument("--target", choices=sorted(LAYOUTS),
                        help="with --part dropless: Mixtral 8x7B's shapes on this TPU")  # fmt: skip
    parser.add_argument("--expert-only", dest="expert_only", action="store_true",
                        help="with --target: the layout with an expert axis only")  # fmt: skip
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
    if args.part == "dropless":
        if args.target:
            dropless_tpu(args.root, args.target, args.expert_only)
        else:
            dropless_cpu(args.root)
        return
    cfgs = configs(args)
    if args.part in ("report", "all"):
        report(args, cfgs)
    if args.part in ("time", "all"):
        timing(args, cfgs)


if __name__ == "__main__":
    main()
