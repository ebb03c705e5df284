"""A mixture-of-experts block's MLP (Mixtral's): `replicator.moe`'s experts, with the decoder's
MLP (``gelu`` or ``swiglu``) and biases, each sequence one routing group."""

from __future__ import annotations

from typing import Any

import jax

from replicator import moe
from replicator.models.config import GPTConfig
from replicator.models.layers.norms import norm


def _experts(config: GPTConfig) -> dict:
    """`moe.init`'s options for ``config``'s experts: SwiGLU experts with ``mlp="swiglu"``
    (Mixtral's), biases with ``bias``."""
    return dict(num_experts=config.num_experts, gated=config.mlp == "swiglu", bias=config.bias)


def moe_params(config: GPTConfig, key, out_std: float) -> dict:
    """A mixture-of-experts block's MLP: `replicator.moe.init`'s experts (`_experts`)."""
    return moe.init(
        key, d_model=config.d_model, hidden=config.hidden, out_std=out_std, **_experts(config)
    )


def mixture(p: dict, x: jax.Array, config: GPTConfig) -> tuple[jax.Array, Any]:
    """``x`` plus the mixture of experts of its norm (`replicator.moe.apply`, each sequence one
    routing group), and its `replicator.moe.Stats` (``p``: one block, in ``x.dtype``)."""
    act = jax.nn.silu if config.mlp == "swiglu" else jax.nn.gelu
    y, stats = moe.apply(
        p["moe"], norm(p["ln2"], x, config), routing=config.routing, activation=act
    )
    return x + y, stats
