"""`rp.fit` runs on 2 processes (`replicator launch`): one whose processes build the same step
(it trains); then, with DIFFERENT_STEP set, process 1 builds another step (its loss x 2): on a
mesh of each process's own devices (it trains: nothing to compare), then on the mesh of both,
which `rp.fit` refuses before its first step. Checkpoints go to OUT/same and OUT/different."""

import os
import sys

import replicator as rp

info = rp.distributed.initialize()  # first: before anything touches the devices

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

out = sys.argv[1]
repl = rp.Replicator()
rng = np.random.default_rng(0)
data = [{"x": rng.normal(size=(8, 4)).astype(np.float32),
         "y": rng.normal(size=(8, 1)).astype(np.float32)} for _ in range(2)]  # fmt: skip


def input_fn(ctx: rp.InputContext):
    per = ctx.per_pipeline_batch_size(8)
    for batch in data:
        lo = ctx.input_pipeline_id * per
        yield {k: v[lo : lo + per] for k, v in batch.items()}


def make_step(scale: float):
    def step_fn(state, batch):
        def loss_fn(w):
            return scale * jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

        loss, grad = jax.value_and_grad(loss_fn)(state["w"])
        new = {"w": state["w"] - 0.1 * rp.all_reduce(grad, "mean")}
        return new, {"loss": rp.all_reduce(loss, "mean")}

    return step_fn


def fit(name: str, step_fn):
    state = repl.replicate({"w": jnp.zeros((4, 1), jnp.float32)})
    saving = rp.training.CheckpointOptions(os.path.join(out, name), every=1)
    logging = rp.training.LoggingOptions(progress=False)
    return rp.fit(repl, step_fn, state, input_fn, steps=2, checkpointing=saving, logging=logging)


print(f"process {info.process_index}: same trained to step {fit('same', make_step(1.0)).step}",
      flush=True)  # fmt: skip
different = os.environ.get("DIFFERENT_STEP") and info.process_index == 1
# a mesh of this process's devices only: a program of its own, not compared (nor gathered)
alone = rp.Replicator(devices=jax.local_devices())
state = alone.replicate({"w": jnp.zeros((4, 1), jnp.float32)})
logging = rp.training.LoggingOptions(progress=False)
alone_fit = rp.fit(alone, make_step(2.0 if different else 1.0), state, input_fn, steps=2,
                   logging=logging)  # fmt: skip
print(f"process {info.process_index}: alone trained to step {alone_fit.step}", flush=True)
fit("different", make_step(2.0 if different else 1.0))
print(f"process {info.process_index}: different trained", flush=True)
