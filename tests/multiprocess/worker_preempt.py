"""One process of the preemption test: run through `replicator launch` by
tests/multiprocess/test_preemption.py. Trains the oracle MLP with `rp.fit` on 8 global replicas
for ``STEPS`` steps, checkpointing into ``DIR/ckpt``; writes its pid to ``DIR/rank<r>.pid``
after ``10`` steps' batches, its `FitResult` to ``DIR/result<r>.json`` and (process 0) the final
parameters to ``DIR/params.npz``.

python worker_preempt.py DIR STEPS
"""

import json
import os
import sys

import replicator as rp

info = rp.distributed.initialize()  # first: before anything touches the devices

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/, for oracle.py
sys.path.insert(0, __file__.rsplit("/", 1)[0])  # for worker_preempt_data.py
from oracle import OPTIMIZERS, mlp_state, mlp_step  # noqa: E402
from worker_preempt_data import global_batch  # noqa: E402

out_dir, steps = sys.argv[1], int(sys.argv[2])


def input_fn(ctx: rp.InputContext):
    per = ctx.per_pipeline_batch_size(64)
    lo = ctx.input_pipeline_id * per
    for step in range(steps):
        if step == 10:
            with open(os.path.join(out_dir, f"rank{info.process_index}.pid"), "w") as f:
                f.write(str(os.getpid()))
        yield {k: v[lo : lo + per] for k, v in global_batch(step).items()}


repl = rp.Replicator()
state = repl.replicate(mlp_state(repl.wrap_optimizer(OPTIMIZERS["adam"]())))
result = rp.fit(
    repl,
    mlp_step,
    state,
    input_fn,
    steps=steps,
    checkpointing=rp.training.CheckpointOptions(os.path.join(out_dir, "ckpt")),
    logging=rp.training.LoggingOptions(every=1000, progress=False),
)
record = {"step": result.step, "preempted": result.preempted, "resumed_from": result.resumed_from}
with open(os.path.join(out_dir, f"result{info.process_index}.json"), "w") as f:
    json.dump(record, f)
if info.process_index == 0 and not result.preempted:
    params = jax.tree.map(lambda p: np.asarray(p.addressable_shards[0].data), result.state.params)
    np.savez(os.path.join(out_dir, "params.npz"), *jax.tree.leaves(params))
