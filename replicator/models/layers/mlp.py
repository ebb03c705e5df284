"""A block's MLP: ``down(act(up(x)))``, or gated, ``down(act(gate(x)) * up(x))``
(``GPTConfig.activation``, ``GPTConfig.gated``: GPT-2's GELU, Llama's SwiGLU, Gemma's GeGLU);
its parameters and its residual branch."""

from __future__ import annotations

import jax

from replicator.models.config import GPTConfig
from replicator.models.layers.common import linear, linears, normal, residual_branch
from replicator.models.layers.norms import norm


def mlp_params(config: GPTConfig, key, out_key, out_std: float) -> dict:
    d, h = config.d_model, config.hidden
    if config.gated:
        k_gate, k_up = jax.random.split(key)
        weights = {"gate": normal(k_gate, (d, h)), "up": normal(k_up, (d, h))}
    else:
        weights = {"up": normal(key, (d, h))}
    return linears(config, weights | {"down": normal(out_key, (h, d), out_std)})


def mlp(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """``x`` plus the MLP of its norm (``p``: one block, in ``x.dtype``); its products named
    ``mlpwi_0``, ``mlpwi_1`` (a gated MLP's gate and up) or ``mlpwi``, and ``mlpwo``."""
    y, w, act = norm(p["ln2"], x, config), p["mlp"], config.activation_fn
    if config.gated:
        h = act(linear(w, "gate", y, "mlpwi_0")) * linear(w, "up", y, "mlpwi_1")
    else:
        h = act(linear(w, "up", y, "mlpwi"))
    return residual_branch(x, p, "mlp", "down", h, "mlpwo", config)
