"""Positions: rotary frequencies (`rope_frequencies`, with Llama 3's rescaling) and the rotation of
queries and keys by them, and the order a sequence is laid out in (`sequence_order`: zigzag for
causal ring attention over a ``context`` axis)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.sharded import attention as attention_lib
from replicator.models.config import GPTConfig


def rope_frequencies(config: GPTConfig, kind: str = "global") -> np.ndarray:
    """The rotary inverse frequencies of one head.

    Args:
      config: the model's `GPTConfig`.
      kind: the layer's attention (`GPTConfig.layer_kind`): a ``"local"`` layer rotates by
        ``local_rope_theta``, unscaled, when it is set (Gemma 3's).

    Returns:
      ``[head_dim / 2]`` fp32: ``rope_theta ** (-2 i / head_dim)``, rescaled by
      ``config.rope_scaling`` (Llama 3's formula, as transformers computes it).

    >>> rope_frequencies(GPTConfig(d_model=8, num_heads=1, position="rope")).tolist()
    [1.0, 0.10000000149011612, 0.009999999776482582, 0.0010000000474974513]
    """
    hd, theta, scaling = config.head_dim, config.rope_theta, config.rope_scaling
    if kind == "local" and config.local_rope_theta is not None:
        theta, scaling = config.local_rope_theta, None
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    if scaling is not None and scaling.rope_type == "linear":
        inv = inv / scaling.factor
    elif scaling is not None:
        old = scaling.original_max_position_embeddings
        low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def positions(config: GPTConfig, seq_len: int) -> jax.Array:
    """Each place's position in the sequence as the model lays it out (`sequence_order`)."""
    order = sequence_order(config, seq_len)
    return jnp.arange(seq_len) if order is None else jnp.asarray(order)


def rope(
    q: jax.Array,
    k: jax.Array,
    pos: jax.Array,
    config: GPTConfig,
    heads_first: bool = False,
    kind: str = "global",
) -> tuple[jax.Array, jax.Array]:
    """Rotary positions on ``[B, S, heads, head_dim]`` queries and keys (``[B, heads, S,
    head_dim]`` with ``heads_first``), as transformers' Llama applies them: ``x * cos +
    rotate_half(x) * sin``, where ``rotate_half`` of a head's halves ``[x1, x2]`` is ``[-x2,
    x1]``, and ``cos`` and ``sin`` are of ``position * frequency`` (`rope_frequencies`, each
    twice), computed in fp32 and rounded to the activations' dtype, in which the rotation is
    computed (transformers' order of operations, so bf16 activations rotate in bf16). One table
    rotates both (under remat's ``prevent_cse`` two would be computed, and fused apart).
    ``kind`` is the layer's attention (`rope_frequencies`)."""
    freqs = pos.astype(jnp.float32)[:, None] * jnp.asarray(rope_frequencies(config, kind))
    angles = jnp.concatenate([freqs, freqs], -1)  # [S, head_dim]
    angles = angles if heads_first else angles[:, None]  # [S, 1, head_dim]: over the heads
    cos, sin = jnp.cos(angles).astype(q.dtype), jnp.sin(angles).astype(q.dtype)

    def rotate(x: jax.Array) -> jax.Array:
        x1, x2 = jnp.split(x, 2, axis=-1)
        return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin

    return rotate(q), rotate(k)


def sequence_order(config: GPTConfig, seq_len: int) -> np.ndarray | None:
    """The order the model lays its sequence out in inside a step.

    `loss`, `apply` and `pipeline_value_and_grad` reorder tokens and targets by it (the loss,
    a mean over tokens, is the same) and `apply` puts the logits back. A mixture-of-experts
    model keeps the natural order: its routing gives priority by position in the sequence, so
    with a capacity the dropped tokens would depend on the order.

    Args:
      config: the model's `GPTConfig`.
      seq_len: the sequence length.

    Returns:
      ``None`` (natural) unless causal ring attention runs over a ``context`` axis of
      ``C > 1`` devices with ``zigzag``, where it is `replicator.attention.zigzag_order`
      ``(seq_len, C)`` (each device then does the same work).
    """
    c = attention_lib.context_size()
    if c == 1 or config.attention != "ring" or not config.zigzag or config.num_experts:
        return None
    return attention_lib.zigzag_order(seq_len, c)


def layout(config: GPTConfig, seq_len: int) -> str:
    return "contiguous" if sequence_order(config, seq_len) is None else "zigzag"
