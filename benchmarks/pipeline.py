"""Pipeline schedules on 4 emulated CPU devices: compile time, step time and memory.

The model is a stack of residual MLP blocks (``x + W2 tanh(W1 x)``, width 256, hidden 1024), split
into K = 4 stages of stacked parameters on a ``{"data": 1, "stage": 4}`` mesh; the loss is a mean
squared error. One training step is ``rp.pipeline.value_and_grad`` and an SGD update. Three parts:

(a) compile: the time to lower and compile the step (``Replicator.lower(...).compile()``) for
    M in {4, 16, 64} micro-batches, and for 1, 4 and 16 layers per stage; per schedule, the ratio
    of the largest to the smallest (target <= 1.3). "any model" rows: stages that differ
    (``rp.pipeline.sequential``: an input projection, blocks, an output projection).
(b) step: the wall time per step of each schedule at K=4, M=16, alternated in one process with
    the same model run sequentially on one device with the same micro-batches and the same remat
    (the engine without a ``stage`` axis: a scan over the micro-batches), and with the full batch
    at once. On this CPU the emulated devices share the cores, so a schedule's time measures the
    work it executes: the limit is (ticks x stage work) / (M x stage work), i.e. (M+K-1)/M for
    GPipe and (VM+K-1)/VM for Circular, which compute through their bubbles, and 1.0 for 1F1B,
    which skips idle ticks under ``lax.cond``. Target: each schedule within 1.15x of its limit.
(c) memory: the peak temporary bytes of the compiled step (``memory_analysis``) for each schedule
    at M in {8, 32} with a fixed micro-batch size: GPipe keeps a stage input per tick, 1F1B a ring
    of 2K-1 stashed inputs, ZeroBubble rings of K inputs and K output cotangents.
(d) model: the modelled bubble fraction on K parallel devices (``rp.pipeline.step_time``, lock-step
    as the scan runs) of GPipe, 1F1B, Circular (V=2) and ZeroBubble at K in {4, 8} and M in
    {8, 16, 32}, with equal costs (F = B = W = 1, fused backward 2) and with the costs of a GPT
    block measured from its compiled passes (``rp.pipeline.stage_costs_stacked``, XLA FLOPs).
    Pure arithmetic on the tick tables; no step runs.

    python benchmarks/pipeline.py                   # all four parts
    python benchmarks/pipeline.py --part step --rounds 5
"""

# ruff: noqa: E402  (the device count and the cores must be set before JAX starts its backend)
import os
import sys

CORES = int(sys.argv[sys.argv.index("--cores") + 1]) if "--cores" in sys.argv else 1
if CORES:  # pin before XLA starts its threads (see --cores)
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:CORES])

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")

import argparse
import datetime
import json
import shlex
import time

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import replicator as rp
from replicator import pipeline

K = 4
WIDTH, HIDDEN = 256, 1024
SCHEDULES = {
    "gpipe": pipeline.GPipe(),
    "circular": pipeline.Circular(repeats=2),
    "1f1b": pipeline.OneFOneB(),
    "interleaved": pipeline.Interleaved1F1B(repeats=2),
    "zerobubble": pipeline.ZeroBubble(),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["compile", "step", "memory", "model", "all"], default="all")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds for (b)")
    p.add_argument("--steps", type=int, default=3, help="steps per contender per round for (b)")
    p.add_argument("--microbatch", type=int, default=128, help="examples per micro-batch")
    p.add_argument("--layers", type=int, default=8, help="layers in (b) and (c)")
    p.add_argument(
        "--cores",
        type=int,
        default=1,
        help="CPU cores the process may use (0: all). With one core, every emulated device and "
        "the single-device baseline run on the same core, so wall time is the work executed; "
        "with more, small matrix products on one device use one core while 4 devices share all.",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def block(p, x):
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def loss_fn(_, y, t):
    return jnp.mean((y - t) ** 2)


def layers(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(n, WIDTH, HIDDEN)) / np.sqrt(WIDTH)).astype(np.float32),
        "w2": (rng.normal(size=(n, HIDDEN, WIDTH)) / np.sqrt(HIDDEN) / 4).astype(np.float32),
    }


def batch(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, WIDTH)).astype(np.float32)
    return x, np.tanh(x)


def make_step(schedule, m: int, remat: bool = True, stage_fn=None):
    f = pipeline.value_and_grad(
        stage_fn or pipeline.scan_layers(block), loss_fn, num_microbatches=m, schedule=schedule,
        remat=remat,
    )  # fmt: skip

    def step(stages, x, t):
        loss, (g, _, _) = f(stages, x, t)
        return jax.tree.map(lambda p, g: p - 0.01 * g, stages, g), {"loss": loss}

    return step


