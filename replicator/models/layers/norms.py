"""The norms (``GPTConfig.norm``): LayerNorm and RMSNorm, their parameters and their apply, in
fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replicator.models.config import GPTConfig


def has_bias(config: GPTConfig) -> bool:
    return config.norm == "layer" and config.bias


def norm_params(config: GPTConfig, width: int | None = None) -> dict:
    """A norm over ``width`` (``d_model``): its scale (``1 - norm_offset``: the identity) and,
    for a LayerNorm with biases, its bias."""
    d = width or config.d_model
    scale = jnp.full((d,), 1.0 - config.norm_offset, jnp.float32)
    if not has_bias(config):
        return {"scale": scale}
    return {"scale": scale, "bias": jnp.zeros((d,), jnp.float32)}


def norm(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """LayerNorm or RMSNorm (``config.norm``) of the last axis, in fp32, back in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    if config.norm == "rms":
        ms = jnp.mean(x32 * x32, -1, keepdims=True)
        scale = p["scale"] + config.norm_offset if config.norm_offset else p["scale"]
        return (x32 * jax.lax.rsqrt(ms + config.norm_eps) * scale).astype(x.dtype)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.mean((x32 - mean) ** 2, -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + config.norm_eps) * p["scale"]
    if "bias" in p:
        y = y + p["bias"]
    return y.astype(x.dtype)
