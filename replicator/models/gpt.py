"""A small GPT-style decoder, written for pipeline parallelism, and byte-level text that ships
with Python.

The parameters are plain pytrees. The transformer blocks are *stacked*: every leaf of
``params["blocks"]`` has a leading layer axis, so `replicator.pipeline.stack_stages` splits them
into stages and `stage_fn` runs one stage as a ``lax.scan`` over its layers. The embedding and
the head (final LayerNorm and output matrix) stay outside the stages: the embedding produces the
pipeline's input and its gradient flows back from ``g_inputs``; the head is ``loss_fn``'s
``head_params``. `loss` is the whole model on one device: the oracle.

For tensor parallelism each dimension of each parameter has a role (`LOGICAL_AXES`), and one
table maps roles to mesh axes (`MEGATRON_RULES`: attention heads and MLP hidden units over
``model``); `place` and `place_pipeline` put the parameters on a mesh by it.

>>> import jax, replicator as rp
>>> from replicator.models import gpt
>>> config = gpt.GPTConfig(vocab_size=256, seq_len=16, d_model=32, num_heads=4, num_layers=4)
>>> params = gpt.init(config, jax.random.key(0))
>>> params["blocks"]["attn"]["qkv"].shape      # stacked over 4 layers
(4, 32, 96)
>>> batch = next(gpt.token_batches(b"hello world, " * 50, batch_size=2, seq_len=16))
>>> round(float(gpt.loss(params, batch["tokens"], batch["targets"], config=config)), 1)
5.5
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator import moe, pipeline
from replicator._src import attention as attention_lib
from replicator._src.errors import positive_int
from replicator._src.mesh import EXPERT_AXIS, MODEL_AXIS
from replicator._src.pipeline.residuals import as_remat, never_gathered

PyTree = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder. ``d_ff`` defaults to ``4 * d_model``; ``dtype`` is the compute
    dtype (parameters stay fp32, and the head's logits and loss are fp32); ``remat`` is what each
    block of `blocks` keeps for the backward pass: ``"none"`` (``False``) all its activations,
    ``"full"`` (``True``) its input only, recomputing the block, ``"dots"`` the outputs of its
    linear layers, recomputing attention's scores and the element-wise rest (the same numbers,
    less memory, more FLOPs). Pipelines take their own ``remat`` (`pipeline_value_and_grad`)."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 4
    d_ff: int | None = None
    dtype: Any = jnp.float32
    remat: bool | str = False
    attention: str = "ring"
    zigzag: bool = True
    num_experts: int = 0
    moe_every: int = 1
    top_k: int = 1
    capacity_factor: float | None = 1.25
    aux_weight: float = 0.01

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_heads", "num_layers", "moe_every"):
            positive_int(getattr(self, name), api="GPTConfig", name=name)
        positive_int(self.d_ff, api="GPTConfig", name="d_ff", none=" or None")
        if self.attention not in attention_lib.IMPLS:
            raise ValueError(
                f"GPTConfig: attention={self.attention!r}; use 'ring' (K/V blocks round the "
                f"context axis) or 'all_to_all' (heads over it, DeepSpeed-Ulysses)."
            )
        if self.num_experts:
            self.routing  # noqa: B018 -- validates num_experts, top_k and capacity_factor
            if self.num_layers % self.moe_every:
                raise ValueError(
                    f"GPTConfig: num_layers={self.num_layers} must divide by moe_every="
                    f"{self.moe_every} (every moe_every-th block is a mixture of experts); use "
                    f"num_layers={self.moe_every * math.ceil(self.num_layers / self.moe_every)}."
                )
        if not isinstance(self.remat, (bool, str)):
            raise ValueError(
                f"GPTConfig: remat must be True, False, 'none', 'full' or 'dots'; got "
                f"{self.remat!r}."
            )
        as_remat(self.remat, "GPTConfig")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must divide by num_heads={self.num_heads}; "
                f"use e.g. d_model={self.num_heads * math.ceil(self.d_model / self.num_heads)}."
            )

    @property
    def hidden(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def routing(self) -> moe.Routing:
        """The mixture-of-experts blocks' routing (``num_experts > 0``)."""
        return moe.Routing(
            num_experts=self.num_experts, top_k=self.top_k, capacity_factor=self.capacity_factor
        )

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers // self.moe_every if self.num_experts else 0