def full_batch_step(stages, x, t):
    def loss(stages):
        flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stages)
        return loss_fn(None, pipeline.scan_layers(block)(flat, x), t)

    value, g = jax.value_and_grad(loss)(stages)
    return jax.tree.map(lambda p, g: p - 0.01 * g, stages, g), {"loss": value}


def pipeline_repl() -> rp.Replicator:
    return rp.Replicator(mesh_shape={"data": 1, "stage": K}, devices=jax.devices()[:K])


def sequential_repl() -> rp.Replicator:
    return rp.Replicator(mesh_shape={"data": 1}, devices=jax.devices()[:1])


def placed(repl: rp.Replicator, n_layers: int, schedule) -> dict:
    stacked = pipeline.stack_stages(layers(n_layers), num_stages=K, repeats=schedule.repeats)
    if "stage" not in repl.mesh.shape:
        return jax.block_until_ready(repl.replicate(stacked))
    sharding = NamedSharding(repl.mesh, pipeline.stage_spec(schedule.repeats))
    return jax.block_until_ready(jax.device_put(stacked, sharding))  # not during timing


# -- (a) compile time ---------------------------------------------------------------------------


def any_model(per_stage: int):
    """Stages that differ: a 64 -> 256 input projection and blocks, blocks, blocks, and blocks
    and a 256 -> 64 output projection (`rp.pipeline.sequential`), with its packed params."""
    rng = np.random.default_rng(0)
    proj_in = {"w": (rng.normal(size=(64, WIDTH)) / 8).astype(np.float32)}
    proj_out = {"w": (rng.normal(size=(WIDTH, 64)) / 16).astype(np.float32)}
    blocks = [
        jax.tree.map(lambda a, i=i: a[i], layers(4 * per_stage)) for i in range(4 * per_stage)
    ]
    fns = [lambda p, x: x @ p["w"], *[block] * len(blocks), lambda p, x: x @ p["w"]]
    sizes = (per_stage + 1, per_stage, per_stage, per_stage + 1)
    model = pipeline.sequential(
        *pipeline.stages_from_layers(fns, [proj_in, *blocks, proj_out], sizes)
    )
    return model, model.pack(
        pipeline.stages_from_layers(fns, [proj_in, *blocks, proj_out], sizes)[1]
    )


def compile_case(schedule, m: int, per_stage: int, hetero: bool = False):
    """A function that lowers and compiles one training step, from a fresh step function each
    time (so nothing is cached), and returns the seconds it took."""
    repl = pipeline_repl()
    x, t = batch(m * 4)
    if hetero:
        model, packed = any_model(per_stage)
        stages = repl.place(packed, pipeline.stage_spec())
        x, t = x[:, :64], t[:, :64]
    else:
        model, stages = None, placed(repl, K * schedule.repeats * per_stage, schedule)

    def seconds() -> float:
        step = make_step(schedule, m, stage_fn=model)
        t0 = time.perf_counter()
        repl.lower(step, stages, x, t).compile()
        return time.perf_counter() - t0

    return seconds


