"""What the decoder weighs and costs: `num_params`, `model_shape` (the sizes `rp.plan` prices a
layout from) and `flops_per_token`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from replicator.models.config import GPTConfig

PyTree = Any


def num_params(params: PyTree) -> int:
    """The number of parameters: the elements of every leaf of ``params``.

    >>> num_params({"w": np.zeros((2, 3)), "b": np.zeros(3)})
    9
    """
    return int(sum(np.prod(np.shape(a)) for a in jax.tree.leaves(params)))


def model_shape(config: GPTConfig, global_batch: int, opt_slots: int = 2):
    """The sizes `rp.plan` prices a layout of this model's training step from.

    Args:
      config: the model's `GPTConfig`.
      global_batch: sequences a step.
      opt_slots: fp32 copies of the parameters in the optimizer's state (Adam's 2).

    Returns:
      An `rp.planner.ModelShape`.

    >>> model_shape(GPTConfig(d_model=64, num_layers=4, seq_len=64), 32).num_params
    236928
    """
    return rp.planner.ModelShape(
        num_layers=config.num_layers, d_model=config.d_model, num_heads=config.num_heads,
        kv_heads=config.kv_heads, head_dim=config.head_dim, hidden=config.hidden,
        vocab=config.vocab_size, seq_len=config.seq_len, global_batch=global_batch,
        gated=config.gated, bias=config.bias, layer_norm=config.norm == "layer",
        learned_positions=config.position == "learned", tied=config.tie_embeddings,
        compute_bytes=jnp.dtype(config.dtype).itemsize, opt_slots=opt_slots,
        attention=kernel if (kernel := config.attention) in ("dot_product", "splash")
        else "blockwise", experts=config.num_experts, top_k=config.top_k,
        capacity_factor=config.capacity_factor, moe_every=config.moe_every,
        qkv_bias=config.qkv_bias, loss_chunks=config.loss_chunks,
        moe_chunks=config.moe_chunks, residual_split=config.residual_split,
        reduce_bytes=4 if config.reduce_dtype is None else jnp.dtype(config.reduce_dtype).itemsize,
        local_layers=local_fraction(config), window=config.sliding_window or 0,
        post_norms=config.post_norms, qk_norm=config.qk_norm,
        whole_sequences=config.attn_softcap is not None or (
            config.windowed and config.sliding_window < config.seq_len),
        mixed_layers=len(set(config.attention_pattern)) > 1,
    )  # fmt: skip


def local_fraction(config: GPTConfig) -> float:
    """The fraction of the layers that attend over a sliding window."""
    kinds = [config.layer_kind(i) for i in range(config.num_layers)]
    return kinds.count("local") / config.num_layers


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token, ``6 N + 6 L S D`` (Kaplan et al.).

    N is the parameters a token uses: ``L (2 D^2 + 2 D KV hd + 2 D F)`` for the blocks
    (``3 D F`` for SwiGLU; a mixture's layer: its router's ``D E`` and ``top_k`` experts' MLPs,
    the active parameters, as MaxText and Megatron count them), plus the ``D V`` head, tied or
    not; ``6 L S D`` is attention over ``S`` positions.

    Args:
      config: the model's `GPTConfig`.

    Returns:
      FLOPs per token of a training step (forward and backward).

    >>> flops_per_token(GPTConfig(d_model=64, num_layers=4, seq_len=64, vocab_size=256))
    1376256.0
    """
    d, f, n_layers = config.d_model, config.hidden, config.num_layers
    attn = 2 * d * config.q_width + 2 * d * config.kv_heads * config.head_dim
    mlp = (3 if config.gated else 2) * d * f
    moe = config.num_moe_layers * ((config.top_k - 1) * mlp + d * config.num_experts)
    n = n_layers * (attn + mlp) + moe + d * config.vocab_size
    keys = model_shape(config, 1).attended_keys  # a sliding window's layers: its keys
    return float(6 * n + 6 * n_layers * keys * config.q_width)
