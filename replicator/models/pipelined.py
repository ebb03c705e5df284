"""The decoder as a pipeline: `pipeline_value_and_grad`, the embedding before the stages, the
blocks as the stages (`stage_fn`) and the head as the pipeline's ``loss_fn`` (`head_loss`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import replicator as rp
from replicator import pipeline
from replicator._src.core.mesh import MODEL_AXIS
from replicator.models.config import GPTConfig
from replicator.models.decoder import embed, embed_scale, head_loss, output_head, stage_fn
from replicator.models.layers.common import reduce_cast, xla_cpu_with
from replicator.models.layers.rotary import sequence_order


def pipeline_value_and_grad(
    config: GPTConfig,
    *,
    num_microbatches: int,
    schedule: Any = "gpipe",
    remat: bool | str | Callable = True,
    scatter_grads: str = "microbatch",
) -> Callable[[dict, dict], tuple[jax.Array, dict]]:
    """``f(params, batch) -> (loss, grads)`` for one data replica, the blocks run as a pipeline.

    ``params`` is `place_pipeline`'s layout, ``{"embed", "stages", "head"}``, and ``batch`` is
    `token_batches`' ``{"tokens", "targets"}``. The embedding runs before the stages, and its
    gradient flows back from the pipeline's input gradient; the head is the pipeline's
    ``loss_fn`` (`head_loss`). Inside ``Replicator.run`` on a mesh with a ``stage`` axis the
    stages run as ``schedule`` says; elsewhere, in order on one device. Either way::

        Equivalent to: jax.value_and_grad(loss)(params with the stages unstacked, tokens, targets)

    ``params`` may also be ZeRO-3's (``opt.shard_params(placed)``): the embedding and the head
    are gathered before the pipeline (their gradients scattered back), and each stage's layers
    one at a time inside its layer scan (`block`). Each block computes in ``config.dtype``, and
    activations travel between stages in it too (but in fp32 on XLA:CPU with both a ``stage``
    and a ``model`` axis, whose compiler aborts on that bf16 program; bfloat16 to fp32 and back
    is exact, so the values are those of `loss` either way).

    Args:
      config: the model's sizes (its ``remat`` is for `blocks`; pipelines use ``remat``).
      num_microbatches: micro-batches per replica's batch (see
        `replicator.pipeline.value_and_grad`).
      schedule: a `replicator.pipeline` schedule such as ``pipeline.OneFOneB()``, or its name.
      remat: what each block keeps for the backward pass, as for
        `replicator.pipeline.value_and_grad`: ``"none"``, ``"full"`` (``True``) or ``"dots"``.
      scatter_grads: under ZeRO-3, ``"step"`` sums the stages' gradients whole over the
        micro-batches and reduce-scatters them once a step (``"microbatch"``: in each
        micro-batch's backward pass), as for `replicator.pipeline.value_and_grad`; the stages'
        parts are cast to ``config.reduce_dtype`` before the pipeline then, so that they are
        gathered and reduce-scattered in it, and summed in fp32.

    Returns:
      The function; its ``grads`` have the structure of ``params``, and are this replica's own
      (reduce them across replicas, e.g. with an optimizer from ``repl.wrap_optimizer``).

    >>> import jax, jax.numpy as jnp
    >>> from replicator import pipeline
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=2)
    >>> params = gpt.init(config, jax.random.key(0))
    >>> batch = next(gpt.token_batches(b"abcdefgh" * 20, batch_size=4, seq_len=8))
    >>> blocks = params.pop("blocks")
    >>> staged = dict(params, stages=pipeline.stack_stages(blocks, num_stages=2))
    >>> grad_fn = gpt.pipeline_value_and_grad(config, num_microbatches=2)
    >>> loss, grads = grad_fn(staged, batch)
    >>> sorted(grads)
    ['embed', 'head', 'stages']
    >>> bool(jnp.allclose(loss, gpt.loss(params | {"blocks": blocks}, **batch, config=config)))
    True
    """
    grad_fn = pipeline.value_and_grad(
        stage_fn(config),
        functools.partial(head_loss, config=config),
        num_microbatches=num_microbatches,
        schedule=schedule,
        remat=remat,
        scatter_grads=scatter_grads,
    )

    if config.num_experts:
        raise ValueError(
            f"gpt.pipeline_value_and_grad: the mixture-of-experts GPT (num_experts="
            f"{config.num_experts}) has no pipeline layout: its load-balancing loss and routing "
            f"statistics do not travel between stages. Train it without a 'stage' axis (e.g. "
            f"mesh {{data: 2, expert: 4}}), or set num_experts=0."
        )

    def _embedded(e: dict, tokens: jax.Array, order, wire) -> jax.Array:
        """The stages' input: `embed`'s, scaled as one device scales it (in ``config.dtype``,
        `embed_scale`), sent in the ``wire`` dtype."""
        scale = embed_scale(config)
        if scale is None:
            return embed(e, tokens, order, wire)
        return embed(e, tokens, order, config.dtype, scale).astype(wire)

    def value_and_grad(params: dict, batch: dict) -> tuple[jax.Array, dict]:
        tokens, targets = batch["tokens"], batch["targets"]
        order = sequence_order(config, tokens.shape[-1])
        if order is not None:  # a mean over tokens: the same in any order (`embed` takes its own)
            targets = targets[..., order]
        wire = _stage_dtype(config)
        x, embed_vjp = jax.vjp(lambda e: _embedded(e, tokens, order, wire), params["embed"])
        stages, cast_vjp = params["stages"], lambda g: (g,)
        if scatter_grads == "step":  # the pipeline gathers the parts: in reduce_dtype
            stages, cast_vjp = jax.vjp(lambda p: reduce_cast(p, config), stages)
        if not config.tie_embeddings:
            head, head_vjp = jax.vjp(rp.gather_params, params["head"])  # ZeRO-3: gathered once
            loss, (g_stages, g_x, g_head) = grad_fn(stages, x, targets, head)
            grads = {"embed": embed_vjp(g_x)[0], "stages": cast_vjp(g_stages)[0],
                     "head": head_vjp(g_head)[0]}  # fmt: skip
            return loss, grads
        tied = lambda h, e: rp.gather_params(output_head({"head": h, "embed": e}, config=config))
        head, head_vjp = jax.vjp(tied, params["head"], params["embed"])
        loss, (g_stages, g_x, g_head) = grad_fn(stages, x, targets, head)
        g_head, g_embed = head_vjp(g_head)  # the token table: used by the embedding and head
        g_embed = jax.tree.map(jnp.add, embed_vjp(g_x)[0], g_embed)
        return loss, {"embed": g_embed, "stages": cast_vjp(g_stages)[0], "head": g_head}

    return value_and_grad


def _stage_dtype(config: GPTConfig) -> Any:
    """The dtype of the activations between stages: the compute dtype, except on XLA:CPU with
    both a ``stage`` and a ``model`` axis, where a bf16 step aborts the compiler (its
    AllReducePromotion pass clones an all-reduce whose reducer is a copy:
    tests/test_gpt_pipeline_dtype.py keeps checking that it still does). There the activations
    travel in fp32, which holds every bf16 value exactly."""
    return jnp.float32 if xla_cpu_with("stage", MODEL_AXIS) else config.dtype