def part_compile(rounds: int = 5) -> dict:
    results = {}
    print(
        f"(a) compile time, seconds (median of {rounds} rounds): lower + compile of one "
        "training step; each round compiles every column once, in turn"
    )
    print("| schedule | M=4 | M=16 | M=64 | max/min | L/stage=1 | 4 | 16 | max/min |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hetero in (False, True):  # warm up: JAX's first lowering in a process is slower
        compile_case(SCHEDULES["gpipe"], 4, 1, hetero)()
    cases = [(n, s, False) for n, s in SCHEDULES.items()]
    cases += [(f"any model, {n}", SCHEDULES[n], True) for n in ("1f1b", "zerobubble")]
    for name, schedule, hetero in cases:
        columns = {("m", m): compile_case(schedule, m, 2, hetero) for m in (4, 16, 64)}
        columns |= {("l", lv): compile_case(schedule, 16, lv, hetero) for lv in (1, 4, 16)}
        times = {c: [] for c in columns}
        for _ in range(rounds):  # interleaved, so that the machine's drift touches every column
            for c, seconds in columns.items():
                times[c].append(seconds())
        med = {c: float(np.median(v)) for c, v in times.items()}
        by_m = {m: med[("m", m)] for m in (4, 16, 64)}
        by_l = {lv: med[("l", lv)] for lv in (1, 4, 16)}
        rm = max(by_m.values()) / min(by_m.values())
        rl = max(by_l.values()) / min(by_l.values())
        results[name] = {"by_microbatches": by_m, "by_layers_per_stage": by_l}
        results[name] |= {"ratio_m": rm, "ratio_layers": rl}
        cells = [f"{v:.2f}" for v in by_m.values()] + [f"{rm:.2f}"]
        cells += [f"{v:.2f}" for v in by_l.values()] + [f"{rl:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    worst = max(max(r["ratio_m"], r["ratio_layers"]) for r in results.values())
    print(f"largest max/min ratio: {worst:.2f} (target <= 1.3)\n")
    return results


# -- (b) step time ------------------------------------------------------------------------------


def part_step(args) -> dict:
    m, n_layers = 16, args.layers
    x, t = batch(m * args.microbatch)
    contenders = {}
    for name, schedule in SCHEDULES.items():
        repl = pipeline_repl()
        contenders[name] = (repl, make_step(schedule, m), placed(repl, n_layers, schedule))
    # Each schedule's baseline: the same call without a stage axis on one device, with the
    # same stages (Circular's are V times smaller), micro-batches and remat.
    seq = sequential_repl()
    baseline = {}
    for name, schedule in SCHEDULES.items():
        rows = K * schedule.repeats
        label = f"sequential, {rows} stages of {n_layers // rows}"
        baseline[name] = label
        if label not in contenders:
            stages = placed(seq, n_layers, schedule)
            contenders[label] = (seq, make_step(schedule, m), stages)
    contenders["full batch"] = (seq, full_batch_step, placed(seq, n_layers, SCHEDULES["gpipe"]))

    states = {}
    for name, (repl, step, stages) in contenders.items():  # compile and warm up
        stages, out = repl.run(step, stages, x, t)
        states[name] = jax.block_until_ready(stages)
    times = {name: [] for name in contenders}
    order = list(contenders)
    for r in range(args.rounds):
        for name in order[:: 1 if r % 2 == 0 else -1]:
            repl, step, _ = contenders[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                states[name], out = repl.run(step, states[name], x, t)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.steps)
    med = {k: float(np.median(v)) for k, v in times.items()}
    mlp = pipeline.stage_costs_stacked(
        pipeline.scan_layers(block),
        pipeline.stack_stages(layers(1), num_stages=1),
        jax.ShapeDtypeStruct((args.microbatch, WIDTH), jnp.float32),
    )
    f, b, w, bw = (getattr(mlp, k)[0] for k in ("forward", "backward_input",
                                                 "backward_weight", "backward"))  # fmt: skip
    limits = {
        "gpipe": (m + K - 1) / m,
        "circular": (2 * m + K - 1) / (2 * m),
        "1f1b": 1.0,
        "interleaved": 1.0,
        "zerobubble": (f + b + w) / (f + bw),  # B + W against the fused backward (XLA FLOPs)
    }
    print(
        f"(b) step time at K={K}, M={m}, {n_layers} layers, micro-batch {args.microbatch}, "
        f"{args.rounds} rounds x {args.steps} steps, alternated"
    )
    print("| run | ms/step | vs its sequential | its limit | ratio / limit | vs full batch |")
    print("|---|---|---|---|---|---|")
    results = {"median_s": med, "limits": limits, "baseline": baseline}
    for name in contenders:
        vs_full = med[name] / med["full batch"]
        if name in limits:
            vs_seq = med[name] / med[baseline[name]]
            cells = f"{vs_seq:.3f} | {limits[name]:.3f} | {vs_seq / limits[name]:.3f}"
            results[name] = {"vs_sequential": vs_seq, "over_limit": vs_seq / limits[name]}
        else:
            cells = "- | - | -"
            results[name] = {}
        results[name]["vs_full_batch"] = vs_full
        print(f"| {name} | {1e3 * med[name]:.1f} | {cells} | {vs_full:.3f} |")
    print("target: ratio / limit <= 1.15\n")
    return results


# -- (c) memory ---------------------------------------------------------------------------------


def part_memory(args) -> dict:
    results = {}
    print(f"(c) peak temporary memory of the compiled step, MiB (micro-batch {args.microbatch})")
    print("| schedule | M=8 | M=32 | growth |")
    print("|---|---|---|---|")
    cases = [("gpipe", True), ("gpipe", False), ("circular", True), ("1f1b", True),
             ("zerobubble", True)]  # fmt: skip
    for name, remat in cases:
        schedule = SCHEDULES[name]
        row = {}
        for m in (8, 32):
            repl = pipeline_repl()
            stages = placed(repl, args.layers, schedule)
            x, t = batch(m * args.microbatch)
            compiled = repl.lower(make_step(schedule, m, remat), stages, x, t).compile()
            row[m] = compiled.memory_analysis().temp_size_in_bytes / 2**20
        label = name + ("" if remat else " (remat=False)")
        results[label] = row
        print(f"| {label} | {row[8]:.2f} | {row[32]:.2f} | {row[32] / row[8]:.2f}x |")
    print()
    return results


# -- (d) modelled bubbles ---------------------------------------------------------------------


def gpt_block_costs(microbatch: int = 4) -> pipeline.StageCosts:
    """One GPT block's F, B, W and fused backward, XLA FLOPs of its compiled passes (the
    block of configs/lm_pipeline.yaml: d_model 64, 4 heads, sequence 64)."""
    from replicator.models import gpt

    config = gpt.GPTConfig(d_model=64, num_heads=4, num_layers=1, seq_len=64)
    stacked = pipeline.stack_stages(gpt.init(config, jax.random.key(0))["blocks"], num_stages=1)
    x = jax.ShapeDtypeStruct((microbatch, config.seq_len, config.d_model), jnp.float32)
    return pipeline.stage_costs_stacked(gpt.stage_fn(config), stacked, x)


def part_model() -> dict:
    block = gpt_block_costs()
    f, b, w, bw = (getattr(block, k)[0] for k in ("forward", "backward_input",
                                                   "backward_weight", "backward"))  # fmt: skip
    print("(d) modelled bubble fraction on K parallel devices (lock-step, as the scan runs)")
    print(f"GPT block per micro-batch of 4: F={f:.3g} B={b:.3g} W={w:.3g} fused={bw:.3g} FLOPs "
          f"(B/F={b / f:.2f}, W/F={w / f:.2f}, fused/F={bw / f:.2f})")  # fmt: skip
    names = [f"{n} V={s.repeats}" if s.repeats > 1 else n for n, s in SCHEDULES.items()]
    print(
        "| costs | K | M | " + " | ".join(names) + " | zb / 1f1b bubble | "
        "zb / 1f1b time | zb bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = {"gpt_block_flops": {"F": f, "B": b, "W": w, "fused": bw}, "rows": []}
    for label, (cf, cb, cw, cbw) in (("equal", (1, 1, 1, 2)), ("GPT", (f, b, w, bw))):
        for k in (4, 8):
            for m in (8, 16, 32):
                row = {"costs": label, "K": k, "M": m}
                for name, schedule in SCHEDULES.items():
                    v = schedule.repeats
                    # V virtual stages per device split the device's layers: each costs 1/V
                    costs = pipeline.StageCosts(*(
                        (c / v,) * (k * v) for c in (cf, cb, cw, cbw)
                    ), unit="units" if label == "equal" else "flops")  # fmt: skip
                    st = pipeline.step_time(schedule.timetable(k, m), costs)
                    row[name] = {"bubble": st.bubble_fraction, "time": st.time}
                zb, one = row["zerobubble"], row["1f1b"]
                results["rows"].append(row)
                cells = [f"{row[n]['bubble']:.4f}" for n in SCHEDULES]
                # No schedule beats its work: ZeroBubble with no bubble at all takes M(F+B+W).
                bound = m * (cf + cb + cw) / one["time"]
                row["zb_bound"] = bound
                cells += [f"{zb['bubble'] / one['bubble']:.2f}", f"{zb['time'] / one['time']:.2f}",
                          f"{bound:.2f}"]  # fmt: skip
                print(f"| {label} | {k} | {m} | " + " | ".join(cells) + " |")
    print()
    return results


def main() -> None:
    args = parse_args()
    if len(jax.devices()) != K:
        sys.exit(f"pipeline: expected {K} CPU devices, got {jax.devices()}")
    command = shlex.join(["python", *sys.argv])
    today = datetime.date.today().isoformat()
    cores = len(os.sched_getaffinity(0))
    print(
        f"{today}, jax {jax.__version__}, {K} emulated CPU devices on {cores} core(s): `{command}`\n"
    )
    results = {"date": today, "jax": jax.__version__, "command": command}
    if args.part in ("compile", "all"):
        results["compile"] = part_compile()
    if args.part in ("step", "all"):
        results["step"] = part_step(args)
    if args.part in ("memory", "all"):
        results["memory"] = part_memory(args)
    if args.part in ("model", "all"):
        results["model"] = part_model()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
