"""ZeRO-3 (fully sharded data parallel) training of a residual MLP, on emulated or real devices.

With ZeRO-3 every device keeps only 1/N of each parameter, of its gradient and of the Adam
state (N replicas). ``opt.shard_params`` stores each parameter in its own shape with one axis
split over the ``data`` axis (never the stacked layer axis); in the forward pass
``rp.gather_params`` all-gathers one layer's parameters just before the layer uses them, and
autodiff turns that all-gather into a reduce-scatter, so each device receives only its part of
the mean gradient and updates only its part of the parameters. ``jax.checkpoint`` on the layer
gathers again in the backward pass instead of keeping every layer's full parameters alive. The
cost is 3x the parameter bytes on the wire per step, against 2x for plain data parallelism.

The data is generated procedurally (no downloads): y = sin(x0) cos(x1) from 16 Gaussian inputs
(``replicator.models.mlp.regression_batches``).

    python examples/train_zero.py                    # 8 emulated CPU devices, ZeRO-3
    python examples/train_zero.py --zero-stage 0     # the same model, replicated, to compare
"""

from __future__ import annotations

import argparse
import time

import jax


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--width", type=int, default=256, help="hidden features of each layer")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="CPU devices to emulate (only used when JAX runs on the CPU; 0 keeps JAX's default)",
    )
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    import jax.numpy as jnp
    import numpy as np
    import optax

    import replicator as rp
    from replicator.models import mlp

    repl = rp.Replicator(mesh_shape={"data": -1})
    print(f"{repl} on {jax.devices()[0].platform}: ZeRO stage {args.zero_stage}")

    def input_fn(ctx: rp.InputContext):  # reproducible per input pipeline
        per_process = ctx.per_pipeline_batch_size(args.global_batch)
        yield from mlp.regression_batches(per_process, seed=ctx.input_pipeline_id)

    d, rng = args.width, np.random.default_rng(0)
    params = {
        "embed": {"w": (rng.normal(size=(16, d)) / 4).astype(np.float32)},
        "layers": {  # stacked: a leading layer axis, scanned over
            "w": (rng.normal(size=(args.layers, d, d)) / np.sqrt(d)).astype(np.float32),
            "b": np.zeros((args.layers, d), np.float32),
        },
        "head": {"w": (rng.normal(size=(d, 1)) / d).astype(np.float32)},
    }

    @jax.checkpoint  # the backward pass gathers the layer again instead of keeping it
    def layer(h, p):
        p = rp.gather_params(p)  # this layer's full parameters, only for this layer
        return h + jnp.tanh(h @ p["w"] + p["b"]), None

    def loss_fn(params, batch):  # one replica's loss on its part of the batch
        h = batch["x"] @ rp.gather_params(params["embed"])["w"]
        h, _ = jax.lax.scan(layer, h, params["layers"])
        y = h @ rp.gather_params(params["head"])["w"]
        return jnp.mean((y - batch["y"]) ** 2)

    opt = repl.wrap_optimizer(optax.adam(args.lr), zero_stage=args.zero_stage)
    if args.zero_stage == 3:
        placed = opt.shard_params(params, stacked=["layers"])
    else:
        placed = repl.replicate(params)  # gather_params passes plain arrays through
    state = {"params": placed, "opt": opt.init(placed)}

    def step_fn(state, batch):  # one replica's step
        params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    # What one device holds, against the same parameters and Adam state unsharded.
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    unsharded = jax.eval_shape(lambda p: (p, optax.adam(args.lr).init(p)), params)
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(unsharded))
    print(
        f"memory: parameters + Adam state {per_device / 2**20:.2f} MiB per device, "
        f"{full / 2**20:.2f} MiB unsharded: {full / per_device:.1f}x"
    )

    batches = repl.distribute(input_fn)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        state, out = repl.run(step_fn, state, next(batches))
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            loss = float(out["loss"][0])
            rate = step * args.global_batch / (time.perf_counter() - start)
            print(f"step {step:5d}  loss {loss:.4f}  {rate:,.0f} examples/s")
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
