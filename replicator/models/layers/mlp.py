"""A block's MLP (``GPTConfig.mlp``): GPT-2's GELU, ``down(gelu(up(x)))``, or Llama's SwiGLU,
``down(silu(gate(x)) * up(x))``; its parameters and its residual branch."""

from __future__ import annotations

import jax

from replicator.models.config import GPTConfig
from replicator.models.layers.common import linear, linears, normal, residual
from replicator.models.layers.norms import norm


def mlp_params(config: GPTConfig, key, out_key, out_std: float) -> dict:
    d, h = config.d_model, config.hidden
    if config.mlp == "swiglu":
        k_gate, k_up = jax.random.split(key)
        weights = {"gate": normal(k_gate, (d, h)), "up": normal(k_up, (d, h))}
    else:
        weights = {"up": normal(key, (d, h))}
    return linears(config, weights | {"down": normal(out_key, (h, d), out_std)})


def mlp(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """``x`` plus the MLP of its norm (``p``: one block, in ``x.dtype``); its products named
    ``mlpwi_0``, ``mlpwi_1`` (SwiGLU's gate and up) or ``mlpwi``, and ``mlpwo``."""
    y, w = norm(p["ln2"], x, config), p["mlp"]
    if config.mlp == "swiglu":
        h = jax.nn.silu(linear(w, "gate", y, "mlpwi_0")) * linear(w, "up", y, "mlpwi_1")
    else:
        h = jax.nn.gelu(linear(w, "up", y, "mlpwi"))
    return residual(x, w, "down", h, "mlpwo")
