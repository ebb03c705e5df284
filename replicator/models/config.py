"""The decoder's options: `GPTConfig` and `RopeScaling`, with their checks.

Every family (GPT-2, Llama, Mixtral, Qwen2) is a `GPTConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from replicator import moe
from replicator._src.core.errors import positive_int
from replicator._src.pipeline.remat import Remat, as_remat
from replicator._src.sharded import attention as attention_lib

NORMS = ("layer", "rms")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rescaled rotary frequencies (transformers' ``rope_scaling``, ``"llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, those shorter than ``original_max_position_embeddings /
    high_freq_factor`` kept, and those between interpolated smoothly. Frozen, so that
    `GPTConfig` stays hashable.

    Raises:
      ValueError: for another ``rope_type``, or unless ``factor > 0`` and
        ``high_freq_factor > low_freq_factor > 0``.

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
    """The decoder's sizes and architecture; the defaults are GPT-2's.

    Each field is documented where it is declared. `replicator.models.llama.config` sets
    Llama's architecture. The config is frozen and hashable, and checks its fields when made.

    Raises:
      ValueError: for a field out of its range or of an unknown name, naming the fix.

    >>> llama_like = GPTConfig(d_model=32, num_heads=4, num_kv_heads=2, norm="rms",
    ...                        position="rope", mlp="swiglu", bias=False)
    >>> llama_like.head_dim, llama_like.kv_heads
    (8, 2)
    """

    vocab_size: int = 256
    """Tokens in the vocabulary."""
    seq_len: int = 64
    """Tokens per sequence (the length of the learned position table)."""
    d_model: int = 64
    """The model width D."""
    num_heads: int = 4
    """Query heads; ``d_model`` divides by them, ``head_dim = d_model // num_heads``."""
    num_layers: int = 4
    """Transformer blocks."""
    d_ff: int | None = None
    """The MLP's hidden width; None for ``4 * d_model``."""
    dtype: Any = jnp.float32
    """The compute dtype. Parameters stay fp32, and the head's logits and loss are fp32."""
    remat: bool | str | Remat = False
    """What each block of `blocks` keeps for the backward pass: ``"none"`` (``False``) all its
    activations; ``"full"`` (``True``) its input only, recomputing the block; ``"dots"`` the
    outputs of its linear layers, recomputing attention's scores and the element-wise rest;
    one of MaxText's presets by activation name (``"save_dot_except_mlpwi"``, ``"minimal"``,
    ``"save_qkv_proj"``, ``"save_out_proj"``, ``"minimal_offloaded"``, ...); or a mapping
    ``{activation: "save" | "offload" | "recompute"}`` (`replicator._src.pipeline.remat`:
    ``"offload"`` keeps it in host memory), held as a hashable `Remat`. Every choice gives the
    same numbers, trading memory for FLOPs or host-link traffic. Pipelines take their own
    ``remat`` (`pipeline_value_and_grad`)."""
    attention: str = "ring"
    """How attention runs. Over a ``context`` axis: ``"ring"`` or ``"all_to_all"``
    (`replicator.attention`). On meshes without one: ``"dot_product"``,
    ``jax.nn.dot_product_attention`` (cuDNN's fused kernel where XLA picks it, key/value heads
    grouped without copies), or ``"splash"``, the TPU's splash-attention kernel (Pallas: the
    scores never reach HBM; interpreted off a TPU; `replicator._src.sharded.splash`). On a TPU,
    ``"ring"``, ``"all_to_all"`` and one device's attention run the same kernel
    (`replicator._src.sharded.kernels`)."""
    zigzag: bool = True
    """Causal ring attention over a ``context`` axis lays the sequence out in the zigzag order,
    so that every device does the same work (`sequence_order`)."""
    num_experts: int = 0
    """Experts of the mixture-of-experts blocks; 0 for a dense model."""
    moe_every: int = 1
    """With experts, every ``moe_every``-th block is a mixture of experts (the others dense);
    ``num_layers`` divides by it."""
    top_k: int = 1
    """Experts each token is routed to (`replicator.moe.Routing`)."""
    capacity_factor: float | None = 1.25
    """Each expert's slots relative to an even share; None drops no token
    (`replicator.moe.Routing`)."""
    moe_chunks: int = 1
    """The mixture-of-experts blocks take each device's sequences this many chunks at a time,
    each chunk computed again in the backward pass: the experts' rows live for ``1 /
    moe_chunks`` of the tokens (each sequence is its own routing group: the same routing and
    numbers). It divides the sequences a device's block takes (checked when the step is
    traced)."""
    aux_weight: float = 0.01
    """The weight of the load-balancing loss in `loss` (with experts)."""
    norm: str = "layer"
    """``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, ``x * rsqrt(mean(x^2) + eps) * scale``,
    no bias); both are computed in fp32."""
    norm_eps: float = 1e-5
    """The norms' epsilon."""
    position: str = "learned"
    """``"learned"`` (a ``[seq_len, d_model]`` table added to the token embeddings) or
    ``"rope"`` (rotary positions on each head's queries and keys, as transformers' Llama: the
    two halves of a head rotated, frequencies ``rope_theta ** (-2i / head_dim)``)."""
    rope_theta: float = 10000.0
    """The rotary base frequency."""
    rope_scaling: RopeScaling | None = None
    """Llama 3's rescaled rotary frequencies (a `RopeScaling`), or None for plain ones."""
    mlp: str = "gelu"
    """``"gelu"`` (``down(gelu(up(x)))``) or ``"swiglu"`` (``down(silu(gate(x)) * up(x))``),
    for the experts of a mixture too (Mixtral's experts are SwiGLU MLPs without biases)."""
    num_kv_heads: int | None = None
    """None keeps GPT-2's fused ``qkv`` matrix (as many key/value heads as query heads). A
    divisor of ``num_heads`` (or ``num_heads`` itself) gives separate ``q``, ``k`` and ``v``
    matrices and grouped-query attention: query head ``h`` attends with key/value head
    ``h // (num_heads / num_kv_heads)``."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms (RMSNorm has none)."""
    tie_embeddings: bool = False
    """The output matrix is the token table, transposed (the head has no ``"w"``;
    `output_head` gives it)."""
    scan_layers: bool = True
    """Run the blocks as one ``lax.scan``, compiled once whatever the depth. False unrolls it,
    one copy of the block per layer (MaxText's ``scan_layers=false``): longer to compile, the
    same numbers, and a program whose cost XLA's ``cost_analysis`` reads whole, where it
    counts a loop's body once."""
    reduce_dtype: Any = None
    """The dtype ZeRO-3 gathers the stored parameters in and reduce-scatters their gradients
    in (FSDP2's ``reduce_dtype``). None gathers them and sums the gradients in the parameters'
    own dtype (fp32), as one device sums them. The compute ``dtype`` (``"bfloat16"``) casts
    each replica's part before the gather, so that the gradients of the bf16 weights are summed
    in bf16, as MaxText's FSDP sums them: half the gradient bytes on the wire and in HBM, and
    each gradient rounded to bf16 once more. Nothing changes without ZeRO-3."""
    residual_split: bool = False
    """With a ``model`` axis, each block's input (the residual stream, and what a remat policy
    keeps or offloads of it as ``decoder_layer_input``) is held split over ``model`` by its
    width, as MaxText's ``activation_embed`` on its tensor axis: ``1 / model`` of it a device,
    for an all-gather before the block's first matmuls. False keeps it whole on every device of
    ``model`` (Megatron's layout). The same numbers."""
    loss_chunks: int = 1
    """The head's cross-entropy over this many chunks of each device's tokens, one at a time,
    each chunk's gradient taken in the forward pass (MaxText's ``num_vocab_tiling``): the fp32
    logits and their gradient held for ``1 / loss_chunks`` of the tokens, and the head's matmul
    not repeated. It divides the tokens a device's head takes (checked when the
    step is traced). The same numbers (the loss summed by chunks)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (``qkv``, or ``q``, ``k`` and ``v``) even
    without ``bias``: Qwen2's attention."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "seq_len",
            "d_model",
            "num_heads",
            "num_layers",
            "moe_every",
            "loss_chunks",
            "moe_chunks",
        ):
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
        if not isinstance(self.remat, (bool, str, Remat, Mapping)):
            raise ValueError(
                f"GPTConfig: remat must be True, False, a policy's name ('none', 'full', "
                f"'dots', 'save_dot_except_mlpwi', ...) or a mapping {{activation: action}}; got "
                f"{self.remat!r}."
            )
        if isinstance(self.remat, Mapping):  # hashable, as the config is
            object.__setattr__(self, "remat", as_remat(self.remat, "GPTConfig"))
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
        """The MLP's hidden width: ``d_ff``, or ``4 * d_model`` when it is None."""
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        """The width of one attention head: ``d_model // num_heads``."""
        return self.d_model // self.num_heads

    def has_bias(self, linear: str) -> bool:
        """Whether the linear layer ``linear`` (``"q"``, ``"out"``, ``"up"``, ...) has a bias."""
        return self.bias or (self.qkv_bias and linear in ("qkv", "q", "k", "v"))

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
        """The mixture-of-experts blocks: ``num_layers // moe_every`` with experts, else 0."""
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


DEFAULT = GPTConfig()
