"""One process of the multi-process data-parallel oracle: run by tests/multiprocess/test_*.py
through `replicator launch`. Trains the oracle MLP with SGD or Adam on 8 global replicas and
writes the final parameters (process 0) to the path given."""

import sys

import replicator as rp

info = rp.distributed.initialize()  # first: before anything touches the devices

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/, for oracle.py
from oracle import batches, mlp_state, mlp_step  # noqa: E402

opt_name, out_path = sys.argv[1], sys.argv[2]
tx = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}[opt_name]()
repl = rp.Replicator()
assert repl.num_replicas == 8 and jax.process_count() == 2, (repl, jax.process_count())
data = batches()  # 10 global batches of 64, the same in every process


def input_fn(ctx: rp.InputContext):
    per = ctx.per_pipeline_batch_size(64)
    for batch in data:  # this process's contiguous part of each global batch
        lo = ctx.input_pipeline_id * per
        yield {k: v[lo : lo + per] for k, v in batch.items()}


# Each process initialises differently: replicate() must broadcast process 0's state.
state = mlp_state(repl.wrap_optimizer(tx))
if info.process_index == 1:
    state = state.replace(params=jax.tree.map(lambda p: p * 0 + 7.0, state.params))
state = repl.replicate(state)
for batch in repl.distribute(input_fn):
    state, out = repl.run(mlp_step, state, batch)
loss = float(rp.local_row(out)["loss"])
print(f"process {info.process_index}: last loss {loss:.6f}", flush=True)
if info.process_index == 0:
    params = jax.tree.map(lambda p: np.asarray(p.addressable_shards[0].data), state.params)
    np.savez(out_path, *jax.tree.leaves(params))
