"""The MLP job (``model.kind: mlp``): a residual MLP regression, data parallel (ZeRO 0-3,
accumulation), on generated data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from replicator.cli.config import TrainConfig
from replicator.cli.jobs.base import Job, first_batch, local_sgd, sliced, zero_axes
from replicator.models import mlp


def mlp_job(config: TrainConfig, repl, make_tx) -> Job:
    m = config.model

    def init_params():  # host arrays (the model is small)
        rng = np.random.default_rng(0)
        normal = lambda *shape, div: (rng.normal(size=shape) / div).astype(np.float32)
        embed = {"w": normal(16, m.d_model, div=4)}  # drawn in this order
        w = normal(m.layers, m.d_model, m.d_model, div=np.sqrt(m.d_model))
        layers = {"w": w, "b": np.zeros((m.layers, m.d_model), np.float32)}
        head = {"w": normal(m.d_model, 1, div=np.sqrt(m.d_model))}
        return {"embed": embed, "layers": layers, "head": head}

    @jax.checkpoint
    def layer(h, p):
        p = rp.gather_params(p)  # ZeRO-3: one layer's parameters at a time
        return h + jnp.tanh(h @ p["w"] + p["b"]), None

    def loss_fn(p, batch):
        h = batch["x"] @ rp.gather_params(p["embed"])["w"]
        h, _ = jax.lax.scan(layer, h, p["layers"])
        return jnp.mean((h @ rp.gather_params(p["head"])["w"] - batch["y"]) ** 2)

    opt = repl.wrap_optimizer(
        make_tx(jax.eval_shape(init_params)),
        zero_stage=config.zero_stage,
        accumulate_steps=config.accumulate_steps,
        clip_global_norm=config.clip_global_norm,
        **local_sgd(config),
        **zero_axes(config),
    )

    def init():
        params = init_params()
        if config.zero_stage == 3:
            placed = opt.shard_params(params, stacked=["layers"])
        else:
            placed = repl.replicate(params)
        return {"params": placed, "opt": opt.init(placed)}

    def input_fn(ctx):
        make = lambda n: mlp.regression_batches(n, seed=1)
        yield from sliced(make, ctx, config.global_batch)

    def step_fn(state, batch):
        p, o, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": p, "opt": o}, metrics

    return Job(step_fn, init, input_fn, first_batch(input_fn), None, None)
