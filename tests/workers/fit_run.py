"""A training run through rp.fit for the resume and preemption tests.

python fit_run.py CHECKPOINT_DIR METRICS_JSONL OUT_NPZ [SECONDS_PER_BATCH]
"""

import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/
from oracle import OPTIMIZERS, batches, mlp_state, mlp_step  # noqa: E402

import replicator as rp  # noqa: E402

ckpt_dir, metrics_path, out_path = sys.argv[1:4]
delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
data = batches(20)


def input_fn(ctx):
    for batch in data:
        time.sleep(delay)  # a slow input pipeline, so that the tests can interrupt the run
        yield batch


repl = rp.Replicator()
state = repl.replicate(mlp_state(repl.wrap_optimizer(OPTIMIZERS["adam"]())))
result = rp.fit(
    repl,
    mlp_step,
    state,
    input_fn,
    steps=20,
    checkpointing=rp.training.CheckpointOptions(ckpt_dir, every=5),
    logging=rp.training.LoggingOptions(every=1, metrics_path=metrics_path, examples_per_step=64),
)
print(f"done step={result.step} preempted={result.preempted} resumed_from={result.resumed_from}")
if not result.preempted:
    np.savez(out_path, *[np.asarray(x) for x in jax.tree.leaves(result.state.params)])
