"""The optimizer on stages that differ (``rp.pipeline.sequential``), read from compiled programs.

Four stages of different widths (an input projection 64 -> 256, two residual blocks of 256 with
hidden 512 and 1024, an output projection 256 -> 64) on ``{"data": 2, "stage": 4}``, 1F1B with
4 micro-batches. For each optax transformation and ZeRO stage: the collectives of the compiled
step by kind and axes (bytes per device; `Replicator.explain` counts every stage's branch of the
update, so a ZeRO row over ``data`` is the sum over the 4 stages, and each device moves its own
stage's share), the optimizer state per device, and the step time measured side by side with
the same steps under plain Adam on the packed rows seen as buffers (``plain``: what the optimizer
saw before; exact only for element-wise transformations), one step of each in turn (medians).

    python benchmarks/stagewise.py                 # every row, 20 timed steps each
    python benchmarks/stagewise.py --steps 5
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp
from replicator import pipeline


def stages():
    def proj(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    def block(p, x):
        return x + jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] * p["scale"]

    r = np.random.default_rng(0)

    def n(*shape):
        return jnp.asarray(r.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)

    params = [
        {"w": n(64, 256), "b": n(256)},
        {"w1": n(256, 512), "b1": n(512), "w2": n(512, 256), "scale": n(256)},
        {"w1": n(256, 1024), "b1": n(1024), "w2": n(1024, 256), "scale": n(256)},
        {"w": n(256, 64), "b": n(64)},
    ]
    return pipeline.sequential([proj, block, block, proj], params), params


def no_decay_on_vectors(params):
    return jax.tree.map(lambda a: np.ndim(a) > 1, params)


TRANSFORMS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw, mask by rank": lambda: optax.adamw(1e-3, weight_decay=0.1, mask=no_decay_on_vectors),
    "lamb": lambda: optax.lamb(1e-3),
    "clip_by_global_norm + adam": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(1e-3)
    ),
}


def build(name, zero_stage, *, plain=False):
    """The compiled step, its state and batch, its collectives and optimizer-state bytes."""
    model, params = stages()
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 4})
    opt = repl.wrap_optimizer(TRANSFORMS[name](), zero_stage=zero_stage)
    f = pipeline.value_and_grad(model, lambda _, y, t: jnp.mean((y - t) ** 2), num_microbatches=4)

    def step(state, x, t):
        loss, (g, _, _) = f(state["params"], x, t)
        p = state["params"]
        if plain:  # the optimizer sees one buffer per stage (exact for element-wise only)
            g, p = dict(g), dict(p)
        updates, o = opt.update(g, state["opt"], p)
        new = jax.tree.leaves(optax.apply_updates(p, updates))
        return {"params": jax.tree.unflatten(jax.tree.structure(state["params"]), new),
                "opt": o}, {"loss": rp.all_reduce(loss, "mean")}  # fmt: skip

    packed = repl.place(model.pack(params), pipeline.stage_spec())
    state = {"params": packed, "opt": opt.init(dict(packed) if plain else packed)}
    r = np.random.default_rng(1)
    x = r.normal(size=(64, 64)).astype(np.float32)
    t = r.normal(size=(64, 64)).astype(np.float32)
    report = repl.explain(step, state, x, t)
    coll = {}
    for g in report.collective_summary():
        if "collective-permute" not in g["kind"]:
            key = f"{g['kind']} over {'+'.join(g['axes'])}"
            coll[key] = coll.get(key, 0) + int(g["bytes"])
    opt_bytes = sum(
        int(np.prod(a.addressable_shards[0].data.shape)) * a.dtype.itemsize
        for a in jax.tree.leaves(state["opt"])
    )
    return (repl, step, [state], x, t), coll, opt_bytes


def timed(run) -> float:
    repl, step, box, x, t = run
    start = time.perf_counter()
    box[0], out = repl.run(step, box[0], x, t)
    jax.block_until_ready(out)
    return time.perf_counter() - start


def row(name, zero_stage, steps):
    """Collectives, state bytes, and the median step ms of ``name`` and of plain Adam, timed
    alternately (one step of each in turn) after a warm-up step."""
    run, coll, opt_bytes = build(name, zero_stage)
    plain, _, _ = build("adam", zero_stage, plain=True)
    timed(run), timed(plain)
    pairs = [(timed(run), timed(plain)) for _ in range(steps)]
    ms = 1e3 * float(np.median([a for a, _ in pairs]))
    plain_ms = 1e3 * float(np.median([b for _, b in pairs]))
    return coll, opt_bytes, ms, plain_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    _, params = stages()
    sizes = [sum(np.size(a) for a in jax.tree.leaves(p)) * 4 for p in params]
    print(f"stage parameter bytes: {sizes} (row {max(sizes):,} bytes)")
    print("| transformation | ZeRO | collectives per step (bytes per device) "
          "| optimizer state per device | step ms | plain Adam step ms |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name in TRANSFORMS:
        for zero_stage in (0, 1):
            coll, opt_bytes, ms, plain_ms = row(name, zero_stage, args.steps)
            text = ", ".join(f"{k} {v:,}" for k, v in sorted(coll.items()))
            print(f"| {name} | {zero_stage} | {text} | {opt_bytes:,} | {ms:.2f} | {plain_ms:.2f} |")


if __name__ == "__main__":
    main()
