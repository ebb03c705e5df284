"""A block's causal self-attention: its parameters (GPT-2's fused ``qkv``, or separate ``q``,
``k`` and ``v`` for grouped-query attention), the projections, and what attends
(``GPTConfig.attention``): ``jax.nn.dot_product_attention``, the TPU's splash kernel (heads first
with separate weights), or `replicator.attention` (ring or all-to-all over ``context``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import replicator as rp
from replicator._src.pipeline import remat
from replicator._src.sharded import attention as attention_lib
from replicator._src.sharded import splash
from replicator.models.config import GPTConfig
from replicator.models.layers.common import (
    is_stored,
    linear,
    linears,
    normal,
    residual_branch,
)
from replicator.models.layers.masked_attention import masked_attention
from replicator.models.layers.norms import norm, norm_params
from replicator.models.layers.rotary import layout, positions, rope


def attn_params(config: GPTConfig, key, out_key, out_std: float) -> dict:
    d, hd = config.d_model, config.head_dim
    if config.num_kv_heads is None:  # GPT-2's fused [q | k | v] columns, grouped by head
        weights = {"qkv": normal(key, (d, 3 * config.q_width))}
    else:
        kq, kk, kv = jax.random.split(key, 3)
        kv_width = config.kv_heads * hd
        weights = {
            "q": normal(kq, (d, config.num_heads * hd)),
            "k": normal(kk, (d, kv_width)),
            "v": normal(kv, (d, kv_width)),
        }
    out = linears(config, weights | {"out": normal(out_key, (config.q_width, d), out_std)})
    if config.qk_norm:  # one scale over each head's width, shared by the heads
        out |= {"q_norm": norm_params(config, hd), "k_norm": norm_params(config, hd)}
    return out


def project_qkv(p: dict, x: jax.Array, config: GPTConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``[B, S, H, hd]``, keys and values ``[B, S, KV, hd]`` of the normalised ``x``."""
    b, s, _ = x.shape
    nh, hd = config.num_heads, config.head_dim
    if config.num_kv_heads is None:
        qkv = linear(p, "qkv", x, "qkv_proj")
        # Columns grouped by head, [head, (q, k, v), head_dim] (Megatron's order): a contiguous
        # split of them over devices gives each device whole heads.
        return jnp.split(qkv.reshape(b, s, nh, 3 * hd), 3, axis=-1)  # no transpose
    heads = lambda name, n: linear(p, name, x, _LABELS[name]).reshape(b, s, n, hd)  # by head
    return heads("q", nh), heads("k", config.kv_heads), heads("v", config.kv_heads)


_LABELS = {"q": "query_proj", "k": "key_proj", "v": "value_proj"}


def attend(p: dict, x: jax.Array, config: GPTConfig, kind: str = "global") -> jax.Array:
    """``x`` plus causal self-attention of its norm (``p``: one block, in ``x.dtype``); its
    activations named for the remat policies by name (``query_proj``, ``key_proj``,
    ``value_proj`` or ``qkv_proj``, ``context``, ``out_proj``). ``kind`` is the layer's
    attention, ``"global"`` or ``"local"`` (`GPTConfig.layer_kind`)."""
    if heads_first(config):
        return _attend_heads_first(p, x, config, kind)
    b, s, _ = x.shape
    q, k, v = project_qkv(p["attn"], norm(p["ln1"], x, config), config)
    q, k = prepare_qk(p["attn"], q, k, positions(config, s), config, kind)
    window, cap = masking(config, kind, s)
    local = {"window": window, "soft_cap": cap} if window or cap else {}
    if config.attention == "splash":
        attn = splash.splash_attention(q, k, v, **local)
    elif local:
        pos = positions(config, s)
        attn = masked_attention(q, k, v, q_pos=pos, k_pos=pos, **local)
    elif config.attention == "dot_product":
        attn = _dot_product_attention(q, k, v)
    else:  # grouped-query attention: K/V travel with their own heads (replicator.attention)
        order = layout(config, s)
        attn = attention_lib.attention(q, k, v, causal=True, impl=config.attention, layout=order)
    context = remat.named(attn.reshape(b, s, config.q_width), "context")
    return residual_branch(x, p, "attn", "out", context, "out_proj", config)


def masking(config: GPTConfig, kind: str, seq_len: int) -> tuple[int | None, float | None]:
    """A layer's ``(window, soft_cap)``: its sliding window where it is shorter than the
    sequence (a longer one masks nothing), and the scores' soft cap; Nones where unused."""
    window = config.sliding_window if kind == "local" else None
    return (window if window and window < seq_len else None), config.attn_softcap


