"""Training runs through rp.fit on DEVICES emulated devices, resuming from CHECKPOINT_ROOT.

python reshard_run.py DEVICES CHECKPOINT_ROOT STEPS

For each of a data-parallel, a ZeRO-1 and two ZeRO-3 states, trains to STEPS (resuming from the
newest checkpoint of CHECKPOINT_ROOT/<name> if there is one), then writes the final parameters to
CHECKPOINT_ROOT/<name>.npz and prints ``<name> resumed_from=<step> shapes=<the state leaves' shapes>
split=<how many are split over the data axis>``.
"""

import sys

import jax

devices, root, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
jax.config.update("jax_num_cpu_devices", devices)

import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/
from oracle import OPTIMIZERS, batches, zero3_loss, zero3_params  # noqa: E402

import replicator as rp  # noqa: E402

RUNS = {"dp_sgd": (0, "sgd"), "zero1_adam": (1, "adam"), "zero3_sgd": (3, "sgd")}
RUNS["zero3_adam"] = (3, "adam")
data = batches(8, din=16, dout=4)


def input_fn(ctx):
    yield from data  # deterministic: a resumed run passes over the batches it already did


for name, (zero_stage, opt) in RUNS.items():
    repl = rp.Replicator()
    assert repl.num_replicas == devices
    wrapped = repl.wrap_optimizer(OPTIMIZERS[opt](), zero_stage=zero_stage)
    if zero_stage == 3:
        params = wrapped.shard_params(zero3_params(), stacked=["layers"])
    else:
        params = repl.replicate(zero3_params())

    def step_fn(state, batch, wrapped=wrapped):
        params, opt_state, metrics = wrapped.step(zero3_loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    state = {"params": params, "opt": wrapped.init(params)}
    result = rp.fit(
        repl,
        step_fn,
        state,
        input_fn,
        steps=steps,
        checkpointing=rp.training.CheckpointOptions(f"{root}/{name}", every=3),
        logging=rp.training.LoggingOptions(progress=False),
    )
    leaves = jax.tree.leaves(result.state)
    shapes = ";".join("x".join(map(str, x.shape)) for x in leaves)
    split = sum("data" in x.sharding.spec for x in leaves)
    final = jax.device_get(rp.gather_params(result.state["params"]))
    np.savez(f"{root}/{name}.npz", *jax.tree.leaves(final))
    print(f"{name} resumed_from={result.resumed_from} shapes={shapes} split={split}", flush=True)