def _layer_norm_params(d: int) -> dict:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _block_params(config: GPTConfig, key, *, experts: bool = False) -> dict:
    d, h = config.d_model, config.hidden
    k = jax.random.split(key, 4)
    normal = lambda key, shape, std=0.02: std * jax.random.normal(key, shape, jnp.float32)
    out_std = 0.02 / math.sqrt(2 * config.num_layers)  # GPT-2: scaled residual projections
    params = {
        "ln1": _layer_norm_params(d),
        "attn": {
            "qkv": normal(k[0], (d, 3 * d)),
            "qkv_bias": jnp.zeros((3 * d,), jnp.float32),
            "out": normal(k[1], (d, d), out_std),
            "out_bias": jnp.zeros((d,), jnp.float32),
        },
        "ln2": _layer_norm_params(d),
    }
    if experts:
        params["moe"] = moe.init(
            k[2], d_model=d, hidden=h, num_experts=config.num_experts, out_std=out_std
        )
        return params
    params["mlp"] = {
        "up": normal(k[2], (d, h)),
        "up_bias": jnp.zeros((h,), jnp.float32),
        "down": normal(k[3], (h, d), out_std),
        "down_bias": jnp.zeros((d,), jnp.float32),
    }
    return params


def init(config: GPTConfig, key: jax.Array) -> dict:
    """Parameters: ``{"embed": {...}, "blocks": <stacked over num_layers>, "head": {...}}``.

    With ``num_experts`` the blocks come in groups of ``moe_every``, stacked over the
    ``num_layers / moe_every`` groups: ``{"moe": <the group's mixture-of-experts block>}`` and,
    when ``moe_every > 1``, ``"dense"``: its ``moe_every - 1`` dense blocks, stacked again."""
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
    return {
        "embed": {
            "tokens": 0.02 * jax.random.normal(k_tok, (config.vocab_size, d), jnp.float32),
            "positions": 0.01 * jax.random.normal(k_pos, (config.seq_len, d), jnp.float32),
        },
        "blocks": blocks,
        "head": {
            "norm": _layer_norm_params(d),
            "w": 0.02 * jax.random.normal(k_head, (d, config.vocab_size), jnp.float32),
        },
    }


