"""A block's MLP (``GPTConfig.mlp``): GPT-2's GELU, ``down(gelu(up(x)))``, or Llama's SwiGLU,
``down(silu(gate(x)) * up(x))``; its parameters and its residual branch."""

from __future__ import annotations

import jax

from replicator.models.config import GPTConfig
from replicator.models.layers.common import _linear, _linears, _normal, _residual
from replicator.models.layers.norms import _norm


def _mlp_params(config: GPTConfig, key, out_key, out_std: float) -> dict:
    d, h = config.d_model, config.hidden
    if config.mlp == "swiglu":
        k_gate, k_up = jax.random.split(key)
        weights = {"gate": _normal(k_gate, (d, h)), "up": _normal(k_up, (d, h))}
    else:
        weights = {"up": _normal(key, (d, h))}
    return _linears(config, weights | {"down": _normal(out_key, (h, d), out_std)})


def _mlp(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """``x`` plus the MLP of its norm (``p``: one block, in ``x.dtype``)."""
    y, mlp = _norm(p["ln2"], x, config), p["mlp"]
    if config.mlp == "swiglu":
        h = jax.nn.silu(_linear(mlp, "gate", y)) * _linear(mlp, "up", y)
    else:
        h = jax.nn.gelu(_linear(mlp, "up", y))
    return _residual(x, mlp, "down", h)
