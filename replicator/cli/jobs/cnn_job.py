"""The CNN job (``model.kind: cnn``): a classifier with cross-replica BatchNorm on generated
shape images, data parallel."""

from __future__ import annotations

import optax
from flax import nnx

import replicator as rp
from replicator.cli.config import TrainConfig
from replicator.cli.jobs.base import Job, first_batch, sliced, zero_axes
from replicator.models import cnn


def cnn_job(config: TrainConfig, repl, make_tx) -> Job:
    """The CNN with cross-replica BatchNorm on `shape_images`, data parallel: the BatchNorm
    statistics travel in the state next to the parameters, and are the same on every replica."""

    def new_model():
        return cnn.CNN(
            in_channels=1,
            num_classes=len(cnn.CLASS_NAMES),
            width=config.model.width,
            rngs=nnx.Rngs(0),
        )

    graphdef, shapes, _ = nnx.split(nnx.eval_shape(new_model), nnx.Param, nnx.BatchStat)
    tx = repl.wrap_optimizer(
        make_tx(shapes),
        zero_stage=config.zero_stage,
        clip_global_norm=config.clip_global_norm,
        **zero_axes(config),
    )

    def input_fn(ctx):
        yield from sliced(lambda n: cnn.shape_batches(n, seed=1000), ctx, config.global_batch)

    def step_fn(state, batch):
        (loss, (stats, accuracy)), grads = cnn.value_and_grad(
            graphdef, state["params"], state["stats"], batch
        )
        updates, opt = tx.update(grads, state["opt"], state["params"])  # mean over replicas
        params = optax.apply_updates(state["params"], updates)
        metrics = rp.all_reduce({"loss": loss, "accuracy": accuracy}, "mean")
        return {"params": params, "stats": stats, "opt": opt}, metrics

    def init():
        _, params, stats = nnx.split(new_model(), nnx.Param, nnx.BatchStat)
        params, stats = repl.replicate(params), repl.replicate(stats)
        return {"params": params, "stats": stats, "opt": tx.init(params)}

    return Job(step_fn, init, input_fn, first_batch(input_fn), None, len(cnn.CLASS_NAMES))
