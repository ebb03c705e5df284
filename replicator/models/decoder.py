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
from replicator._src.core import placement
from replicator._src.core.mesh import MODEL_AXIS
from replicator._src.pipeline import remat
from replicator._src.pipeline.remat import as_remat, never_gathered
from replicator._src.sharded import attention as attention_lib
from replicator._src.sharded import embedding as embedding_lib
from replicator.models.config import GPTConfig
from replicator.models.layers.common import POST_NORMS, is_stored, reduce_cast
from replicator.models.layers.head import head_logits, head_loss, output_head
from replicator.models.layers.mlp import mlp, mlp_params
from replicator.models.layers.moe_mlp import mixture, moe_params
from replicator.models.layers.norms import norm_params
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
    if config.post_norms:
        params |= {name: norm_params(config) for name in POST_NORMS.values()}
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
    embed_params: dict,
    tokens: jax.Array,
    order: np.ndarray | None = None,
    dtype: Any = None,
    scale: float | None = None,
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
      scale: the embeddings are multiplied by it, in ``dtype`` (`embed_scale`); None: not.

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
    x = x if dtype is None else x.astype(dtype)
    x = x if scale is None else x * jnp.asarray(scale, x.dtype)
    return attention_lib.constrain_tokens(x)


def embed_scale(config: GPTConfig) -> float | None:
    """`embed`'s ``scale``: ``sqrt(d_model)`` with ``config.scale_embeddings``, else None."""
    return math.sqrt(config.d_model) if config.scale_embeddings else None


def layer_params_in_dtype(layer_params: dict, config: GPTConfig) -> dict:
    """One layer's parameters, gathered (`_gathered`), in ``config.dtype``; the attention's in
    `weights_heads_first`'s layout when the block attends heads first."""
    p = reduce_cast(rp.to_device(layer_params), config)  # kept on the host: its layer alone
    if heads_first(config):
        p = {**p, "attn": weights_heads_first(p["attn"], config)}
    return jax.tree.map(lambda a: a.astype(config.dtype), rp.gather_params(p))


def block(
    layer_params: dict, x: jax.Array, *, config: GPTConfig, kind: str = "global"
) -> jax.Array:
    """One pre-norm decoder block: causal self-attention, then an MLP, each residual.

    Over a ``context`` axis the block holds each device's chunk of the sequence, and attention
    is `replicator.attention.attention` (``config.attention``).

    Args:
      layer_params: one layer of ``params["blocks"]``; ZeRO-3 parameters are gathered here,
        inside the layer scan, one layer at a time.
      x: ``[B, S, D]`` activations.
      config: the model's `GPTConfig`.
      kind: the layer's attention, ``"global"`` or ``"local"`` (`GPTConfig.layer_kind`).

    Returns:
      ``[B, S, D]`` in ``config.dtype``.
    """
    p = layer_params_in_dtype(layer_params, config)
    x = attend(p, _layer_input(x, config), config, kind)
    return attention_lib.constrain_tokens(mlp(p, x, config))


def _layer_input(x: jax.Array, config: GPTConfig) -> jax.Array:
    """A block's input in the compute dtype, named ``decoder_layer_input`` (`remat`); split
    over ``model`` by its width with ``config.residual_split``."""
    width = MODEL_AXIS if config.residual_split else None
    x = attention_lib.constrain_tokens(x.astype(config.dtype), width)
    return remat.named(x, "decoder_layer_input")


def moe_block(
    layer_params: dict, x: jax.Array, *, config: GPTConfig, kind: str = "global"
) -> tuple[jax.Array, Any]:
    """A block whose MLP is a mixture of experts (`replicator.moe.apply`).

    Each sequence is one routing group.

    Args:
      layer_params: the ``"moe"`` block of one group of ``params["blocks"]``.
      x: ``[B, S, D]`` activations.
      config: the model's `GPTConfig`.
      kind: the layer's attention (`GPTConfig.layer_kind`).

    Returns:
      ``(x, stats)``: ``stats`` a `replicator.moe.Stats` of per-sequence values.
    """
    p = layer_params_in_dtype(layer_params, config)
    x = attend(p, _layer_input(x, config), config, kind)
    x, stats = mixture(p, x, config)
    return attention_lib.constrain_tokens(x), stats


def _group(params: dict, x: jax.Array, config: GPTConfig) -> tuple[jax.Array, Any]:
    """One group of `init`'s MoE layout: its dense blocks, then its mixture-of-experts block."""
    kind = config.attention_pattern[0]  # one kind (`_check_pattern`)
    for i in range(config.moe_every - 1):
        x = block(jax.tree.map(lambda a, i=i: a[i], params["dense"]), x, config=config, kind=kind)
    return moe_block(params["moe"], x, config=config, kind=kind)


