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

The same machinery runs the Llama family (`replicator.models.llama`): `GPTConfig`'s ``norm``,
``position``, ``mlp``, ``num_kv_heads``, ``bias`` and ``tie_embeddings`` choose RMSNorm, rotary
positions, a SwiGLU MLP, grouped-query attention (separate ``q``, ``k``, ``v`` matrices), no
biases and a head tied to the token table; the defaults are GPT-2's.

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
import functools
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
from replicator._src.core import binding as binding_lib
from replicator._src.core import sharded_params
from replicator._src.core.errors import positive_int
from replicator._src.core.mesh import EXPERT_AXIS, MODEL_AXIS
from replicator._src.layers import attention as attention_lib
from replicator._src.layers import embedding as embedding_lib
from replicator._src.layers import splash
from replicator._src.pipeline.residuals import as_remat, never_gathered

PyTree = Any
NORMS = ("layer", "rms")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rescaled rotary frequencies (``rope_type="llama3"``, transformers'
    ``rope_scaling``): wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are stretched by ``factor``, those shorter than ``... / high_freq_factor``
    kept, and those between interpolated smoothly. Frozen, so that `GPTConfig` stays hashable.

    >>> RopeScaling(factor=8.0).rope_type
    'llama3'
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(
                f"RopeScaling: rope_type={self.rope_type!r}; only 'llama3' is implemented (use "
                f"rope_scaling=None for plain rotary positions)."
            )
        if not self.high_freq_factor > self.low_freq_factor > 0 or self.factor <= 0:
            raise ValueError(
                f"RopeScaling: needs factor > 0 and high_freq_factor > low_freq_factor > 0; got "
                f"factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}."
            )


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder. ``d_ff`` defaults to ``4 * d_model``; ``dtype`` is the compute
    dtype (parameters stay fp32, and the head's logits and loss are fp32); ``remat`` is what each
    block of `blocks` keeps for the backward pass: ``"none"`` (``False``) all its activations,
    ``"full"`` (``True``) its input only, recomputing the block, ``"dots"`` the outputs of its
    linear layers, recomputing attention's scores and the element-wise rest (the same numbers,
    less memory, more FLOPs). Pipelines take their own ``remat`` (`pipeline_value_and_grad`).
    ``attention`` is how attention runs over a ``context`` axis (`replicator.attention`:
    ``"ring"``, ``"all_to_all"``), or ``"dot_product"``: ``jax.nn.dot_product_attention``
    (cuDNN's fused kernel where XLA picks it, key/value heads grouped without copies), for
    meshes without a ``context`` axis, or ``"splash"``: the TPU's splash-attention kernel
    (Pallas; the scores never reach HBM; interpreted off a TPU), for meshes without a
    ``context`` axis (`replicator._src.layers.splash`). On a TPU, ``"ring"``, ``"all_to_all"``
    and one device's attention run the same kernel (`replicator._src.layers.kernels`).

    The architecture (defaults: GPT-2's; `replicator.models.llama.config` sets Llama's):

    * ``norm``: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, ``x * rsqrt(mean(x^2) + eps) *
      scale``, no bias), both computed in fp32, with ``norm_eps``;
    * ``position``: ``"learned"`` (a ``[seq_len, d_model]`` table added to the token embeddings)
      or ``"rope"`` (rotary positions applied to each head's queries and keys, as transformers'
      Llama does: the two halves of a head rotated, frequencies ``rope_theta ** (-2i / head_dim)``,
      rescaled by ``rope_scaling``, a `RopeScaling`, or not with None);
    * ``mlp``: ``"gelu"`` (``down(gelu(up(x)))``) or ``"swiglu"`` (``down(silu(gate(x)) * up(x))``),
      for the experts of a mixture too (Mixtral's experts are SwiGLU MLPs without biases);
    * ``num_kv_heads``: None keeps GPT-2's fused ``qkv`` matrix (as many key/value heads as
      query heads); a number (a divisor of ``num_heads``; equal to it for multi-head attention)
      gives separate ``q``, ``k`` and ``v`` matrices and grouped-query attention, query head
      ``h`` attending with key/value head ``h // (num_heads / num_kv_heads)``;
    * ``bias``: biases in the linear layers and LayerNorms (RMSNorm has none);
    * ``tie_embeddings``: the output matrix is the token table, transposed (the head has no
      ``"w"``; `output_head` gives it).

    ``reduce_dtype`` is the dtype ZeRO-3 gathers the stored parameters in and reduce-scatters
    their gradients in (FSDP2's ``reduce_dtype``): None (the default) gathers them and sums the
    gradients over the replicas in the parameters' own dtype (fp32), as one device sums them;
    the compute ``dtype`` (``"bfloat16"``) casts each replica's part before the gather, so that
    the gradients of the bf16 weights are summed in bf16, as MaxText's FSDP sums them: half the
    gradient bytes on the wire and in HBM, and each gradient rounded to bf16 once more. It
    changes nothing without ZeRO-3.

    ``scan_layers`` runs the blocks as one ``lax.scan`` (compiled once, whatever the depth);
    False unrolls it, one copy of the block per layer in the program (MaxText's
    ``scan_layers=false``: longer to compile, the same numbers, and a program whose cost XLA's
    ``cost_analysis`` reads whole, where it counts a loop's body once).

    >>> llama_like = GPTConfig(d_model=32, num_heads=4, num_kv_heads=2, norm="rms",
    ...                        position="rope", mlp="swiglu", bias=False)
    >>> llama_like.head_dim, llama_like.kv_heads
    (8, 2)
    """

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
    norm: str = "layer"
    norm_eps: float = 1e-5
    position: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    mlp: str = "gelu"
    num_kv_heads: int | None = None
    bias: bool = True
    tie_embeddings: bool = False
    scan_layers: bool = True
    reduce_dtype: Any = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_heads", "num_layers", "moe_every"):
            positive_int(getattr(self, name), api="GPTConfig", name=name)
        positive_int(self.d_ff, api="GPTConfig", name="d_ff", none=" or None")
        if self.attention not in (*attention_lib.IMPLS, "dot_product", "splash"):
            raise ValueError(
                f"GPTConfig: attention={self.attention!r}; use 'ring' (K/V blocks round the "
                f"context axis), 'all_to_all' (heads over it, DeepSpeed-Ulysses), "
                f"'dot_product' (jax.nn.dot_product_attention, without a context axis) or "
                f"'splash' (the TPU's splash-attention kernel, whole sequences)."
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
        _check_architecture(self)
        if self.reduce_dtype is not None and not _is_reduce_dtype(self.reduce_dtype, self.dtype):
            raise ValueError(
                f"GPTConfig: reduce_dtype={self.reduce_dtype!r} with dtype="
                f"{jnp.dtype(self.dtype).name}; use None (the parameters' own dtype) or the "
                f"compute dtype: gathering the weights in a narrower dtype than the one they "
                f"are used in would round them."
            )

    @property
    def hidden(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` when it is None."""
        return self.num_kv_heads or self.num_heads

    @property
    def routing(self) -> moe.Routing:
        """The mixture-of-experts blocks' routing (``num_experts > 0``)."""
        return moe.Routing(
            num_experts=self.num_experts, top_k=self.top_k, capacity_factor=self.capacity_factor
        )

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers // self.moe_every if self.num_experts else 0


def _is_reduce_dtype(x: Any, compute: Any) -> bool:
    try:
        return jnp.dtype(x) in (jnp.dtype(compute), jnp.dtype(jnp.float32))
    except TypeError:
        return False


def _check_architecture(config: GPTConfig) -> None:
    """`GPTConfig`'s checks of the architecture's options (norm, positions, MLP, heads)."""
    for name, allowed in (("norm", NORMS), ("position", POSITIONS), ("mlp", MLPS)):
        if getattr(config, name) not in allowed:
            raise ValueError(
                f"GPTConfig: {name}={getattr(config, name)!r}; use one of "
                f"{', '.join(map(repr, allowed))}."
            )
    if config.num_kv_heads is not None:
        positive_int(config.num_kv_heads, api="GPTConfig", name="num_kv_heads", none=" or None")
        if config.num_heads % config.num_kv_heads:
            raise ValueError(
                f"GPTConfig: num_heads={config.num_heads} must divide by num_kv_heads="
                f"{config.num_kv_heads} (each key/value head serves a group of query heads); "
                f"use num_kv_heads a divisor of {config.num_heads}."
            )
    if config.rope_scaling is not None and not isinstance(config.rope_scaling, RopeScaling):
        raise ValueError(
            f"GPTConfig: rope_scaling={config.rope_scaling!r}; pass a gpt.RopeScaling (hashable, "
            f"unlike a dict), e.g. rope_scaling=gpt.RopeScaling(factor=8.0, low_freq_factor=1.0, "
            f"high_freq_factor=4.0, original_max_position_embeddings=8192), or None."
        )
    if config.position == "rope" and config.head_dim % 2:
        raise ValueError(
            f"GPTConfig: rotary positions rotate the two halves of each head, so head_dim = "
            f"d_model / num_heads = {config.head_dim} must be even."
        )
    if config.position != "rope" and config.rope_scaling is not None:
        raise ValueError("GPTConfig: rope_scaling applies to position='rope' only.")


_DEFAULT = GPTConfig()


def _norm_has_bias(config: GPTConfig) -> bool:
    return config.norm == "layer" and config.bias


def _norm_params(config: GPTConfig) -> dict:
    d = config.d_model
    if not _norm_has_bias(config):
        return {"scale": jnp.ones((d,), jnp.float32)}
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _normal(key, shape, std=0.02):
    return std * jax.random.normal(key, shape, jnp.float32)


def _linears(config: GPTConfig, weights: dict) -> dict:
    """``{name: weight}`` and, with ``config.bias``, ``{name}_bias`` zeros after each."""
    out = {}
    for name, w in weights.items():
        out[name] = w
        if config.bias:
            out[f"{name}_bias"] = jnp.zeros(w.shape[-1:], jnp.float32)
    return out


def _attn_params(config: GPTConfig, key, out_key, out_std: float) -> dict:
    d, hd = config.d_model, config.head_dim
    if config.num_kv_heads is None:  # GPT-2's fused [q | k | v] columns, grouped by head
        weights = {"qkv": _normal(key, (d, 3 * d))}
    else:
        kq, kk, kv = jax.random.split(key, 3)
        kv_width = config.kv_heads * hd
        weights = {
            "q": _normal(kq, (d, config.num_heads * hd)),
            "k": _normal(kk, (d, kv_width)),
            "v": _normal(kv, (d, kv_width)),
        }
    return _linears(config, weights | {"out": _normal(out_key, (d, d), out_std)})


def _mlp_params(config: GPTConfig, key, out_key, out_std: float) -> dict:
    d, h = config.d_model, config.hidden
    if config.mlp == "swiglu":
        k_gate, k_up = jax.random.split(key)
        weights = {"gate": _normal(k_gate, (d, h)), "up": _normal(k_up, (d, h))}
    else:
        weights = {"up": _normal(key, (d, h))}
    return _linears(config, weights | {"down": _normal(out_key, (h, d), out_std)})


def _experts(config: GPTConfig) -> dict:
    """`moe.init`'s options for ``config``'s experts: SwiGLU experts with ``mlp="swiglu"``
    (Mixtral's), biases with ``bias``."""
    return dict(num_experts=config.num_experts, gated=config.mlp == "swiglu", bias=config.bias)


def _block_params(config: GPTConfig, key, *, experts: bool = False) -> dict:
    d, h = config.d_model, config.hidden
    k = jax.random.split(key, 4)
    out_std = 0.02 / math.sqrt(2 * config.num_layers)  # GPT-2: scaled residual projections
    params = {
        "ln1": _norm_params(config),
        "attn": _attn_params(config, k[0], k[1], out_std),
        "ln2": _norm_params(config),
    }
    if experts:
        params["moe"] = moe.init(k[2], d_model=d, hidden=h, out_std=out_std, **_experts(config))
        return params
    params["mlp"] = _mlp_params(config, k[2], k[3], out_std)
    return params


def init(config: GPTConfig, key: jax.Array) -> dict:
    """Parameters: ``{"embed": {...}, "blocks": <stacked over num_layers>, "head": {...}}``.

    The leaves of one block (`LOGICAL_AXES`, `logical_axes`): ``ln1`` and ``ln2`` (``scale``,
    and ``bias`` for a LayerNorm with biases), ``attn`` (``qkv`` ``[D, 3 D]``, or with
    ``num_kv_heads`` ``q`` ``[D, H hd]``, ``k`` and ``v`` ``[D, KV hd]``, their columns
    head-major; then ``out`` ``[H hd, D]``) and ``mlp`` (``gate`` for SwiGLU, ``up`` ``[D, F]``,
    ``down`` ``[F, D]``), each linear layer followed by its ``*_bias`` when ``config.bias``.
    ``embed`` holds ``tokens`` ``[V, D]`` (and ``positions`` ``[seq_len, D]`` with learned
    positions), ``head`` its ``norm`` and ``w`` ``[D, V]`` (none when ``tie_embeddings``).

    >>> import jax
    >>> config = GPTConfig(d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=48,
    ...                    norm="rms", position="rope", mlp="swiglu", bias=False,
    ...                    tie_embeddings=True)
    >>> params = jax.eval_shape(lambda: init(config, jax.random.key(0)))
    >>> jax.tree.map(lambda a: a.shape, params["blocks"]["attn"])
    {'k': (2, 32, 16), 'out': (2, 32, 32), 'q': (2, 32, 32), 'v': (2, 32, 16)}
    >>> sorted(params["embed"]), sorted(params["head"]), sorted(params["blocks"]["mlp"])
    (['tokens'], ['norm'], ['down', 'gate', 'up'])

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
    embed = {"tokens": 0.02 * jax.random.normal(k_tok, (config.vocab_size, d), jnp.float32)}
    if config.position == "learned":
        embed["positions"] = 0.01 * jax.random.normal(k_pos, (config.seq_len, d), jnp.float32)
    head = {"norm": _norm_params(config)}
    if not config.tie_embeddings:
        head["w"] = 0.02 * jax.random.normal(k_head, (d, config.vocab_size), jnp.float32)
    return {"embed": embed, "blocks": blocks, "head": head}


def _norm(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """LayerNorm or RMSNorm (``config.norm``) of the last axis, in fp32, back in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    if config.norm == "rms":
        ms = jnp.mean(x32 * x32, -1, keepdims=True)
        return (x32 * jax.lax.rsqrt(ms + config.norm_eps) * p["scale"]).astype(x.dtype)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.mean((x32 - mean) ** 2, -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + config.norm_eps) * p["scale"]
    if "bias" in p:
        y = y + p["bias"]
    return y.astype(x.dtype)


def _linear(p: dict, name: str, x: jax.Array) -> jax.Array:
    """``x @ p[name]``, plus ``p[name + "_bias"]`` when the layer has one."""
    y = x @ p[name]
    return y + p[f"{name}_bias"] if f"{name}_bias" in p else y


def _residual(x: jax.Array, p: dict, name: str, h: jax.Array) -> jax.Array:
    """``x + h @ p[name]`` (plus its bias): a residual branch's output projection."""
    y = x + h @ p[name]
    return y + p[f"{name}_bias"] if f"{name}_bias" in p else y


def rope_frequencies(config: GPTConfig) -> np.ndarray:
    """The rotary inverse frequencies of one head, ``[head_dim / 2]`` fp32:
    ``rope_theta ** (-2 i / head_dim)``, rescaled by ``config.rope_scaling`` (Llama 3's
    formula, as transformers computes it).

    >>> rope_frequencies(GPTConfig(d_model=8, num_heads=1, position="rope")).tolist()
    [1.0, 0.10000000149011612, 0.009999999776482582, 0.0010000000474974513]
    """
    hd = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    scaling = config.rope_scaling
    if scaling is not None:
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


def _positions(config: GPTConfig, seq_len: int) -> jax.Array:
    """Each place's position in the sequence as the model lays it out (`sequence_order`)."""
    order = sequence_order(config, seq_len)
    return jnp.arange(seq_len) if order is None else jnp.asarray(order)


def _rope(
    q: jax.Array, k: jax.Array, positions: jax.Array, config: GPTConfig, heads_first: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Rotary positions on ``[B, S, heads, head_dim]`` queries and keys (``[B, heads, S,
    head_dim]`` with ``heads_first``), as transformers' Llama applies them: ``x * cos +
    rotate_half(x) * sin``, where ``rotate_half`` of a head's halves ``[x1, x2]`` is ``[-x2,
    x1]``, and ``cos`` and ``sin`` are of ``position * frequency`` (`rope_frequencies`, each
    twice), computed in fp32 and rounded to the activations' dtype, in which the rotation is
    computed (transformers' order of operations, so bf16 activations rotate in bf16). One table
    rotates both (under remat's ``prevent_cse`` two would be computed, and fused apart)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_frequencies(config))
    angles = jnp.concatenate([freqs, freqs], -1)  # [S, head_dim]
    angles = angles if heads_first else angles[:, None]  # [S, 1, head_dim]: over the heads
    cos, sin = jnp.cos(angles).astype(q.dtype), jnp.sin(angles).astype(q.dtype)

    def rotate(x: jax.Array) -> jax.Array:
        x1, x2 = jnp.split(x, 2, axis=-1)
        return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin

    return rotate(q), rotate(k)


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


def embed(
    embed_params: dict, tokens: jax.Array, order: np.ndarray | None = None, dtype: Any = None
) -> jax.Array:
    """Token plus position embeddings: ``[B, S]`` int tokens to ``[B, S, D]`` (as ``dtype``,
    default the table's); with ``order`` (`sequence_order`) the tokens are taken, and their
    positions given, in that order. With rotary positions (no ``"positions"`` table) the tokens'
    embeddings only: the blocks rotate queries and keys by the positions of that same order.

    ZeRO-3 parameters (`rp.ShardedParam`) are gathered here, where they are used; plain arrays
    pass through (so are `block`'s and `head_logits`'). A token table ZeRO splits by rows (its
    vocabulary) is not gathered: each replica looks up the tokens in its own rows
    (`sharded_params.take_rows`); each device scatters its own tokens' cotangents where that
    moves fewer bytes (`replicator._src.layers.embedding.lookup`)."""
    s = tokens.shape[-1]
    positions = rp.gather_params(embed_params.get("positions"))
    positions = None if positions is None else positions[:s]
    if order is not None:
        tokens = tokens[..., order]
        positions = None if positions is None else positions[order]
    x = embedding_lib.lookup(
        embed_params["tokens"], tokens, None if positions is not None else dtype
    )
    x = x if positions is None else x + positions
    return attention_lib.constrain_tokens(x if dtype is None else x.astype(dtype))


def _qkv(p: dict, x: jax.Array, config: GPTConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``[B, S, H, hd]``, keys and values ``[B, S, KV, hd]`` of the normalised ``x``."""
    b, s, _ = x.shape
    nh, hd = config.num_heads, config.head_dim
    if config.num_kv_heads is None:
        qkv = _linear(p, "qkv", x)
        # Columns grouped by head, [head, (q, k, v), head_dim] (Megatron's order): a contiguous
        # split of them over devices gives each device whole heads.
        return jnp.split(qkv.reshape(b, s, nh, 3 * hd), 3, axis=-1)  # no transpose
    heads = lambda name, n: _linear(p, name, x).reshape(b, s, n, hd)  # head-major columns
    return heads("q", nh), heads("k", config.kv_heads), heads("v", config.kv_heads)


def _attend(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """``x`` plus causal self-attention of its norm (``p``: one block, in ``x.dtype``)."""
    if _heads_first(config):
        return _attend_heads_first(p, x, config)
    b, s, d = x.shape
    q, k, v = _qkv(p["attn"], _norm(p["ln1"], x, config), config)
    if config.position == "rope":  # by position in the sequence's layout (zigzag or not)
        positions = _positions(config, s)
        q, k = _rope(q, k, positions, config)
    if config.attention == "dot_product":
        attn = _dot_product_attention(q, k, v)
    elif config.attention == "splash":
        attn = splash.splash_attention(q, k, v)
    else:  # grouped-query attention: K/V travel with their own heads (replicator.attention)
        layout = _layout(config, s)
        attn = attention_lib.attention(q, k, v, causal=True, impl=config.attention, layout=layout)
    return _residual(x, p["attn"], "out", attn.reshape(b, s, d))


def _heads_first(config: GPTConfig) -> bool:
    """Whether the blocks attend with their heads first (`_attend_heads_first`): the splash
    kernel's layout, for separate query, key and value weights."""
    return config.attention == "splash" and config.num_kv_heads is not None


def _attend_heads_first(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """`_attend` in the splash kernel's layout: queries, keys and values projected straight to
    ``[B, heads, S, head_dim]``, and the output projected back from it, by weights
    `_weights_heads_first` laid out ``[heads, head_dim, D]``. No activation changes layout on
    its way to the kernel and back (each would be a copy of it, forward and backward)."""
    xn, a = _norm(p["ln1"], x, config), p["attn"]

    def project(name: str) -> jax.Array:
        y = jnp.einsum("bsd,hkd->bhsk", xn, a[name])
        bias = a.get(f"{name}_bias")
        return y if bias is None else y + bias.reshape(-1, 1, config.head_dim)

    q, k, v = project("q"), project("k"), project("v")
    if config.position == "rope":
        positions = _positions(config, x.shape[1])
        q, k = _rope(q, k, positions, config, heads_first=True)
    y = x + jnp.einsum("bhsk,hkd->bsd", splash.splash_attention_heads_first(q, k, v), a["out"])
    return y + a["out_bias"] if "out_bias" in a else y


def _weights_heads_first(attn: dict, config: GPTConfig) -> dict:
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
    if not _is_stored(a):
        return f(a)
    if a.dim is None:
        return rp.ShardedParam(f(a.value), None, a.auto)
    new_dim = dims.get(a.dim)
    if a.auto or new_dim is None or (new_dim == -3 and a.value.shape[a.dim] % head_dim):
        return f(rp.gather_params(a))
    return rp.ShardedParam(f(a.value), new_dim, a.auto)


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


def _gathered(params: dict, config: GPTConfig) -> dict:
    """`rp.gather_params` of ``params``, the stored parts cast to ``config.reduce_dtype`` first
    (so their gradients are reduce-scattered in it) when it is set."""
    return rp.gather_params(_reduce_cast(params, config))


def _reduce_cast(params: PyTree, config: GPTConfig) -> PyTree:
    """``params`` with their ZeRO-3 parts (`rp.ShardedParam`) cast to ``config.reduce_dtype``.

    Raises:
      ValueError: for bf16 parts in a program for XLA:CPU with a ``model`` axis, whose compiler
        aborts on it (its AllReducePromotion pass clones a bf16 all-reduce whose reducer is a
        copy, for the parts kept whole over ``model``, such as the norms'). The TPU compiles it.
    """
    if config.reduce_dtype is None:
        return params
    dtype = jnp.dtype(config.reduce_dtype)
    stored = any(_is_stored(a) for a in jax.tree.leaves(params, is_leaf=_is_stored))
    if stored and dtype != jnp.float32 and _xla_cpu_with(MODEL_AXIS):
        raise ValueError(
            f"GPTConfig(reduce_dtype={config.reduce_dtype!r}) under ZeRO-3 with a "
            f"{MODEL_AXIS!r} axis aborts XLA:CPU's compiler; on the CPU use reduce_dtype=None "
            f"(model.reduce_dtype: null: the gradients summed in fp32, as on one device) or a "
            f"mesh without {MODEL_AXIS!r}. A TPU compiles it: `replicator explain CONFIG "
            f"--target TYPE` reads that program from here."
        )
    cast = lambda a: rp.ShardedParam(a.value.astype(dtype), a.dim, a.auto) if _is_stored(a) else a
    return jax.tree.map(cast, params, is_leaf=_is_stored)


def _is_stored(x: Any) -> bool:
    return isinstance(x, rp.ShardedParam)


def _cast(layer_params: dict, config: GPTConfig) -> dict:
    """One layer's parameters, gathered (`_gathered`), in ``config.dtype``; the attention's in
    `_weights_heads_first`'s layout when the block attends heads first."""
    p = _reduce_cast(layer_params, config)
    if _heads_first(config):
        p = {**p, "attn": _weights_heads_first(p["attn"], config)}
    return jax.tree.map(lambda a: a.astype(config.dtype), rp.gather_params(p))


def block(layer_params: dict, x: jax.Array, *, config: GPTConfig) -> jax.Array:
    """One pre-norm decoder block: causal self-attention, then an MLP, each residual.

    ``layer_params`` may be one layer of ZeRO-3 parameters: they are gathered here, inside the
    layer scan, one layer at a time. Over a ``context`` axis the block holds each device's
    chunk of the sequence, and attention is `replicator.attention.attention` (``config.attention``)."""
    p = _cast(layer_params, config)
    x = _attend(p, attention_lib.constrain_tokens(x.astype(config.dtype)), config)
    y, mlp = _norm(p["ln2"], x, config), p["mlp"]
    if config.mlp == "swiglu":
        h = jax.nn.silu(_linear(mlp, "gate", y)) * _linear(mlp, "up", y)
    else:
        h = jax.nn.gelu(_linear(mlp, "up", y))
    return attention_lib.constrain_tokens(_residual(x, mlp, "down", h))


def moe_block(layer_params: dict, x: jax.Array, *, config: GPTConfig) -> tuple[jax.Array, Any]:
    """A block whose MLP is a mixture of experts (`replicator.moe.apply`, each sequence one
    routing group): ``(x, stats)``, ``stats`` a `replicator.moe.Stats` of per-sequence values."""
    p = _cast(layer_params, config)
    x = _attend(p, attention_lib.constrain_tokens(x.astype(config.dtype)), config)
    act = jax.nn.silu if config.mlp == "swiglu" else jax.nn.gelu
    y, stats = moe.apply(
        p["moe"], _norm(p["ln2"], x, config), routing=config.routing, activation=act
    )
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
    # ZeRO-3 parts cast to reduce_dtype once, before the scan: the backward scan then stacks
    # their gradients in that dtype too (half the fp32 stack's bytes for bf16), the same values
    # (the cast's transpose converts each reduce-scattered part exactly)
    stacked_params = _reduce_cast(stacked_params, config)
    remat = as_remat(config.remat, "GPTConfig")
    if remat.recomputes or _stored_sharded(stacked_params):  # ZeRO-3: gathered again backward
        # in a scan XLA cannot merge the recomputation with the forward; unrolled it could
        step = jax.checkpoint(
            step, policy=never_gathered(remat), prevent_cse=not config.scan_layers
        )
    out = jax.lax.scan(step, carry, stacked_params, unroll=not config.scan_layers)[0]
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
    return any(map(_is_stored, jax.tree.leaves(tree, is_leaf=_is_stored)))


def stage_fn(config: GPTConfig) -> Callable[[dict, jax.Array], jax.Array]:
    """``f(stage_params, x) -> x`` for the pipeline: the blocks of one stage (``[Lv, ...]``),
    built with `replicator.pipeline.scan_layers` so the pipeline steps through them one by one."""
    return pipeline.scan_layers(lambda p, x: block(p, x, config=config).astype(x.dtype))


def output_head(params: dict, *, config: GPTConfig) -> dict:
    """The head's parameters with its output matrix: ``params["head"]``, and with
    ``tie_embeddings`` ``"w"``, the token table transposed (gathered, for ZeRO-3). What
    `head_logits` and `head_loss` take.

    >>> import jax
    >>> config = GPTConfig(d_model=16, num_heads=2, num_layers=1, tie_embeddings=True)
    >>> head = jax.eval_shape(lambda: output_head(init(config, jax.random.key(0)), config=config))
    >>> head["w"].shape
    (16, 256)
    """
    if not config.tie_embeddings:
        return params["head"]
    tokens = rp.gather_params(_reduce_cast(params["embed"]["tokens"], config))
    return {**params["head"], "w": tokens.T}


def head_logits(head_params: dict, x: jax.Array, *, config: GPTConfig | None = None) -> jax.Array:
    """Final norm and output matrix: ``[B, S, D]`` to fp32 logits ``[B, S, V]``.
    ``head_params`` is `output_head`'s; ``config`` (default: `GPTConfig`'s) gives the norm."""
    config = _DEFAULT if config is None else config
    head_params = _gathered(head_params, config)
    if "w" not in head_params:
        raise ValueError(
            "gpt.head_logits: the head has no output matrix 'w' (a model with "
            "tie_embeddings=True); pass gpt.output_head(params, config=config)."
        )
    x = _norm(head_params["norm"], x.astype(jnp.float32), config)
    return x @ head_params["w"]


def head_loss(
    head_params: dict, x: jax.Array, targets: jax.Array, *, config: GPTConfig | None = None
) -> jax.Array:
    """Mean token cross-entropy of the head on ``x``, in fp32: the pipeline's ``loss_fn``.

    Each token's loss is ``logsumexp(logits) - logits[target]``, the target's logit picked by a
    sum against its one-hot mask (exact: one non-zero term), so that the loss and its gradient
    (``softmax - one_hot``) fuse into passes over the logits, with no ``[B, S, V]`` log-softmax
    kept and no gather or scatter on it (forward-mode autodiff applies too). Targets index as
    JAX indexes (negative ones from the end, others clamped)."""
    logits = head_logits(head_params, x, config=config)
    v = logits.shape[-1]
    targets = sharded_params.in_range(targets, v)
    one_hot = (
        jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
    )
    picked = jnp.sum(jnp.where(one_hot, logits, 0.0), axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def apply(params: dict, tokens: jax.Array, *, config: GPTConfig) -> jax.Array:
    """The whole model: fp32 logits ``[B, S, V]``."""
    order = sequence_order(config, tokens.shape[-1])
    x = embed(params["embed"], tokens, order, config.dtype)
    x = blocks(params["blocks"], x, config=config)
    logits = head_logits(output_head(params, config=config), x, config=config)
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
    """The whole model's mean cross-entropy on one device: the oracle for the pipeline (plus
    ``aux_weight`` times the load-balancing loss with ``num_experts``)."""
    return loss_and_stats(params, tokens, targets, config=config)[0]


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

    def value_and_grad(params: dict, batch: dict) -> tuple[jax.Array, dict]:
        tokens, targets = batch["tokens"], batch["targets"]
        order = sequence_order(config, tokens.shape[-1])
        if order is not None:  # a mean over tokens: the same in any order (`embed` takes its own)
            targets = targets[..., order]
        wire = _stage_dtype(config)
        x, embed_vjp = jax.vjp(lambda e: embed(e, tokens, order, wire), params["embed"])
        stages, cast_vjp = params["stages"], lambda g: (g,)
        if scatter_grads == "step":  # the pipeline gathers the parts: in reduce_dtype
            stages, cast_vjp = jax.vjp(lambda p: _reduce_cast(p, config), stages)
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
    return jnp.float32 if _xla_cpu_with("stage", MODEL_AXIS) else config.dtype


def _xla_cpu_with(*axes: str) -> bool:
    """Whether the program being traced is for XLA:CPU (not a TPU target's devices on a CPU
    host) on a mesh where each of ``axes`` has more than one device."""
    platform = binding_lib.current_binding().platform or jax.default_backend()
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    return platform == "cpu" and all(sizes.get(axis, 1) > 1 for axis in axes)


# -- placement: sharding by role -----------------------------------------------------------------


def _with_biases(config: GPTConfig, weights: dict) -> dict:
    """``{name: axes}`` of linear layers and, with ``config.bias``, their biases' (the last)."""
    out = {}
    for name, axes in weights.items():
        out[name] = axes
        if config.bias:
            out[f"{name}_bias"] = axes[-1:]
    return out


def _block_axes(config: GPTConfig) -> dict:
    norm = {"scale": ("embed",)}
    if _norm_has_bias(config):
        norm["bias"] = ("embed",)
    if config.num_kv_heads is None:
        attn = {"qkv": ("embed", "heads")}  # columns grouped by head (see `_qkv`)
    else:
        attn = {"q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads")}
    attn["out"] = ("heads", "embed")  # rows: the heads' outputs, in the same order
    mlp = {"gate": ("embed", "mlp")} if config.mlp == "swiglu" else {}
    mlp |= {"up": ("embed", "mlp"), "down": ("mlp", "embed")}
    return {
        "ln1": norm,
        "attn": _with_biases(config, attn),
        "ln2": norm,
        "mlp": _with_biases(config, mlp),
    }


def _axes(config: GPTConfig) -> dict:
    is_axes = lambda a: isinstance(a, tuple)
    block = _block_axes(config)
    embed = {"tokens": ("vocab", "embed")}
    if config.position == "learned":
        embed["positions"] = ("seq", "embed")
    head = {"norm": block["ln1"]} | ({} if config.tie_embeddings else {"w": ("embed", "vocab")})
    if not config.num_experts:
        blocks = jax.tree.map(lambda a: ("layers", *a), block, is_leaf=is_axes)
        return {"embed": embed, "blocks": blocks, "head": head}
    experts = moe.logical_axes(gated=config.mlp == "swiglu", bias=config.bias)
    moe_block = {k: v for k, v in block.items() if k != "mlp"} | {"moe": experts}
    group = {"moe": moe_block}
    if config.moe_every > 1:
        group["dense"] = jax.tree.map(lambda a: ("layers", *a), block, is_leaf=is_axes)
    blocks = jax.tree.map(lambda a: ("layers", *a), group, is_leaf=is_axes)
    return {"embed": embed, "blocks": blocks, "head": head}


LOGICAL_AXES: dict = _axes(_DEFAULT)
"""The role of each dimension of each leaf of `init`'s parameters (for the default `GPTConfig`;
`logical_axes` gives any config's): ``"heads"`` (attention heads, each ``head_dim`` wide),
``"kv_heads"`` (key/value heads, with ``num_kv_heads``), ``"mlp"`` (the MLP's hidden units),
``"embed"`` (the model width), ``"vocab"``, ``"seq"`` (positions) and ``"layers"`` (the stacked
blocks)."""


def logical_axes(config: GPTConfig | None = None) -> dict:
    """`LOGICAL_AXES` for ``config``'s parameters (`init`'s leaves: the architecture's norms,
    attention and MLP matrices, biases, positions and output matrix); with ``num_experts`` the
    grouped layout of `init` (``"layers"`` for the group axis and the dense blocks' own,
    ``"experts"`` for the experts of `replicator.moe.LOGICAL_AXES`).

    >>> config = GPTConfig(num_heads=4, num_kv_heads=2, mlp="swiglu", bias=False)
    >>> logical_axes(config)["blocks"]["attn"]["k"], logical_axes(config)["blocks"]["mlp"]["gate"]
    (('layers', 'embed', 'kv_heads'), ('layers', 'embed', 'mlp'))
    """
    return LOGICAL_AXES if config is None else _axes(config)


def zero_stacked(config: GPTConfig) -> dict[str, int]:
    """The ``stacked`` argument of ZeRO-3's ``shard_params`` for `init`'s parameters: the blocks'
    leading layer axes, which a layer scan slices (two with ``moe_every > 1``: groups, then each
    group's dense blocks)."""
    return {"blocks": 2 if config.num_experts and config.moe_every > 1 else 1}


def zero_split(config: GPTConfig) -> dict[str, int]:
    """The ``split`` argument of ZeRO-3's ``shard_params`` for `init`'s parameters: the
    embedding tables by their width (columns), so that `embed` looks up each replica's columns
    of every token's row and exchanges them (one all-to-all of the activations' size) instead
    of gathering the ``[V, D]`` table and reduce-scattering its gradient (MaxText's FSDP
    layout of the embedding)."""
    del config
    return {"embed": -1}


MEGATRON_RULES: Mapping[str, str | None] = types.MappingProxyType(
    {"heads": MODEL_AXIS, "mlp": MODEL_AXIS, "kv_heads": MODEL_AXIS}
)
"""Role to mesh axis, Megatron-LM's layout: attention heads (query and key/value heads alike)
and MLP hidden units split over ``model``, so the q/k/v (or qkv) and first MLP (gate, up)
matrices are split by columns and the attention output and second MLP matrices by rows; every
other role is whole. ``{**MEGATRON_RULES, "vocab": "model"}`` also splits the embedding table by
rows and the output matrix by columns; ``{**MEGATRON_RULES, "kv_heads": None}`` keeps the keys
and values whole on every device (for fewer key/value heads than ``model`` devices)."""

_ROLE_SIZES = {
    "heads": "num_heads",
    "kv_heads": "kv_heads",
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
    roles = ("heads", "kv_heads", "mlp", "vocab", "embed", "seq", "layers", "experts")
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


def _check_layout(params: dict, config: GPTConfig | None, api: str) -> None:
    """Refuses parameters whose leaves are not those of ``config``'s `init`."""
    axes = jax.tree.structure(logical_axes(config), is_leaf=lambda a: isinstance(a, tuple))
    if jax.tree.structure(params) != axes:
        made = "the default GPTConfig" if config is None else "config"
        raise ValueError(
            f"{api}: params do not have the leaves of {made}'s parameters (gpt.init(config, "
            f"key)); pass the config they were made with, e.g. {api}(repl, params, "
            f"config=config)."
        )


def _check_split(mesh, config: GPTConfig | None, rules: Mapping, api: str) -> None:
    """Refuses a split of a role that does not give each device whole heads (units, rows)."""
    split = {r: a for r, a in rules.items() if a in mesh.shape and mesh.shape[a] > 1}
    if config is None or config.num_kv_heads is None:
        split.pop("kv_heads", None)  # the fused qkv: key/value heads are the heads
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
        field = {"hidden": "d_ff", "kv_heads": "num_kv_heads"}.get(name, name)
        whole = (
            ", or rules={**gpt.MEGATRON_RULES, 'kv_heads': None} to keep keys and values whole "
            "on every device"
            if role == "kv_heads"
            else ""
        )
        raise ValueError(
            f"{api}: {field}={n} does not split over the {t} devices of {axis!r} (rules map "
            f"{role!r} to {axis!r}); use {field} a multiple of {t} (e.g. {t * math.ceil(n / t)}), "
            f"or a smaller {axis!r} axis{whole}."
        )


def place(
    repl: rp.Replicator,
    params: dict,
    *,
    config: GPTConfig | None = None,
    rules: Mapping[str, str | None] = MEGATRON_RULES,
) -> dict:
    """`init`'s parameters placed on ``repl``'s mesh for `loss`, split by `partition_specs`.

    On ``{"data": D, "model": T}`` each device holds ``num_heads / T`` heads (and with
    ``num_kv_heads``, ``num_kv_heads / T`` key/value heads: those its query heads use) and
    ``hidden / T`` MLP units of every block; ``step_fn`` still sees whole parameters (XLA
    partitions the ``model`` axis and adds its all-reduces: two per block forward, two
    backward). On a mesh without ``model`` every leaf is replicated, as
    ``repl.replicate(params)``.

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
      config: the model's sizes and architecture; needed when the mesh splits a role (to
        check whole heads) and for any but the default architecture (its leaves).
      rules: role to mesh axis (`partition_specs`).

    Returns:
      ``params``, placed.

    Raises:
      ValueError: if a role split over ``model`` (``num_heads``, ``num_kv_heads``, the hidden
        units) does not divide by its size, or ``config`` is missing for that check, or
        ``params`` do not have ``config``'s leaves.
    """
    specs = partition_specs(rules=rules, config=config)
    _check_layout(params, config, "gpt.place")
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
      config: the model's sizes and architecture (as for `place`).
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
    _check_layout(params, config, "gpt.place_pipeline")
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


def model_shape(config: GPTConfig, global_batch: int, opt_slots: int = 2):
    """The sizes `rp.plan` prices a layout of this model's training step from
    (`rp.ModelShape`): ``global_batch`` sequences a step, ``opt_slots`` fp32 copies of the
    parameters in the optimizer's state (Adam's 2).

    >>> model_shape(GPTConfig(d_model=64, num_layers=4, seq_len=64), 32).num_params
    236928
    """
    return rp.ModelShape(
        num_layers=config.num_layers, d_model=config.d_model, num_heads=config.num_heads,
        kv_heads=config.kv_heads, head_dim=config.head_dim, hidden=config.hidden,
        vocab=config.vocab_size, seq_len=config.seq_len, global_batch=global_batch,
        gated=config.mlp == "swiglu", bias=config.bias, layer_norm=config.norm == "layer",
        learned_positions=config.position == "learned", tied=config.tie_embeddings,
        compute_bytes=jnp.dtype(config.dtype).itemsize, opt_slots=opt_slots,
        attention=kernel if (kernel := config.attention) in ("dot_product", "splash")
        else "blockwise", experts=config.num_experts, top_k=config.top_k,
        capacity_factor=config.capacity_factor, moe_every=config.moe_every,
    )  # fmt: skip


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token, ``6 N + 6 L S D`` (Kaplan et al.): N non-embedding parameters
    a token uses (``L (2 D^2 + 2 D KV hd + 2 D F)``, ``3 D F`` for SwiGLU; a mixture's layer: its
    router's ``D E`` and ``top_k`` experts' MLPs, the active parameters, as MaxText and
    Megatron count them), plus the ``D V`` head, tied or not, and attention over ``S``
    positions.

    >>> flops_per_token(GPTConfig(d_model=64, num_layers=4, seq_len=64, vocab_size=256))
    1376256.0
    """
    d, f, n_layers = config.d_model, config.hidden, config.num_layers
    attn = 2 * d * d + 2 * d * config.kv_heads * config.head_dim
    mlp = (3 if config.mlp == "swiglu" else 2) * d * f
    moe = config.num_moe_layers * ((config.top_k - 1) * mlp + d * config.num_experts)
    n = n_layers * (attn + mlp) + moe + d * config.vocab_size
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
