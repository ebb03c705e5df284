"""Attention with what the kernels of `replicator.attention` do not compute: a sliding window
(``GPTConfig.sliding_window`` on ``"local"`` layers) and soft-capped scores
(``GPTConfig.attn_softcap``), in XLA, whole sequences on each device; and over a key/value
cache (`replicator.models.generation`), whose keys are valid up to a length.

The scores are fp32, ``[B, KV, G, Sq, Sk]``: ``S x S`` a head, as ``jax.nn.dot_product_attention``
holds them. On a TPU, ``attention='splash'`` runs the same layers in the splash kernel (its
local masks and ``attn_logits_soft_cap``), without them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from replicator._src.sharded import attention as attention_lib


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_pos: jax.Array,
    k_pos: jax.Array,
    window: int | None = None,
    soft_cap: float | None = None,
    k_valid: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ``q`` ``[B, Sq, H, hd]`` over ``k``, ``v`` ``[B, Sk, KV, hd]``
    (``KV`` divides ``H``), scores ``q.k / sqrt(hd)``.

    Args:
      q, k, v: the queries, keys and values.
      q_pos, k_pos: ``[Sq]`` and ``[Sk]``: each query's and key's position; a query sees the
        keys at or before its own.
      window: a query at ``i`` sees only the keys at ``j > i - window``; None for all.
      soft_cap: the scores become ``soft_cap * tanh(scores / soft_cap)`` before the mask.
      k_valid: ``[B, Sk]`` bool, the keys that exist (a cache's filled entries); None for all.

    Returns:
      ``[B, Sq, H, hd]`` in ``v``'s dtype.

    Raises:
      ValueError: over a ``context`` axis (the sequence split over devices).

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((1, 4, 2, 8))
    >>> masked_attention(x, x[:, :, :1], x[:, :, :1], q_pos=jnp.arange(4), k_pos=jnp.arange(4),
    ...                  window=2, soft_cap=30.0).shape
    (1, 4, 2, 8)
    """
    c = attention_lib.context_size()
    if c > 1:
        raise ValueError(
            f"GPTConfig: sliding-window and soft-capped attention run on whole sequences, but "
            f"the mesh splits them over the {c} devices of 'context'; use a mesh without a "
            f"context axis (or attention='splash' on a TPU)."
        )
    b, sq, h, hd = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, sq, kv, h // kv, hd)
    f32 = jnp.float32
    scores = jnp.einsum("bqkgd,bpkd->bkgqp", qg, k, preferred_element_type=f32)
    scores = scores * (1.0 / math.sqrt(hd))
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    visible = visible[None, None, None]  # [1, 1, 1, Sq, Sk]
    if k_valid is not None:
        visible = visible & k_valid[:, None, None, None, :]
    scores = jnp.where(visible, scores, jnp.finfo(f32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqp,bpkd->bqkgd", weights, v, preferred_element_type=f32)
    return out.reshape(b, sq, h, hd).astype(v.dtype)
