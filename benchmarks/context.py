"""Context parallelism on the ``context`` axis, emulated CPU devices: memory, ring bytes and
step time against sequence length, for ``replicator.models.gpt`` with ring attention (zigzag
layout) and with all-to-all attention (DeepSpeed-Ulysses).

Each layout is ``{"data": 1, "context": C}`` on the first ``C`` of 8 emulated devices, so one
replica's sequences are split C ways and nothing else changes; the GPT is ``--layers``
pre-LayerNorm blocks with causal attention, trained with SGD by ``repl.wrap_optimizer`` (its
step is what ``replicator train`` compiles).

1. **Activation memory per device** (``repl.explain``'s temporaries, from
   ``compiled.memory_analysis()``), at two per-replica batches ``b`` and ``2b``: the
   temporaries that grow with the batch, per sequence, ``(T(2b) - T(b)) / b``, are the
   activations; they should fall as ``1/C``. What does not grow with the batch (the
   gradients of the replicated parameters, the position table's gradient, token ids) is
   reported beside them as the replicated part, ``T(b) - b * per_sequence``.
2. **Ring bytes** (``repl.explain``'s collectives on ``context``): the collective-permutes of
   the forward pass against ``2 (C - 1)`` local K and V blocks per layer, and those of the
   backward pass against ``2 (C - 1)`` K/V blocks plus ``2 C`` dK/dV blocks, a block being
   ``b x S/C x d_model`` words; the all-to-alls of ``impl="all_to_all"`` against 4 forward and
   4 backward of the local ``b x S/C x d_model`` activations per layer.
3. **Step time** against ``S`` for each ``C``: the median of ``--steps`` steps after one to
   compile. On 2 CPU cores the 8 emulated devices share the cores, so these figures show the
   work per device shrinking (the sum over devices is what the cores run), not a speed-up.
4. **The embedding's backward over the token axes** (``--part embedding``): the bytes on the
   wire per device and step of the collectives over ``context`` or ``expert`` alone (all-gathers,
   all-reduces, all), for the step ``replicator train`` compiles (``jobs.abstract_job``), with
   the cotangents gathered (as before ``layers/embedding.py``), as `embedding.lookup` chooses,
   and, where it chooses the gather, with each device's own tokens scattered: ``configs/lm_dp``
   at d_model 128 (``test_pricing``'s) on ``{data: 2, context: 4}`` and ``gpt_moe`` on
   ``{data: 2, expert: 4}``, on XLA:CPU and, with ``--target``, for that TPU slice; with
   ``--llama`` also Llama 3 8B cut to 2 layers, ring attention on ``{data: 4, context: 2}``, 8
   sequences a step (about 6 minutes a compile).

    python benchmarks/context.py
    python benchmarks/context.py --part memory --seq 1024
    python benchmarks/context.py --part embedding --target v5p-16 --llama
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import os
import statistics
import time

import numpy as np
import optax

import replicator as rp
from replicator._src.sharded import attention as attention_lib
from replicator.models import gpt

CONTEXTS = (1, 2, 4, 8)


def config(seq_len: int, args, attention: str = "ring") -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab_size=256,
        seq_len=seq_len,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        attention=attention,
    )


def setup(cfg: gpt.GPTConfig, c: int, batch: int):
    """The step, state and a batch of ``batch`` sequences on ``{"data": 1, "context": c}``."""
    repl = rp.Replicator(mesh_shape={"data": 1, "context": c}, devices=jax.devices()[:c])
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    loss_fn = lambda p, b: gpt.loss(p, b["tokens"], b["targets"], config=cfg)

    def step(state, batch):
        params, opt, metrics = tx.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt}, {"loss": metrics["loss"]}

    placed = gpt.place(repl, gpt.init(cfg, jax.random.key(0)), config=cfg)
    rng = np.random.default_rng(0)
    t = rng.integers(0, 256, size=(batch, cfg.seq_len + 1)).astype(np.int32)
    return (
        repl,
        step,
        {"params": placed, "opt": tx.init(placed)},
        {"tokens": t[:, :-1], "targets": t[:, 1:]},
    )


def memory(args) -> None:
    print(
        f"\n## Activation temporaries per device, seq_len {args.seq}, batch {args.batch} / {2 * args.batch}"
    )
    print(
        "| C | attention | temporaries (b) | temporaries (2b) | per sequence | x C / C=1 | replicated part |"
    )
    print("|---|---|---|---|---|---|---|")
    for attention in ("ring", "all_to_all"):
        base = None
        for c in CONTEXTS:
            if attention == "all_to_all" and args.heads % c:
                print(f"| {c} | {attention} | {args.heads} heads do not split {c} ways | | | | |")
                continue
            cfg = config(args.seq, args, attention)
            temps = []
            for b in (args.batch, 2 * args.batch):
                repl, step, state, batch = setup(cfg, c, b)
                temps.append(repl.explain(step, state, batch).memory.temporaries)
            per_seq = (temps[1] - temps[0]) / args.batch
            base = base or per_seq
            fixed = temps[0] - args.batch * per_seq
            print(
                f"| {c} | {attention} | {temps[0] / 2**20:.2f} MiB | {temps[1] / 2**20:.2f} MiB | "
                f"{per_seq / 2**20:.3f} MiB | {per_seq * c / base:.3f} | {fixed / 2**20:.2f} MiB |"
            )


def ring_bytes(args) -> None:
    print(f"\n## Context collectives per device per step, seq_len {args.seq}, batch {args.batch}")
    print("| C | attention | kind | forward bytes | formula | backward bytes | formula |")
    print("|---|---|---|---|---|---|---|")
    for attention, kind in (("ring", "collective-permute"), ("all_to_all", "all-to-all")):
        for c in CONTEXTS[1:]:
            cfg = config(args.seq, args, attention)
            repl, step, state, batch = setup(cfg, c, args.batch)
            report = repl.explain(step, state, batch)
            ops = [x for x in report.collectives if x.kind == kind and "context" in x.axes]
            fwd = sum(x.bytes * x.count for x in ops if "transpose" not in x.op_name)
            bwd = sum(x.bytes * x.count for x in ops if "transpose" in x.op_name)
            block = args.batch * args.seq // c * args.d_model * 4
            if attention == "ring":
                want_f = 2 * (c - 1) * block * args.layers
                want_b = (2 * (c - 1) + 2 * c) * block * args.layers
            else:
                want_f = want_b = 4 * block * args.layers
            print(
                f"| {c} | {attention} | {kind} | {fwd:,.0f} | {want_f:,} ({fwd / want_f:.3f}) | "
                f"{bwd:,.0f} | {want_b:,} ({bwd / want_b:.3f}) |"
            )


def step_time(args) -> None:
    print(f"\n## Step time (median of {args.steps} steps), batch {args.batch}, ring attention")
    print("| seq_len | " + " | ".join(f"C={c}" for c in CONTEXTS) + " |")
    print("|---|" + "---|" * len(CONTEXTS))
    for s in args.seqs:
        row = []
        for c in CONTEXTS:
            repl, step, state, batch = setup(config(s, args), c, args.batch)
            state, out = repl.run(step, state, batch)  # compiles
            jax.block_until_ready(out)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, out = repl.run(step, state, batch)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
            row.append(f"{statistics.median(times) * 1e3:.1f} ms")
        print(f"| {s} | " + " | ".join(row) + " |")


LM = ["model.d_model=128", "model.heads=4", "model.seq_len=64", "model.layers=4"]
EMBEDDING = {  # name -> (config, overrides, the token axes)
    "lm_dp {data: 2, context: 4}": ("lm_dp", [*LM, "mesh.data=2", "mesh.context=4"], "context"),
    "gpt_moe {data: 2, expert: 4}": ("gpt_moe", ["mesh.data=2", "mesh.expert=4"], "expert"),
}
LLAMA_2 = ["model.layers=2", "model.attention=ring", "mesh.data=4", "mesh.context=2"]
LLAMA = {
    "llama3_8b 2 layers {data: 4, context: 2}": (
        "llama3_8b",
        [*LLAMA_2, "global_batch=8"],
        "context",
    )
}


def token_bytes(config_name: str, overrides: list, axis: str, target, local) -> tuple:
    """Wire bytes per device and step over ``axis`` alone: ``(all-gather, all-reduce, all)``,
    with `embedding.scatters_locally` forced to ``local`` (None: as it chooses)."""
    from unittest import mock

    from replicator._src.sharded import embedding
    from replicator.cli import config as cfg_lib
    from replicator.cli import jobs, targets

    path = f"{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}/configs/{config_name}"
    cfg = cfg_lib.load(path + ".yaml", overrides)
    devices = None
    if target is not None:
        cfg = targets.mesh_on_target(cfg, target)
        devices = list(targets.devices(target.name, target.slices))
    rule = embedding.scatters_locally if local is None else lambda **_: local
    with mock.patch.object(embedding, "scatters_locally", rule):
        repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=devices)
        report = repl.explain(step_fn, state, batch)
    ops = [c for c in report.collectives if c.axes == (axis,)]
    kinds = [sum(c.wire_bytes for c in ops if c.kind == k) for k in ("all-gather", "all-reduce")]
    return (*kinds, sum(c.wire_bytes for c in ops))


def embedding_bytes(args) -> None:
    print("\n## The embedding's backward: wire bytes per device and step over the token axis")
    print("| program | platform | cotangents | all-gather | all-reduce | all over the axis |")
    print("|---|---|---|---|---|---|")
    platforms = [("XLA:CPU", None)]
    if args.target:
        platforms.append((args.target, rp.targets.tpu_target(args.target)))
    programs = list(EMBEDDING.items())
    for label, target in platforms:
        for name, (config_name, overrides, axis) in programs + (
            list(LLAMA.items()) if args.llama and target is not None else []
        ):
            chosen = []
            for how, local in (("gathered (before)", False), ("as chosen", None)):
                row = token_bytes(config_name, overrides, axis, target, local)
                chosen.append(row)
                figures = " | ".join(f"{b:,.0f}" for b in row)
                print(f"| {name} | {label} | {how} | {figures} |", flush=True)
            if chosen[0] == chosen[1]:  # the gather was chosen: what scattering would move
                row = token_bytes(config_name, overrides, axis, target, True)
                figures = " | ".join(f"{b:,.0f}" for b in row)
                print(f"| {name} | {label} | scattered (not chosen) | {figures} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part", choices=("memory", "bytes", "time", "embedding", "all"), default="all"
    )
    parser.add_argument("--target", default=None, help="--part embedding: also a TPU slice")
    parser.add_argument("--llama", action="store_true", help="--part embedding: Llama 3 8B too")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--d-model", dest="d_model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)  # configs/gpt_long.yaml
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tile", type=int, default=attention_lib.TILE, help="keys per tile")
    args = parser.parse_args()
    attention_lib.TILE = args.tile
    print(f"jax {jax.__version__}, {len(jax.devices())} emulated CPU devices")
    if args.part in ("memory", "all"):
        memory(args)
    if args.part in ("bytes", "all"):
        ring_bytes(args)
    if args.part in ("time", "all"):
        step_time(args)
    if args.part in ("embedding", "all"):
        embedding_bytes(args)


if __name__ == "__main__":
    main()
