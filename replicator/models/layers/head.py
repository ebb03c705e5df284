"""The decoder's head: the output matrix (`output_head`, the token table's transpose when
tied), its logits (`head_logits`, soft-capped with ``GPTConfig.final_softcap``) and the mean
cross-entropy (`head_loss`, over ``loss_chunks`` chunks), in fp32."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import replicator as rp
from replicator._src.core import sharded_params
from replicator._src.planner.enumeration import divisors
from replicator.models.config import DEFAULT, GPTConfig
from replicator.models.layers import chunked_loss
from replicator.models.layers.common import reduce_cast
from replicator.models.layers.norms import norm


def _gathered(params: dict, config: GPTConfig) -> dict:
    """`rp.gather_params` of ``params``, the stored parts cast to ``config.reduce_dtype`` first
    (so their gradients are reduce-scattered in it) when it is set."""
    return rp.gather_params(reduce_cast(rp.to_device(params), config))


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
    >>> from replicator.models import gpt
    >>> head = jax.eval_shape(lambda: output_head(gpt.init(config, jax.random.key(0)), config=config))
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
    logits = x @ head_params["w"]
    cap = config.final_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


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
    >>> from replicator.models import gpt
    >>> head = output_head(gpt.init(config, jax.random.key(0)), config=config)
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