def _layer_norm(p: dict, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.mean((x32 - mean) ** 2, -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


def sequence_order(config: GPTConfig, seq_len: int) -> np.ndarray | None:
    """The order the model lays its sequence out in inside a step: ``None`` (natural) unless
    causal ring attention runs over a ``context`` axis of ``C > 1`` devices with ``zigzag``,
    where it is `replicator.attention.zigzag_order` ``(seq_len, C)`` (each device then does the
    same work). `loss`, `apply` and `pipeline_value_and_grad` reorder tokens and targets by it
    (the loss, a mean over tokens, is the same) and `apply` puts the logits back.

    A mixture-of-experts model keeps the natural order: its routing gives priority by position
    in the sequence, so with a capacity the dropped tokens would depend on the order."""
    c = attention_lib.context_size()
    if c == 1 or config.attention != "ring" or not config.zigzag or config.num_experts:
        return None
    return attention_lib.zigzag_order(seq_len, c)


def _layout(config: GPTConfig, seq_len: int) -> str:
    return "contiguous" if sequence_order(config, seq_len) is None else "zigzag"


def embed(embed_params: dict, tokens: jax.Array, order: np.ndarray | None = None) -> jax.Array:
    """Token plus position embeddings: ``[B, S]`` int tokens to ``[B, S, D]``; with ``order``
    (`sequence_order`) the tokens are taken, and their positions given, in that order.

    ZeRO-3 parameters (`rp.ShardedParam`) are gathered here, where they are used; plain arrays
    pass through (so are `block`'s and `head_logits`')."""
    embed_params = rp.gather_params(embed_params)
    s = tokens.shape[-1]
    positions = embed_params["positions"][:s]
    if order is not None:
        tokens, positions = tokens[..., order], positions[order]
    tokens = attention_lib.constrain_tokens(tokens)  # each device looks up its own chunk
    return attention_lib.constrain_tokens(embed_params["tokens"][tokens] + positions)


def _attend(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """``x`` plus causal self-attention of its LayerNorm (``p``: one block, in ``x.dtype``)."""
    b, s, d = x.shape
    nh = config.num_heads
    qkv = _layer_norm(p["ln1"], x) @ p["attn"]["qkv"] + p["attn"]["qkv_bias"]
    # Columns grouped by head, [head, (q, k, v), head_dim] (Megatron's order): a contiguous
    # split of them over devices gives each device whole heads.
    q, k, v = jnp.split(qkv.reshape(b, s, nh, 3 * (d // nh)), 3, axis=-1)  # no transpose
    layout = _layout(config, s)
    attn = attention_lib.attention(q, k, v, causal=True, impl=config.attention, layout=layout)
    return x + attn.reshape(b, s, d) @ p["attn"]["out"] + p["attn"]["out_bias"]


def _cast(layer_params: dict, config: GPTConfig) -> dict:
    return jax.tree.map(lambda a: a.astype(config.dtype), rp.gather_params(layer_params))


def block(layer_params: dict, x: jax.Array, *, config: GPTConfig) -> jax.Array:
    """One pre-LayerNorm decoder block: causal self-attention, then an MLP, each residual.

    ``layer_params`` may be one layer of ZeRO-3 parameters: they are gathered here, inside the
    layer scan, one layer at a time. Over a ``context`` axis the block holds each device's
    chunk of the sequence, and attention is `replicator.attention.attention` (``config.attention``)."""
    p = _cast(layer_params, config)
    x = _attend(p, attention_lib.constrain_tokens(x.astype(config.dtype)), config)
    h = jax.nn.gelu(_layer_norm(p["ln2"], x) @ p["mlp"]["up"] + p["mlp"]["up_bias"])
    return attention_lib.constrain_tokens(x + h @ p["mlp"]["down"] + p["mlp"]["down_bias"])


def moe_block(layer_params: dict, x: jax.Array, *, config: GPTConfig) -> tuple[jax.Array, Any]:
    """A block whose MLP is a mixture of experts (`replicator.moe.apply`, each sequence one
    routing group): ``(x, stats)``, ``stats`` a `replicator.moe.Stats` of per-sequence values."""
    p = _cast(layer_params, config)
    x = _attend(p, attention_lib.constrain_tokens(x.astype(config.dtype)), config)
    y, stats = moe.apply(p["moe"], _layer_norm(p["ln2"], x), routing=config.routing)
    return attention_lib.constrain_tokens(x + y), stats


def _group(params: dict, x: jax.Array, config: GPTConfig) -> tuple[jax.Array, Any]:
    """One group of `init`'s MoE layout: its dense blocks, then its mixture-of-experts block."""
    for i in range(config.moe_every - 1):
        x = block(jax.tree.map(lambda a, i=i: a[i], params["dense"]), x, config=config)
    return moe_block(params["moe"], x, config=config)


def blocks_and_stats(
    stacked_params: dict, x: jax.Array, *, config: GPTConfig
) -> tuple[jax.Array, Any]:
    """Every block in order, as a ``lax.scan`` over the leading layer (group) axis, and the
    mixture-of-experts statistics summed over its blocks (None for a dense model); with
    ``config.remat`` each block keeps what its policy says for the backward pass
    (``jax.checkpoint``), and ZeRO-3 parameters are gathered again there
    (`rp.regather_policy`) rather than kept."""
    if config.num_experts:
        step = lambda carry, p: _summed(carry, _group(p, carry[0], config))
        b = x.shape[0]
        zeros = moe.Stats(jnp.zeros((b,), jnp.float32), *(jnp.zeros((b,), jnp.int32),) * 2)
        carry = (x, zeros)
    else:
        step = lambda h, p: (block(p, h, config=config), None)
        carry = x
    remat = as_remat(config.remat, "GPTConfig")
    if remat.recomputes or _stored_sharded(stacked_params):  # ZeRO-3: gathered again backward
        step = jax.checkpoint(step, policy=never_gathered(remat), prevent_cse=False)
    out = jax.lax.scan(step, carry, stacked_params)[0]
    return out if config.num_experts else (out, None)


def _summed(carry, result):
    (_, total), (x, stats) = carry, result
    return (x, jax.tree.map(jnp.add, total, stats)), None


def blocks(stacked_params: dict, x: jax.Array, *, config: GPTConfig) -> jax.Array:
    """Every block in order (`blocks_and_stats` without the statistics).

    Equivalent to: ``for p in stacked_params: x = block(p, x, config=config)``.
    """
    return blocks_and_stats(stacked_params, x, config=config)[0]


def _stored_sharded(tree: PyTree) -> bool:
    is_node = lambda x: isinstance(x, rp.ShardedParam)
    return any(map(is_node, jax.tree.leaves(tree, is_leaf=is_node)))


def stage_fn(config: GPTConfig) -> Callable[[dict, jax.Array], jax.Array]:
    """``f(stage_params, x) -> x`` for the pipeline: the blocks of one stage (``[Lv, ...]``),
    built with `replicator.pipeline.scan_layers` so the pipeline steps through them one by one."""
    return pipeline.scan_layers(lambda p, x: block(p, x, config=config).astype(x.dtype))


def head_logits(head_params: dict, x: jax.Array) -> jax.Array:
    """Final LayerNorm and output matrix: ``[B, S, D]`` to fp32 logits ``[B, S, V]``."""
    head_params = rp.gather_params(head_params)
    x = _layer_norm(head_params["norm"], x.astype(jnp.float32))
    return x @ head_params["w"]


def head_loss(head_params: dict, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy of the head on ``x``, in fp32: the pipeline's ``loss_fn``."""
    logp = jax.nn.log_softmax(head_logits(head_params, x), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def apply(params: dict, tokens: jax.Array, *, config: GPTConfig) -> jax.Array:
    """The whole model: fp32 logits ``[B, S, V]``."""
    order = sequence_order(config, tokens.shape[-1])
    x = embed(params["embed"], tokens, order).astype(config.dtype)
    logits = head_logits(params["head"], blocks(params["blocks"], x, config=config))
    return logits if order is None else logits[:, np.argsort(order)]


def loss_and_stats(
    params: dict, tokens: jax.Array, targets: jax.Array, *, config: GPTConfig
) -> tuple[jax.Array, dict]:
    """`loss`, and what the mixture-of-experts blocks did: ``{"cross_entropy", "aux_loss",
    "dropped", "routed"}`` (the counts summed over the batch and the MoE blocks; ``aux_loss``
    the mean over sequences and MoE blocks; empty for a dense model). The loss is the
    cross-entropy plus ``aux_weight * aux_loss``."""
    order = sequence_order(config, tokens.shape[-1])
    if order is not None:  # a mean over tokens: the same in any order (`embed` takes its own)
        targets = targets[..., order]
    x = embed(params["embed"], tokens, order).astype(config.dtype)
    x, stats = blocks_and_stats(params["blocks"], x, config=config)
    ce = head_loss(params["head"], x, targets)
    if stats is None:
        return ce, {}
    aux = jnp.mean(stats.aux_loss) / config.num_moe_layers
    out = {"cross_entropy": ce, "aux_loss": aux}
    out |= {"dropped": jnp.sum(stats.dropped), "routed": jnp.sum(stats.routed)}
    return ce + config.aux_weight * aux, out


def loss(params: dict, tokens: jax.Array, targets: jax.Array, *, config: GPTConfig) -> jax.Array:
    """The whole model's mean cross-entropy on one device: the oracle for the pipeline (plus
    ``aux_weight`` times the load-balancing loss with ``num_experts``)."""
    return loss_and_stats(params, tokens, targets, config=config)[0]


def pipeline_value_and_grad(
    config: GPTConfig,
    *,
    num_microbatches: int,
    schedule: Any = "gpipe",
    remat: bool | str | Callable = True,
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
        head_loss,
        num_microbatches=num_microbatches,
        schedule=schedule,
        remat=remat,
    )

    if config.num_experts:
        raise ValueError(
            f"gpt.pipeline_value_and_grad: the mixture-of-experts GPT (num_experts="
            f"{config.num_experts}) has no pipeline layout: its load-balancing loss and routing "
            f"statistics do not travel between stages. Train it without a 'stage' axis (e.g. "
            f"mesh {{data: 2, expert: 4}}), or set num_experts=0."
        )

    def value_and_grad(params: dict, batch: dict) -> tuple[jax.Array, dict]:
        tokens, targets = batch["tokens"], batch["targets"]
        order = sequence_order(config, tokens.shape[-1])
        if order is not None:  # a mean over tokens: the same in any order (`embed` takes its own)
            targets = targets[..., order]
        wire = _stage_dtype(config)
        x, embed_vjp = jax.vjp(lambda e: embed(e, tokens, order).astype(wire), params["embed"])
        head, head_vjp = jax.vjp(rp.gather_params, params["head"])  # ZeRO-3: gathered once
        loss, (g_stages, g_x, g_head) = grad_fn(params["stages"], x, targets, head)
        grads = {"embed": embed_vjp(g_x)[0], "stages": g_stages, "head": head_vjp(g_head)[0]}
        return loss, grads

    return value_and_grad


def _stage_dtype(config: GPTConfig) -> Any:
    """The dtype of the activations between stages: the compute dtype, except on XLA:CPU with
    both a ``stage`` and a ``model`` axis, where a bf16 step aborts the compiler (its
    AllReducePromotion pass clones an all-reduce whose reducer is a copy:
    tests/test_gpt_pipeline_dtype.py keeps checking that it still does). There the activations
    travel in fp32, which holds every bf16 value exactly."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    if (
        jax.default_backend() == "cpu"
        and sizes.get("stage", 1) > 1
        and sizes.get(MODEL_AXIS, 1) > 1
    ):
        return jnp.float32
    return config.dtype


# -- placement: sharding by role -----------------------------------------------------------------

_LN = {"scale": ("embed",), "bias": ("embed",)}
_BLOCK_AXES = {
    "ln1": _LN,
    "attn": {
        "qkv": ("embed", "heads"),  # columns grouped by head (see `block`)
        "qkv_bias": ("heads",),
        "out": ("heads", "embed"),  # rows: the heads' outputs, in the same order
        "out_bias": ("embed",),
    },
    "ln2": _LN,
    "mlp": {
        "up": ("embed", "mlp"),
        "up_bias": ("mlp",),
        "down": ("mlp", "embed"),
        "down_bias": ("embed",),
    },
}
LOGICAL_AXES: dict = {
    "embed": {"tokens": ("vocab", "embed"), "positions": ("seq", "embed")},
    "blocks": jax.tree.map(
        lambda a: ("layers", *a), _BLOCK_AXES, is_leaf=lambda a: isinstance(a, tuple)
    ),
    "head": {"norm": _LN, "w": ("embed", "vocab")},
}
"""The role of each dimension of each leaf of `init`'s parameters: ``"heads"`` (attention heads,
each ``d_model / num_heads`` wide), ``"mlp"`` (the MLP's hidden units), ``"embed"`` (the model
width), ``"vocab"``, ``"seq"`` (positions) and ``"layers"`` (the stacked blocks)."""


def logical_axes(config: GPTConfig | None = None) -> dict:
    """`LOGICAL_AXES` for ``config``'s parameters: the dense model's, or with ``num_experts``
    the grouped layout of `init` (``"layers"`` for the group axis and the dense blocks' own,
    ``"experts"`` for the experts of `replicator.moe.LOGICAL_AXES`)."""
    if config is None or not config.num_experts:
        return LOGICAL_AXES
    is_axes = lambda a: isinstance(a, tuple)
    moe_block = {k: v for k, v in _BLOCK_AXES.items() if k != "mlp"} | {"moe": moe.LOGICAL_AXES}
    group = {"moe": moe_block}
    if config.moe_every > 1:
        group["dense"] = jax.tree.map(lambda a: ("layers", *a), _BLOCK_AXES, is_leaf=is_axes)
    blocks = jax.tree.map(lambda a: ("layers", *a), group, is_leaf=is_axes)
    return {**LOGICAL_AXES, "blocks": blocks}


def zero_stacked(config: GPTConfig) -> dict[str, int]:
    """The ``stacked`` argument of ZeRO-3's ``shard_params`` for `init`'s parameters: the blocks'
    leading layer axes, which a layer scan slices (two with ``moe_every > 1``: groups, then each
    group's dense blocks)."""
    return {"blocks": 2 if config.num_experts and config.moe_every > 1 else 1}


MEGATRON_RULES: Mapping[str, str | None] = types.MappingProxyType(
    {"heads": MODEL_AXIS, "mlp": MODEL_AXIS}
)
"""Role to mesh axis, Megatron-LM's layout: attention heads and MLP hidden units split over
``model``, so the qkv and first MLP matrices are split by columns and the attention output and
second MLP matrices by rows; every other role is whole. ``{**MEGATRON_RULES, "vocab": "model"}``
also splits the embedding table by rows and the output matrix by columns."""

_ROLE_SIZES = {
    "heads": "num_heads",
    "mlp": "hidden",
    "vocab": "vocab_size",
    "embed": "d_model",
    "experts": "num_experts",
}


def partition_specs(
    *, rules: Mapping[str, str | None] = MEGATRON_RULES, config: GPTConfig | None = None
) -> dict:
    """The ``PartitionSpec`` of every leaf of `init`'s parameters: `LOGICAL_AXES` mapped to mesh
    axes by ``rules`` (roles not in ``rules`` are whole). On a mesh without the axes they name,
    ``Replicator.place`` drops them: the same specs place a replicated model on ``{"data": 8}``.

    >>> from replicator.models import gpt
    >>> specs = gpt.partition_specs()
    >>> specs["blocks"]["attn"]["qkv"], specs["blocks"]["mlp"]["down"], specs["head"]["w"]
    (P(None, None, 'model'), P(None, 'model', None), P(None, None))

    Args:
      rules: role to mesh axis; the roles are those of `LOGICAL_AXES` and the axis ``"model"``
        (an axis XLA partitions inside a step, so that ``step_fn`` sees whole parameters);
        ``"experts"`` (the mixture-of-experts blocks' experts) goes to ``"expert"`` unless
        ``rules`` says otherwise.
      config: the model's sizes, for a mixture-of-experts model's layout (`logical_axes`).

    Raises:
      ValueError: for a role `LOGICAL_AXES` does not use, or an axis other than ``"model"``
        (and ``"expert"`` for ``"experts"``).
    """
    rules = {"experts": EXPERT_AXIS, **rules}
    roles = ("heads", "mlp", "vocab", "embed", "seq", "layers", "experts")
    for role, axis in rules.items():
        if role not in roles:
            raise ValueError(
                f"gpt.partition_specs: rules name role {role!r}, which no parameter has; the "
                f"roles are {', '.join(map(repr, roles))}, e.g. rules={{'heads': 'model'}}."
            )
        if axis not in (MODEL_AXIS, None) and (role, axis) != ("experts", EXPERT_AXIS):
            raise ValueError(
                f"gpt.partition_specs: rules map {role!r} to {axis!r}; only {MODEL_AXIS!r} (or "
                f"None, whole) can split parameters that step_fn sees whole. Shard over data with "
                f"ZeRO (repl.wrap_optimizer(zero_stage=...)) and over stage with place_pipeline."
            )
    return jax.tree.map(
        lambda axes: P(*(rules.get(a) for a in axes)),
        logical_axes(config),
        is_leaf=lambda a: isinstance(a, tuple),
    )


def _check_split(mesh, config: GPTConfig | None, rules: Mapping, api: str) -> None:
    """Refuses a split of a role that does not give each device whole heads (units, rows)."""
    split = {r: a for r, a in rules.items() if a in mesh.shape and mesh.shape[a] > 1}
    if not split:
        return
    if config is None:
        raise ValueError(
            f"{api}: the mesh splits {', '.join(map(repr, split))} over {dict(mesh.shape)}; pass "
            f"config= (the model's GPTConfig) so the split can be checked to give each device "
            f"whole heads, e.g. {api}(repl, params, config=config)."
        )
    for role, axis in split.items():
        t, name = mesh.shape[axis], _ROLE_SIZES.get(role)
        if name is None or getattr(config, name) % t == 0:
            continue
        n = getattr(config, name)
        field = "d_ff" if name == "hidden" else name
        raise ValueError(
            f"{api}: {field}={n} does not split over the {t} devices of {axis!r} (rules map "
            f"{role!r} to {axis!r}); use {field} a multiple of {t} (e.g. {t * math.ceil(n / t)}), "
            f"or a smaller {axis!r} axis."
        )


def place(
    repl: rp.Replicator,
    params: dict,
    *,
    config: GPTConfig | None = None,
    rules: Mapping[str, str | None] = MEGATRON_RULES,
) -> dict:
    """`init`'s parameters placed on ``repl``'s mesh for `loss`, split by `partition_specs`.

    On ``{"data": D, "model": T}`` each device holds ``num_heads / T`` heads and ``hidden / T``
    MLP units of every block; ``step_fn`` still sees whole parameters (XLA partitions the
    ``model`` axis and adds its all-reduces: two per block forward, two backward). On a mesh
    without ``model`` every leaf is replicated, as ``repl.replicate(params)``.

    >>> import jax, replicator as rp
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=2)
    >>> repl = rp.Replicator(mesh_shape={"data": 2, "model": 2}, devices=jax.devices()[:4])
    >>> placed = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
    >>> qkv = placed["blocks"]["attn"]["qkv"]      # [layers, d_model, 3 d_model]
    >>> qkv.shape, qkv.addressable_shards[0].data.shape    # one head's q, k, v columns each
    ((2, 16, 48), (2, 16, 24))

    Args:
      repl: the Replicator whose mesh holds the parameters.
      params: `init`'s ``{"embed", "blocks", "head"}``.
      config: the model's sizes; needed when the mesh splits a role (to check whole heads).
      rules: role to mesh axis (`partition_specs`).

    Returns:
      ``params``, placed.

    Raises:
      ValueError: if a role split over ``model`` (``num_heads``, the hidden units) does not
        divide by its size, or ``config`` is missing for that check.
    """
    specs = partition_specs(rules=rules, config=config)
    _check_split(repl.mesh, config, {"experts": EXPERT_AXIS, **rules}, "gpt.place")
    return repl.place(params, specs)


def place_pipeline(
    repl: rp.Replicator,
    params: dict,
    *,
    num_stages: int,
    repeats: int = 1,
    config: GPTConfig | None = None,
    rules: Mapping[str, str | None] = MEGATRON_RULES,
) -> dict:
    """`init`'s parameters placed on ``repl``'s mesh for `pipeline_value_and_grad`.

    The blocks are stacked into ``num_stages`` stages (``repeats`` virtual stages per device, for
    the circular and interleaved schedules) and sharded over the ``stage`` axis; inside each stage, and in the
    embedding and head, every leaf is split as `partition_specs` says (heads and MLP units over
    ``model`` when the mesh has it; else replicated).

    Args:
      repl: the Replicator whose mesh holds the parameters.
      params: `init`'s ``{"embed", "blocks", "head"}``.
      num_stages: the size of the mesh's ``stage`` axis.
      repeats: virtual stages per device.
      config: the model's sizes; needed when the mesh splits a role (to check whole heads).
      rules: role to mesh axis (`partition_specs`).

    Returns:
      ``{"embed", "stages", "head"}``, placed.

    Raises:
      ValueError: as `place` does.

    >>> import jax, replicator as rp
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=4)
    >>> repl = rp.Replicator(lowering="local")
    >>> placed = gpt.place_pipeline(repl, gpt.init(config, jax.random.key(0)), num_stages=2)
    >>> placed["stages"]["attn"]["qkv"].shape       # [stages, layers per stage, ...]
    (2, 2, 16, 48)
    """
    specs = partition_specs(rules=rules, config=config)
    _check_split(repl.mesh, config, rules, "gpt.place_pipeline")
    lead = tuple(pipeline.stage_spec(repeats))  # the stage axes, then the layers' own specs
    staged = pipeline_params(params, num_stages=num_stages, repeats=repeats)
    stage_specs = jax.tree.map(
        lambda spec: P(*lead, *spec), specs.pop("blocks"), is_leaf=lambda x: isinstance(x, P)
    )
    return {
        "embed": repl.place(staged["embed"], specs["embed"]),
        "stages": repl.place(staged["stages"], stage_specs),
        "head": repl.place(staged["head"], specs["head"]),
    }


def pipeline_params(params: dict, *, num_stages: int, repeats: int = 1) -> dict:
    """`init`'s parameters in `pipeline_value_and_grad`'s layout, unplaced: the blocks stacked
    into stages (`replicator.pipeline.stack_stages`), the embedding and head as they are.

    >>> import jax
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=4)
    >>> shapes = jax.eval_shape(
    ...     lambda: gpt.pipeline_params(gpt.init(config, jax.random.key(0)), num_stages=2))
    >>> sorted(shapes), shapes["stages"]["mlp"]["up"].shape
    (['embed', 'head', 'stages'], (2, 2, 16, 64))
    """
    stacked = pipeline.stack_stages(params["blocks"], num_stages=num_stages, repeats=repeats)
    return {"embed": params["embed"], "stages": stacked, "head": params["head"]}


def num_params(params: PyTree) -> int:
    return int(sum(np.prod(np.shape(a)) for a in jax.tree.leaves(params)))


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token, ``6 N + 6 L S D`` (Kaplan et al.): N non-embedding parameters
    (``L (4 D^2 + 2 D F)`` plus the ``D V`` head), and attention over ``S`` positions."""
    d, f, n_layers = config.d_model, config.hidden, config.num_layers
    n = n_layers * (4 * d * d + 2 * d * f) + d * config.vocab_size
    return float(6 * n + 6 * n_layers * config.seq_len * d)


# -- text that ships with Python ----------------------------------------------------------------


def stdlib_text(max_bytes: int = 2_000_000) -> bytes:
    """The sources of Python's standard library, concatenated in sorted order: no download.

    Skips ``site-packages`` and test directories; stops at ``max_bytes``. Deterministic for a
    given Python installation.
    """
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "test", "tests", "idle_test")
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


def token_batches(
    data: bytes, *, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless random windows of ``data`` as byte tokens: ``{"tokens", "targets"}`` int32
    ``[batch_size, seq_len]``, targets shifted by one. Deterministic for a seed."""
    if len(data) < seq_len + 1:
        raise ValueError(
            f"token_batches: {len(data)} bytes are fewer than seq_len + 1 = {seq_len + 1}."
        )
    array = np.frombuffer(data, dtype=np.uint8)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(array) - seq_len, size=batch_size)
        window = np.stack([array[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        yield {"tokens": window[:, :-1], "targets": window[:, 1:]}