def blocks_and_stats(
    stacked_params: dict, x: jax.Array, *, config: GPTConfig
) -> tuple[jax.Array, Any]:
    """Every block in order, and the mixture-of-experts statistics summed over its blocks.

    The blocks run as a ``lax.scan`` over the leading layer (group) axis. With ``config.remat``
    each block keeps what its policy says for the backward pass (``jax.checkpoint``), and
    ZeRO-3 parameters are gathered again there (`rp.regather_policy`) rather than kept. With
    an ``attention_pattern`` of several kinds, the scan is over groups of as many layers, and
    the layers a last group lacks run after it.

    Args:
      stacked_params: ``params["blocks"]`` of `init`, stacked over the layers (or groups).
      x: ``[B, S, D]`` activations.
      config: the model's `GPTConfig`.

    Returns:
      ``(x, stats)``: ``stats`` a `replicator.moe.Stats` summed over the MoE blocks, or None
      for a dense model.
    """
    # ZeRO-3 parts cast to reduce_dtype once, before the scan: the backward scan then stacks
    # their gradients in that dtype too (half the fp32 stack's bytes for bf16), the same values
    # (the cast's transpose converts each reduce-scattered part exactly)
    # (parameters kept in host memory, `rp.to_host`, are cast a layer at a time, in
    # `layer_params_in_dtype`, each layer brought to the device alone)
    if not any(map(placement.in_host_memory, jax.tree.leaves(stacked_params))):
        stacked_params = reduce_cast(stacked_params, config)
    policy = as_remat(config.remat, "GPTConfig")

    def checkpointed(step: Callable) -> Callable:
        if policy.recomputes or _stored_sharded(stacked_params):  # ZeRO-3: gathered backward
            # in a scan XLA cannot merge the recomputation with the forward; unrolled it could
            return jax.checkpoint(
                step, policy=never_gathered(policy), prevent_cse=not config.scan_layers
            )
        return step

    unroll = not config.scan_layers
    if config.num_experts:
        step = checkpointed(lambda carry, p: _summed(carry, _group(p, carry[0], config)))
        b = x.shape[0]
        zeros = moe.Stats(jnp.zeros((b,), jnp.float32), *(jnp.zeros((b,), jnp.int32),) * 2)
        return jax.lax.scan(step, (x, zeros), stacked_params, unroll=unroll)[0]
    layer = {k: checkpointed(_layer_step(k, config)) for k in set(config.attention_pattern)}
    pattern = config.attention_pattern
    if len(pattern) == 1:
        return jax.lax.scan(layer[pattern[0]], x, stacked_params, unroll=unroll)[0], None
    # several kinds: a scan over groups of len(pattern) layers, then the layers left over
    groups, left = divmod(config.num_layers, len(pattern))
    split = lambda a: a[: groups * len(pattern)].reshape(groups, len(pattern), *a.shape[1:])
    if groups:
        group = functools.partial(_in_turn, [layer[k] for k in pattern])
        x = jax.lax.scan(group, x, jax.tree.map(split, stacked_params), unroll=unroll)[0]
    tail = jax.tree.map(lambda a: a[groups * len(pattern) :], stacked_params)
    return _in_turn([layer[k] for k in pattern[:left]], x, tail)[0], None


def _layer_step(kind: str, config: GPTConfig) -> Callable:
    """The scan's step over one layer of the kind ``kind``."""
    return lambda h, p: (block(p, h, config=config, kind=kind), None)


def _in_turn(steps: list[Callable], h: jax.Array, stacked: PyTree) -> tuple[jax.Array, None]:
    """``steps[i]`` on layer ``i`` of ``stacked`` (parameters stacked over ``len(steps)``)."""
    for i, step in enumerate(steps):
        h = step(h, jax.tree.map(lambda a, i=i: a[i], stacked))[0]
    return h, None


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
    if len(set(config.attention_pattern)) > 1:
        raise ValueError(
            f"gpt.stage_fn: attention_pattern={config.attention_pattern} mixes layer kinds, "
            f"which a pipeline's stages do not follow yet; train it without a stage axis."
        )
    kind = config.attention_pattern[0]
    return pipeline.scan_layers(lambda p, x: block(p, x, config=config, kind=kind).astype(x.dtype))


def apply(params: dict, tokens: jax.Array, *, config: GPTConfig) -> jax.Array:
    """The whole model: ``[B, S]`` tokens to fp32 logits ``[B, S, V]``, in the tokens' order.

    Args:
      params: `init`'s parameters.
      tokens: ``[B, S]`` int tokens.
      config: the model's `GPTConfig`.
    """
    order = sequence_order(config, tokens.shape[-1])
    x = embed(params["embed"], tokens, order, config.dtype, embed_scale(config))
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
    x = embed(params["embed"], tokens, order, config.dtype, embed_scale(config))
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
