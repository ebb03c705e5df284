"""One process of the multi-process DP x PP oracle: {"data": 2, "stage": 4} over 2 processes of
4 devices (each process holds one data row: all 4 stages). Three SGD steps of a 1F1B pipeline;
process 0 writes the final parameters in model order."""

import sys

import replicator as rp

info = rp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/
import test_pipeline as tp  # noqa: E402

out_path = sys.argv[1]
repl = rp.Replicator(mesh_shape={"data": 2, "stage": 4})
schedule, v = tp.SCHEDULES["1f1b"]
wrapped = repl.wrap_optimizer(optax.sgd(0.1))
grads = tp.pipelined_grads(
    rp.pipeline.value_and_grad(
        rp.pipeline.scan_layers(tp.layer_fn), tp.loss_fn, num_microbatches=4, schedule=schedule
    )
)


def step(state, x, t):
    loss, g = grads(state["params"], x, t)
    updates, opt = wrapped.update(g, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}


def input_fn(ctx):
    per = ctx.per_pipeline_batch_size(16)
    for i in range(3):
        x, t = tp.make_batch(16, seed=10 + i)
        lo = ctx.input_pipeline_id * per
        yield x[lo : lo + per], t[lo : lo + per]


placed = tp.to_pipeline(tp.init_params(), repl, 4, v)
state = {"params": placed, "opt": wrapped.init(placed)}
for x, t in repl.distribute(input_fn):
    state, out = repl.run(step, state, x, t)


def local_full(x):
    """The whole array from this process's shards (process 0 holds every stage)."""
    full = np.zeros(x.shape, x.dtype)
    for shard in x.addressable_shards:
        full[shard.index] = np.asarray(shard.data)
    return full


print(f"process {info.process_index}: loss {rp.local_row(out)['loss']:.6f}", flush=True)
if info.process_index == 0:
    params = jax.tree.map(local_full, state["params"])
    params = tp.from_pipeline(params, v)
    np.savez(out_path, *jax.tree.leaves(params))