def prepare_qk(
    a: dict, q: jax.Array, k: jax.Array, pos: jax.Array, config: GPTConfig, kind: str,
    heads_first: bool = False,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Queries and keys as attention takes them: normed by head (``qk_norm``), rotated by
    ``pos`` (rotary positions, the layer's base), and the queries scaled so that the kernels'
    ``1 / sqrt(head_dim)`` gives ``query_scale``."""
    if config.qk_norm:
        q, k = norm(a["q_norm"], q, config), norm(a["k_norm"], k, config)
    if config.position == "rope":  # by position in the sequence's layout (zigzag or not)
        q, k = rope(q, k, pos, config, heads_first=heads_first, kind=kind)
    if config.query_scale is not None:
        q = q * jnp.asarray(config.query_scale * math.sqrt(config.head_dim), q.dtype)
    return q, k


def heads_first(config: GPTConfig) -> bool:
    """Whether the blocks attend with their heads first (`_attend_heads_first`): the splash
    kernel's layout, for separate query, key and value weights."""
    return config.attention == "splash" and config.num_kv_heads is not None


def _attend_heads_first(p: dict, x: jax.Array, config: GPTConfig, kind: str) -> jax.Array:
    """`attend` in the splash kernel's layout: queries, keys and values projected straight to
    ``[B, heads, S, head_dim]``, and the output projected back from it, by weights
    `weights_heads_first` laid out ``[heads, head_dim, D]``. No activation changes layout on
    its way to the kernel and back (each would be a copy of it, forward and backward)."""
    xn, a = norm(p["ln1"], x, config), p["attn"]

    def project(name: str) -> jax.Array:
        y = remat.named(jnp.einsum("bsd,hkd->bhsk", xn, a[name]), _LABELS[name])
        bias = a.get(f"{name}_bias")
        return y if bias is None else y + bias.reshape(-1, 1, config.head_dim)

    q, k, v = project("q"), project("k"), project("v")
    pos = positions(config, x.shape[1])
    q, k = prepare_qk(a, q, k, pos, config, kind, heads_first=True)
    window, cap = masking(config, kind, x.shape[1])
    local = {"window": window, "soft_cap": cap} if window or cap else {}
    context = remat.named(splash.splash_attention_heads_first(q, k, v, **local), "context")
    y = remat.named(jnp.einsum("bhsk,hkd->bsd", context, a["out"]), "out_proj")
    if config.post_norms:
        y = y + a["out_bias"] if "out_bias" in a else y
        return x + norm(p["post_attn_norm"], y, config)
    y = x + y
    return y + a["out_bias"] if "out_bias" in a else y


def weights_heads_first(attn: dict, config: GPTConfig) -> dict:
    """The attention's weights for `_attend_heads_first`: ``q``, ``k``, ``v`` (``[D, heads
    head_dim]``) and ``out`` (``[heads head_dim, D]``), each as ``[heads, head_dim, D]``.

    A ZeRO-3 weight is rearranged as its part, before its gather: the gather then brings it in
    the layout the TPU's matmuls read, where a gathered weight rearranged would be copied whole.
    A part split across a head (or over ``model``) is gathered first."""
    hd = config.head_dim
    heads = lambda w: w.reshape(*w.shape[:-1], -1, hd)  # [..., X, H hd] -> [..., X, H, hd]
    moved = {
        n: _rearranged(attn[n], lambda w: jnp.moveaxis(heads(w), -3, -1), {-2: -1, -1: -3}, hd)
        for n in ("q", "k", "v")
    }
    out = lambda w: w.reshape(*w.shape[:-2], -1, hd, w.shape[-1])
    moved["out"] = _rearranged(attn["out"], out, {-2: -3, -1: -1}, hd)
    return {**attn, **moved}


def _rearranged(a: Any, f: Callable, dims: dict, head_dim: int) -> Any:
    """``f`` of a weight ``a``; of a ZeRO-3 weight's part where ``f`` keeps each replica's part
    its own (``dims``: its split axis, before to after), else of the gathered weight."""
    if not is_stored(a):
        return f(a)
    if a.dim is None:
        return a.like(f(a.value), None)
    new_dim = dims.get(a.dim)
    if a.auto or new_dim is None or (new_dim == -3 and a.value.shape[a.dim] % head_dim):
        return f(rp.gather_params(a))
    return a.like(f(a.value), new_dim)


def _dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``jax.nn.dot_product_attention``, causal, with fewer key/value heads as they are."""
    c = attention_lib.context_size()
    if c > 1:
        raise ValueError(
            f"GPTConfig(attention='dot_product') attends over whole sequences, but the mesh "
            f"splits them over the {c} devices of 'context'; use attention='ring' or "
            f"'all_to_all' there."
        )
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
