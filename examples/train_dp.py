"""Data-parallel training of a CNN with cross-replica BatchNorm, on emulated or real devices.

The data is generated procedurally (no downloads): 16x16 images of six kinds of shapes (bars,
diagonals, squares, disks, crosses) at random positions and sizes, with noise, from
``replicator.models.cnn.shape_batches``; the model and its loss are ``replicator.models.cnn``'s.
The BatchNorm statistics travel in the state next to the parameters. The script is the whole replicator recipe: an ``input_fn``,
a one-replica ``step_fn``, and a ``Replicator``.

    python examples/train_dp.py                      # 8 emulated CPU devices, 300 steps
    python examples/train_dp.py --steps 50 --lowering pmap
"""

from __future__ import annotations

import argparse
import time

import jax


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lowering", default="shard_map", choices=["shard_map", "pmap", "local"])
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
    if args.cpu_devices and args.lowering != "local":
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    import optax
    from flax import nnx

    import replicator as rp
    from replicator.models import cnn

    repl = rp.Replicator(mesh_shape={"data": -1}, lowering=args.lowering)
    print(f"{repl} on {jax.devices()[0].platform}: global batch {args.global_batch}")

    def input_fn(ctx: rp.InputContext):  # this process's part of each global batch
        per_process = ctx.per_pipeline_batch_size(args.global_batch)
        yield from cnn.shape_batches(per_process, seed=1000 + ctx.input_pipeline_id)

    model = cnn.CNN(in_channels=1, num_classes=len(cnn.CLASS_NAMES), width=16, rngs=nnx.Rngs(0))
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)  # BatchNorm: stats
    tx = repl.wrap_optimizer(optax.adam(args.lr))

    def step_fn(state, batch):  # one replica's step; gradients are local
        (loss, (stats, accuracy)), grads = cnn.value_and_grad(
            graphdef, state["params"], state["stats"], batch
        )  # BatchNorm statistics over every replica's examples
        updates, opt = tx.update(grads, state["opt"], state["params"])  # all-reduce inside
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "accuracy": accuracy}
        return {"params": params, "stats": stats, "opt": opt}, rp.all_reduce(metrics, "mean")

    with repl.context():
        state = repl.replicate({"params": params, "stats": stats, "opt": tx.init(params)})
    batches = repl.distribute(input_fn)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        state, out = repl.run(step_fn, state, next(batches))
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            loss, acc = float(out["loss"][0]), float(out["accuracy"][0])
            rate = step * args.global_batch / (time.perf_counter() - start)
            print(f"step {step:5d}  loss {loss:.4f}  accuracy {acc:.3f}  {rate:,.0f} examples/s")
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
