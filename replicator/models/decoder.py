"""The decoder, assembled from its layers (`replicator.models.layers`).

`init`'s parameters, `embed`, the pre-norm `block` (and `moe_block`, its MLP a mixture of
experts), the stacked `blocks` as one ``lax.scan``, the pipeline's `stage_fn`, the head
(`output_head`, `head_logits`, `head_loss`), and the whole model on one device: `apply`, `loss`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from replicator import moe, pipeline
from replicator._src.core import placement, sharded_params
from replicator._src.core.mesh import MODEL_AXIS
from replicator._src.pipeline import remat
from replicator._src.pipeline.remat import as_remat, never_gathered
from replicator._src.planner.enumeration import divisors
from replicator._src.sharded import attention as attention_lib
from replicator._src.sharded import embedding as embedding_lib
from replicator.models.config import DEFAULT, GPTConfig
from replicator.models.layers import chunked_loss
from replicator.models.layers.common import is_stored, reduce_cast
from replicator.models.layers.mlp import mlp, mlp_params
from replicator.models.layers.moe_mlp import mixture, moe_params
from replicator.models.layers.norms import norm, norm_params
from replicator.models.layers.rotary import sequence_order
from replicator.models.layers.self_attention import (
    attend,
    attn_params,
    heads_first,
    weights_heads_first,
)

PyTree = Any


def _block_params(config: GPTConfig, key, *, experts: bool = False) -> dict:
    k = jax.random.split(key, 4)
    out_std = 0.02 / math.sqrt(2 * config.num_layers)  # GPT-2: scaled residual projections
    params = {
        "ln1": norm_params(config),
        "attn": attn_params(config, k[0], k[1], out_std),
        "ln2": norm_params(config),
    }
    if experts:
        params["moe"] = moe_params(config, k[2], out_std)
        return params
    params["mlp"] = mlp_params(config, k[2], k[3], out_std)
    return params


def init(config: GPTConfig, key: jax.Array) -> dict:
    """Parameters: ``{"embed": {...}, "blocks": <stacked over num_layers>, "head": {...}}``.

    The leaves of one block (`LOGICAL_AXES`, `logical_axes_for`): ``ln1`` and ``ln2`` (``scale``,
    and ``bias`` for a LayerNorm with biases), ``attn`` (``qkv`` ``[D, 3 D]``, or with
    ``num_kv_heads`` ``q`` ``[D, H hd]``, ``k`` and ``v`` ``[D, KV hd]``, their columns
    head-major; then ``out`` ``[H hd, D]``) and ``mlp`` (``gate`` for SwiGLU, ``up`` ``[D, F]``,
    ``down`` ``[F, D]``), each linear layer followed by its ``*_bias`` when ``config.bias``.
    ``embed`` holds ``tokens`` ``[V, D]`` (and ``positions`` ``[seq_len, D]`` with learned
    positions), ``head`` its ``norm`` and ``w`` ``[D, V]`` (none when ``tie_embeddings``).
    With ``num_experts`` the blocks come in groups of ``moe_every``, stacked over the
    ``num_layers / moe_every`` groups: ``{"moe": <the group's mixture-of-experts block>}`` and,
    when ``moe_every > 1``, ``"dense"``: its ``moe_every - 1`` dense blocks, stacked again.

    Args:
      config: the model's `GPTConfig`.
      key: the random key.

    Returns:
      fp32 parameters: weights normal, biases zero, norm scales one.

    >>> import jax
    >>> config = GPTConfig(d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=48,
    ...                    norm="rms", position="rope", mlp="swiglu", bias=False,
    ...                    tie_embeddings=True)
    >>> params = jax.eval_shape(lambda: init(config, jax.random.key(0)))
    >>> jax.tree.map(lambda a: a.shape, params["blocks"]["attn"])
    {'k': (2, 32, 16), 'out': (2, 32, 32), 'q': (2, 32, 32), 'v': (2, 32, 16)}
    >>> sorted(params["embed"]), sorted(params["head"]), sorted(params["blocks"]["mlp"])
    (['tokens'], ['norm'], ['down', 'gate', 'up'])
    """
    k_tok, k_pos, k_head, k_blocks = jax.random.split(key, 4)
    d = config.d_model
    keys = jax.random.split(k_blocks, config.num_layers)
    stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
    if config.num_experts:
        n = config.moe_every
        groups = [
            {"moe": _block_params(config, keys[g * n + n - 1], experts=True)}
            | (
                {"dense": stack([_block_params(config, k) for k in keys[g * n : g * n + n - 1]])}
                if n > 1
                else {}
            )
            for g in range(config.num_layers // n)
        ]
        blocks = stack(groups)
    else:
        blocks = stack([_block_params(config, k) for k in keys])
    embed = {"tokens": 0.02 * jax.random.normal(k_tok, (config.vocab_size, d), jnp.float32)}
    if config.position == "learned":
        embed["positions"] = 0.01 * jax.random.normal(k_pos, (config.seq_len, d), jnp.float32)
    head = {"norm": norm_params(config)}
    if not config.tie_embeddings:
        head["w"] = 0.02 * jax.random.normal(k_head, (d, config.vocab_size), jnp.float32)
    return {"embed": embed, "blocks": blocks, "head": head}


def embed(
    embed_params: dict, tokens: jax.Array, order: np.ndarray | None = None, dtype: Any = None
) -> jax.Array:
    """Token plus position embeddings: ``[B, S]`` int tokens to ``[B, S, D]``.

    With rotary positions (no ``"positions"`` table) these are the tokens' embeddings only: the
    blocks rotate queries and keys by the positions of the same order. ZeRO-3 parameters
    (`rp.ShardedParam`) are gathered here, where they are used; plain arrays pass through (so
    are `block`'s and `head_logits`'). A token table ZeRO splits by rows (its vocabulary) is not
    gathered: each replica looks up the tokens in its own rows (`sharded_params.take_rows`);
    each device scatters its own tokens' cotangents where that moves fewer bytes
    (`replicator._src.sharded.embedding.lookup`).

    Args:
      embed_params: ``params["embed"]`` of `init`.
      tokens: ``[B, S]`` int tokens.
      order: a `sequence_order`: the tokens are taken, and their positions given, in that
        order; None for the natural one.
      dtype: the result's dtype; None for the table's.

    Returns:
      ``[B, S, D]`` embeddings, held split over the token axes.
    """
    s = tokens.shape[-1]
    positions = rp.gather_params(embed_params.get("positions"))
    positions = None if positions is None else positions[:s]
    if order is not None:
        tokens = tokens[..., order]
        positions = None if positions is None else positions[order]
    x = embedding_lib.lookup(
        rp.to_device(embed_params["tokens"]), tokens, None if positions is not None else dtype
    )
    x = x if positions is None else x + positions
    return attention_lib.constrain_tokens(x if dtype is None else x.astype(dtype))


def _gathered(params: dict, config: GPTConfig) -> dict:
    """`rp.gather_params` of ``params``, the stored parts cast to ``config.reduce_dtype`` first
    (so their gradients are reduce-scattered in it) when it is set."""
    return rp.gather_params(reduce_cast(rp.to_device(params), config))


def _cast(layer_params: dict, config: GPTConfig) -> dict:
    """One layer's parameters, gathered (`_gathered`), in ``config.dtype``; the attention's in
    `weights_heads_first`'s layout when the block attends heads first."""
    p = reduce_cast(rp.to_device(layer_params), config)  # kept on the host: its layer alone
    if heads_first(config):
        p = {**p, "attn": weights_heads_first(p["attn"], config)}
    return jax.tree.map(lambda a: a.astype(config.dtype), rp.gather_params(p))


def block(layer_params: dict, x: jax.Array, *, config: GPTConfig) -> jax.Array:
    """One pre-norm decoder block: causal self-attention, then an MLP, each residual.

    Over a ``context`` axis the block holds each device's chunk of the sequence, and attention
    is `replicator.attention.attention` (``config.attention``).

    Args:
      layer_params: one layer of ``params["blocks"]``; ZeRO-3 parameters are gathered here,
        inside the layer scan, one layer at a time.
      x: ``[B, S, D]`` activations.
      config: the model's `GPTConfig`.

    Returns:
      ``[B, S, D]`` in ``config.dtype``.
    """
    p = _cast(layer_params, config)
    x = attend(p, _layer_input(x, config), config)
    return attention_lib.constrain_tokens(mlp(p, x, config))


def _layer_input(x: jax.Array, config: GPTConfig) -> jax.Array:
    """A block's input in the compute dtype, named ``decoder_layer_input`` (`remat`); split
    over ``model`` by its width with ``config.residual_split``."""
    width = MODEL_AXIS if config.residual_split else None
    x = attention_lib.constrain_tokens(x.astype(config.dtype), width)
    return remat.named(x, "decoder_layer_input")


def moe_block(layer_params: dict, x: jax.Array, *, config: GPTConfig) -> tuple[jax.Array, Any]:
    """A block whose MLP is a mixture of experts (`replicator.moe.apply`).

    Each sequence is one routing group.

    Args:
      layer_params: the ``"moe"`` block of one group of ``params["blocks"]``.
      x: ``[B, S, D]`` activations.
      config: the model's `GPTConfig`.

    Returns:
      ``(x, stats)``: ``stats`` a `replicator.moe.Stats` of per-sequence values.
    """
    p = _cast(layer_params, config)
    x = attend(p, _layer_input(x, config), config)
    x, stats = mixture(p, x, config)
    return attention_lib.constrain_tokens(x), stats


def _group(params: dict, x: jax.Array, config: GPTConfig) -> tuple[jax.Array, Any]:
    """One group of `init`'s MoE layout: its dense blocks, then its mixture-of-experts block."""
    for i in range(config.moe_every - 1):
        x = block(jax.tree.map(lambda a, i=i: a[i], params["dense"]), x, config=config)
    return moe_block(params["moe"], x, config=config)


def blocks_and_stats(
    stacked_params: dict, x: jax.Array, *, config: GPTConfig
) -> tuple[jax.Array, Any]:
    """Every block in order, and the mixture-of-experts statistics summed over its blocks.

    The blocks run as a ``lax.scan`` over the leading layer (group) axis. With ``config.remat``
    each block keeps what its policy says for the backward pass (``jax.checkpoint``), and
    ZeRO-3 parameters are gathered again there (`rp.regather_policy`) rather than kept.

    Args:
      stacked_params: ``params["blocks"]`` of `init`, stacked over the layers (or groups).
      x: ``[B, S, D]`` activations.
      config: the model's `GPTConfig`.

    Returns:
      ``(x, stats)``: ``stats`` a `replicator.moe.Stats` summed over the MoE blocks, or None
      for a dense model.
    """
    if config.num_experts:
        step = lambda carry, p: _summed(carry, _group(p, carry[0], config))
        b = x.shape[0]
        zeros = moe.Stats(jnp.zeros((b,), jnp.float32), *(jnp.zeros((b,), jnp.int32),) * 2)
        carry = (x, zeros)
    else:
        step = lambda h, p: (block(p, h, config=config), None)
        carry = x
    # ZeRO-3 parts cast to reduce_dtype once, before the scan: the backward scan then stacks
    # their gradients in that dtype too (half the fp32 stack's bytes for bf16), the same values
    # (the cast's transpose converts each reduce-scattered part exactly)
    # (parameters kept in host memory, `rp.to_host`, are cast a layer at a time, in `_cast`,
    # each layer brought to the device alone)
    if not any(map(placement.in_host_memory, jax.tree.leaves(stacked_params))):
        stacked_params = reduce_cast(stacked_params, config)
    policy = as_remat(config.remat, "GPTConfig")
    if policy.recomputes or _stored_sharded(stacked_params):  # ZeRO-3: gathered again backward
        # in a scan XLA cannot merge the recomputation with the forward; unrolled it could
        step = jax.checkpoint(
            step, policy=never_gathered(policy), prevent_cse=not config.scan_layers
        )
    out = jax.lax.scan(step, carry, stacked_params, unroll=not config.scan_layers)[0]
    return out if config.num_experts else (out, None)


def _summed(carry, result):
    (_, total), (x, stats) = carry, result
    return (x, jax.tree.map(jnp.add, total, stats)), None


def blocks(stacked_params: dict, x: jax.Array, *, config: GPTConfig) -> jax.Array:
    """Every block in order (`blocks_and_stats` without the statistics).

    Equivalent to: ``for p in stacked_params: x = block(p, x, config=config)``.

    Args:
      stacked_params: ``params["blocks"]`` of `init`.
      x: ``[B, S, D]`` activations.
      config: the model's `GPTConfig`.

    Returns:
      ``[B, S, D]`` activations.
    """
    return blocks_and_stats(stacked_params, x, config=config)[0]


def _stored_sharded(tree: PyTree) -> bool:
    return any(map(is_stored, jax.tree.leaves(tree, is_leaf=is_stored)))


def stage_fn(config: GPTConfig) -> Callable[[dict, jax.Array], jax.Array]:
    """``f(stage_params, x) -> x`` for the pipeline: the blocks of one stage (``[Lv, ...]``).

    It is built with `replicator.pipeline.scan_layers`, so the pipeline steps through the
    blocks one by one.

    Args:
      config: the model's `GPTConfig`.

    Returns:
      The stage function; its output has ``x``'s dtype.
    """
    return pipeline.scan_layers(lambda p, x: block(p, x, config=config).astype(x.dtype))


def output_head(params: dict, *, config: GPTConfig) -> dict:
    """The head's parameters with its output matrix: what `head_logits` and `head_loss` take.

    Args:
      params: `init`'s parameters.
      config: the model's `GPTConfig`.

    Returns:
      ``params["head"]``; with ``tie_embeddings``, with ``"w"`` too: the token table
      transposed (gathered, for ZeRO-3).

    >>> import jax
    >>> config = GPTConfig(d_model=16, num_heads=2, num_layers=1, tie_embeddings=True)
    >>> head = jax.eval_shape(lambda: output_head(init(config, jax.random.key(0)), config=config))
    >>> head["w"].shape
    (16, 256)
    """
    if not config.tie_embeddings:
        return params["head"]
    tokens = rp.gather_params(reduce_cast(rp.to_device(params["embed"]["tokens"]), config))
    return {**params["head"], "w": tokens.T}


def head_logits(head_params: dict, x: jax.Array, *, config: GPTConfig | None = None) -> jax.Array:
    """Final norm and output matrix: ``[B, S, D]`` to fp32 logits ``[B, S, V]``.

    Args:
      head_params: `output_head`'s.
      x: ``[B, S, D]`` activations.
      config: gives the norm; None for `GPTConfig`'s defaults.

    Returns:
      fp32 logits ``[B, S, V]``.

    Raises:
      ValueError: if the head has no output matrix (pass `output_head`'s parameters).
    """
    config = DEFAULT if config is None else config
    head_params = _gathered(head_params, config)
    if "w" not in head_params:
        raise ValueError(
            "gpt.head_logits: the head has no output matrix 'w' (a model with "
            "tie_embeddings=True); pass gpt.output_head(params, config=config)."
        )
    x = norm(head_params["norm"], x.astype(jnp.float32), config)
    return x @ head_params["w"]


def head_loss(
    head_params: dict, x: jax.Array, targets: jax.Array, *, config: GPTConfig | None = None
) -> jax.Array:
    """Mean token cross-entropy of the head on ``x``, in fp32: the pipeline's ``loss_fn``.

    Each token's loss is ``logsumexp(logits) - logits[target]``, the target's logit picked by a
    sum against its one-hot mask (exact: one non-zero term), so that the loss and its gradient
    (``softmax - one_hot``) fuse into passes over the logits, with no ``[B, S, V]`` log-softmax
    kept and no gather or scatter on it (forward-mode autodiff applies too). With
    ``config.loss_chunks`` above 1 the tokens are taken that many at a time in a ``lax.scan``
    (MaxText's ``num_vocab_tiling``), each chunk's gradient taken in the forward pass while its
    logits are live: one chunk's fp32 logits and their gradient are live at once, not the
    device's whole ``[B, S, V]``, and the head's matmul is not repeated.

    Args:
      head_params: `output_head`'s.
      x: ``[B, S, D]`` activations.
      targets: ``[B, S]`` int targets, indexed as JAX indexes (negative ones from the end,
        others clamped).
      config: gives the norm and ``loss_chunks``; None for `GPTConfig`'s defaults.

    Returns:
      The mean loss, an fp32 scalar.

    Raises:
      ValueError: if ``config.loss_chunks`` does not divide the tokens (``B * S``).

    >>> import dataclasses, jax, jax.numpy as jnp
    >>> config = GPTConfig(d_model=16, num_heads=2, num_layers=1, vocab_size=32)
    >>> head = output_head(init(config, jax.random.key(0)), config=config)
    >>> x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    >>> targets = jnp.arange(16).reshape(2, 8)
    >>> whole = head_loss(head, x, targets, config=config)
    >>> chunked = head_loss(head, x, targets, config=dataclasses.replace(config, loss_chunks=4))
    >>> bool(jnp.allclose(whole, chunked, rtol=1e-6))
    True
    """
    config = DEFAULT if config is None else config
    chunks = config.loss_chunks
    if chunks == 1:
        return jnp.mean(_token_losses(head_params, x, targets, config))
    tokens = math.prod(targets.shape)
    if tokens % chunks:
        raise ValueError(
            f"gpt.head_loss: loss_chunks={chunks} must divide the {tokens} tokens the head "
            f"takes on each device ({' x '.join(map(str, targets.shape))}); use a divisor of "
            f"{tokens}, such as {_divisor_near(tokens, chunks)}, or loss_chunks=1."
        )
    xs = x.reshape(chunks, tokens // chunks, x.shape[-1])
    ts = targets.reshape(chunks, tokens // chunks)
    loss = functools.partial(_summed_losses, config=config)
    gather = functools.partial(_gathered, config=config)
    return chunked_loss.chunked_sum(loss, gather, head_params, xs, ts) / tokens


def _summed_losses(head_params: dict, x: jax.Array, targets: jax.Array, *, config) -> jax.Array:
    return jnp.sum(_token_losses(head_params, x, targets, config))


def _token_losses(head_params: dict, x: jax.Array, targets: jax.Array, config) -> jax.Array:
    """Each token's cross-entropy, ``logsumexp(logits) - logits[target]``, in fp32."""
    logits = head_logits(head_params, x, config=config)
    v = logits.shape[-1]
    targets = sharded_params.in_range(targets, v)
    one_hot = (
        jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
    )
    picked = jnp.sum(jnp.where(one_hot, logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def _divisor_near(n: int, k: int) -> int:
    """The divisor of ``n`` nearest ``k`` (the smaller on a tie)."""
    return min(divisors(n), key=lambda d: (abs(d - k), d))


def apply(params: dict, tokens: jax.Array, *, config: GPTConfig) -> jax.Array:
    """The whole model: ``[B, S]`` tokens to fp32 logits ``[B, S, V]``, in the tokens' order.

    Args:
      params: `init`'s parameters.
      tokens: ``[B, S]`` int tokens.
      config: the model's `GPTConfig`.
    """
    order = sequence_order(config, tokens.shape[-1])
    x = embed(params["embed"], tokens, order, config.dtype)
    x = blocks(params["blocks"], x, config=config)
    logits = head_logits(output_head(params, config=config), x, config=config)
    return logits if order is None else logits[:, np.argsort(order)]


def loss_and_stats(
    params: dict, tokens: jax.Array, targets: jax.Array, *, config: GPTConfig
) -> tuple[jax.Array, dict]:
    """`loss`, and what the mixture-of-experts blocks did.

    Args:
      params: `init`'s parameters.
      tokens: ``[B, S]`` int tokens.
      targets: ``[B, S]`` int targets.
      config: the model's `GPTConfig`.

    Returns:
      ``(loss, stats)``: the loss is the cross-entropy plus ``aux_weight * aux_loss``;
      ``stats`` is ``{"cross_entropy", "aux_loss", "dropped", "routed"}`` (the counts summed
      over the batch and the MoE blocks, ``aux_loss`` the mean over sequences and MoE blocks),
      empty for a dense model.
    """
    order = sequence_order(config, tokens.shape[-1])
    if order is not None:  # a mean over tokens: the same in any order (`embed` takes its own)
        targets = targets[..., order]
    x = embed(params["embed"], tokens, order, config.dtype)
    x, stats = blocks_and_stats(params["blocks"], x, config=config)
    ce = head_loss(output_head(params, config=config), x, targets, config=config)
    if stats is None:
        return ce, {}
    aux = jnp.mean(stats.aux_loss) / config.num_moe_layers
    out = {"cross_entropy": ce, "aux_loss": aux}
    out |= {"dropped": jnp.sum(stats.dropped), "routed": jnp.sum(stats.routed)}
    return ce + config.aux_weight * aux, out


def loss(params: dict, tokens: jax.Array, targets: jax.Array, *, config: GPTConfig) -> jax.Array:
    """The whole model's mean cross-entropy on one device: the oracle for the pipeline.

    With ``num_experts``, plus ``aux_weight`` times the load-balancing loss.

    Args:
      params: `init`'s parameters.
      tokens: ``[B, S]`` int tokens.
      targets: ``[B, S]`` int targets.
      config: the model's `GPTConfig`.

    Returns:
      The mean loss, an fp32 scalar.
    """
    return loss_and_stats(params, tokens, targets, config=config)[0]
