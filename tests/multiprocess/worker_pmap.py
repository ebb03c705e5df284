"""One process of the multi-process pmap test: run by tests/multiprocess/test_pmap_multiprocess.py
through `replicator launch`. Runs the same steps under lowering="shard_map" and lowering="pmap"
in one job (8 global replicas over 2 processes) and writes, from process 0, every result of
both as whole NumPy arrays, keyed "<lowering>/<name>", to the path given."""

import sys

import replicator as rp

info = rp.distributed.initialize()  # first: before anything touches the devices

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/, for oracle.py
from oracle import batches, mlp_state, mlp_step  # noqa: E402

out_path = sys.argv[1]
assert jax.process_count() == 2, jax.process_count()
data = batches(n=5)  # 5 global batches of 64, the same in every process


def input_fn(ctx: rp.InputContext):
    per = ctx.per_pipeline_batch_size(64)
    for batch in data:  # this process's contiguous part of each global batch
        lo = ctx.input_pipeline_id * per
        yield {k: v[lo : lo + per] for k, v in batch.items()}


def probe(state, x, y, scale):
    """Per-replica values that no reduction evens out: which replica, and which rows, it got;
    and a Python float ``scale`` that, weakly typed, keeps a bfloat16 product in bfloat16."""
    row = rp.replica_id() * 1000.0 + jnp.sum(x, axis=0) * scale + jnp.sum(y, axis=0)
    half = (jnp.ones((2,), jnp.bfloat16) * (scale + 2**-12)).astype(jnp.float32)  # 0.5
    outputs = {"row": row, "id": rp.replica_id(), "half": half}
    return state + rp.all_reduce(jnp.sum(x), "sum"), outputs


def whole(tree):
    return jax.tree.map(
        lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree
    )


results = {}
for lowering in ("shard_map", "pmap"):
    repl = rp.Replicator(lowering=lowering, check_replicas=True)
    assert repl.num_replicas == 8, repl
    for zero in (0, 1):  # ZeRO-1: the optimizer state is split over the replicas
        state = repl.replicate(mlp_state(repl.wrap_optimizer(optax.adam(1e-2))))
        if zero:
            opt = repl.wrap_optimizer(optax.adam(1e-2), zero_stage=1)
            state = state.replace(tx=opt, opt_state=opt.init(state.params))
            assert any(x.sharding.spec != P() for x in jax.tree.leaves(state.opt_state))
        losses = []
        for batch in repl.distribute(input_fn):
            state, out = repl.run(mlp_step, state, batch)
            losses.append(whole(out["loss"]))
        tag = f"{lowering}/zero{zero}"
        results |= {
            f"{tag}/params/{i}": a for i, a in enumerate(whole(jax.tree.leaves(state.params)))
        }
        results |= {
            f"{tag}/opt/{i}": a for i, a in enumerate(whole(jax.tree.leaves(state.opt_state)))
        }
        results[f"{tag}/loss"] = np.stack(losses)
        print(f"process {info.process_index}: {tag} last loss {losses[-1][0]:.6f}", flush=True)
    x = np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3)  # a global batch, as NumPy
    y = jnp.asarray(x[::-1] ** 2)  # a global batch in this process's memory
    total, out = repl.run(probe, repl.replicate(jnp.zeros(())), x, y, 0.5)
    results |= {f"{lowering}/probe/{k}": v for k, v in whole(out).items()}
    results[f"{lowering}/probe/total"] = whole(total)

if info.process_index == 0:
    np.savez(out_path, **results)
