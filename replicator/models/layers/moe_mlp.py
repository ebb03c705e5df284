"""A mixture-of-experts block's MLP (Mixtral's): `replicator.moe`'s experts, with the decoder's
MLP (its activation, gated or not) and biases, each sequence one routing group."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from replicator import moe
from replicator._src.core import collectives
from replicator._src.sharded.experts import EXPERT_AXIS
from replicator.models.config import GPTConfig
from replicator.models.layers.norms import norm


def _experts(config: GPTConfig) -> dict:
    """`moe.init`'s options for ``config``'s experts: gated with ``gated`` (Mixtral's SwiGLU),
    biases with ``bias``."""
    return dict(num_experts=config.num_experts, gated=config.gated, bias=config.bias)


def moe_params(config: GPTConfig, key, out_std: float) -> dict:
    """A mixture-of-experts block's MLP: `replicator.moe.init`'s experts (`_experts`)."""
    return moe.init(
        key, d_model=config.d_model, hidden=config.hidden, out_std=out_std, **_experts(config)
    )


def mixture(p: dict, x: jax.Array, config: GPTConfig) -> tuple[jax.Array, Any]:
    """``x`` plus the mixture of experts of its norm (`replicator.moe.apply`, each sequence one
    routing group), and its `replicator.moe.Stats` (``p``: one block, in ``x.dtype``).

    With ``config.moe_chunks`` above 1 the device's sequences go through the experts that many
    at a time, in a ``lax.scan`` whose chunks are computed again in the backward pass: each
    sequence is its own routing group, so the routing and the numbers are the same, and the
    experts' rows (``[tokens x top_k, hidden]``, several live in the backward) are a chunk's.
    """
    act = config.activation_fn

    def one(x):
        y, stats = moe.apply(
            p["moe"], norm(p["ln2"], x, config), routing=config.routing, activation=act
        )
        return x + (norm(p["post_mlp_norm"], y, config) if config.post_norms else y), stats

    chunks = config.moe_chunks
    if chunks == 1:
        return one(x)
    b, n = x.shape[0], collectives.auto_axis_size(EXPERT_AXIS)
    if b % (chunks * n):
        raise ValueError(
            f"GPTConfig: moe_chunks={chunks} must divide the {b} sequences a device's mixture "
            f"takes{f' into chunks that divide by the expert axis ({n})' if n > 1 else ''}; use "
            f"a divisor of {b // n}, or moe_chunks=1."
        )
    # chunk i: sequences i, i + chunks, ...: a split of the sequences over `expert` (in blocks)
    # holds as many of each chunk, so the chunks stay split as the sequences are
    to_chunks = lambda a: jnp.moveaxis(a.reshape(b // chunks, chunks, *a.shape[1:]), 1, 0)
    back = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, *a.shape[2:])
    ys, stats = jax.lax.scan(lambda _, xc: (None, jax.checkpoint(one)(xc)), None, to_chunks(x))[1]
    return back(ys), jax.tree.map(back, stats)
