"""The decoder's options: `GPTConfig` and `RopeScaling`, with their checks.

Every family (GPT-2, Llama, Mixtral, Qwen2) is a `GPTConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from replicator import moe
from replicator._src.core.errors import positive_int
from replicator._src.pipeline.remat import Remat, as_remat
from replicator._src.sharded import attention as attention_lib

NORMS = ("layer", "rms")
POSITIONS = ("learned", "rope")
MLPS = {"gelu": ("gelu", False), "swiglu": ("silu", True), "geglu": ("gelu", True)}
"""``mlp``'s shorthands: ``(activation, gated)``."""
ACTIVATIONS = ("gelu", "gelu_exact", "silu", "relu")
LAYER_KINDS = ("global", "local")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rescaled rotary frequencies: transformers' ``rope_scaling``, Llama 3's or linear.

    ``"llama3"`` is Llama 3's; ``"linear"`` divides every frequency by ``factor`` (Gemma 3's
    global layers).

    For Llama 3's, wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
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
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(
                f"RopeScaling: rope_type={self.rope_type!r}; 'llama3' and 'linear' are "
                f"implemented (use rope_scaling=None for plain rotary positions)."
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
    """Query heads; ``d_model`` divides by them unless ``head_width`` is set."""
    head_width: int | None = None
    """Each attention head's width; None for ``d_model // num_heads``. Set, the queries are
    ``num_heads * head_width`` wide, whatever ``d_model`` (Gemma's 256, Qwen3's 128)."""
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
    activation: str = "gelu"
    """The MLP's activation: ``"gelu"`` (tanh-approximated: GPT-2's ``gelu_new``, Gemma's
    ``gelu_pytorch_tanh``, ``jax.nn.gelu``'s default), ``"gelu_exact"`` (the error function's),
    ``"silu"`` or ``"relu"``; the experts' too."""
    gated: bool = False
    """A gated MLP, ``down(act(gate(x)) * up(x))`` (SwiGLU with SiLU, GeGLU with GELU), rather
    than ``down(act(up(x)))``; the experts' too (Mixtral's are SwiGLU MLPs without biases)."""
    mlp: str | None = None
    """A shorthand for ``activation`` and ``gated``: ``"gelu"`` (GPT-2's), ``"swiglu"``
    (``silu``, gated: Llama's) or ``"geglu"`` (``gelu``, gated: Gemma's). It sets them and
    is then None; giving it with other values of them is refused."""
    norm_offset: float = 0.0
    """RMSNorm scales by ``norm_offset + scale``: Gemma's ``1 + w`` (1.0, its scales stored
    around 0 and initialised to 0); 0.0 scales by ``scale``."""
    scale_embeddings: bool = False
    """The token embeddings are multiplied by ``sqrt(d_model)`` (Gemma's), in ``dtype``."""
    post_norms: bool = False
    """Norms on each residual branch's output too (``post_attn_norm`` after attention,
    ``post_mlp_norm`` after the MLP, before their residual adds): Gemma 2's and 3's."""
    qk_norm: bool = False
    """RMSNorms over each head's queries and keys (``attn.q_norm``, ``attn.k_norm``, one
    ``[head_dim]`` scale each), before the rotary positions: Qwen3's and Gemma 3's."""
    query_scale: float | None = None
    """The attention scores' scale; None for ``1 / sqrt(head_dim)`` (Gemma's
    ``query_pre_attn_scalar ** -0.5``)."""
    attn_softcap: float | None = None
    """Attention scores become ``cap * tanh(scores / cap)`` before the mask and softmax
    (Gemma 2's ``attn_logit_softcapping``); None leaves them."""
    final_softcap: float | None = None
    """The head's logits become ``cap * tanh(logits / cap)`` (Gemma 2's
    ``final_logit_softcapping``); None leaves them."""
    attention_pattern: tuple[str, ...] = ("global",)
    """Each layer's attention, repeated over the layers in order: ``"global"`` (causal over
    the whole sequence) or ``"local"`` (the last ``sliding_window`` tokens only). Gemma 2's is
    ``("local", "global")``, Gemma 3's five ``"local"`` then ``"global"``, Mistral's
    ``("local",)``. The blocks scan over groups of ``len(attention_pattern)`` layers, and the
    layers a last group lacks run after them."""
    sliding_window: int | None = None
    """The local layers' window: a query sees the keys ``i - sliding_window < j <= i``
    (transformers' ``sliding_window``). Needed with a ``"local"`` layer."""
    local_rope_theta: float | None = None
    """The local layers' rotary base (Gemma 3's ``rope_local_base_freq``); None for
    ``rope_theta``."""
    normalize_top_k: bool = True
    """With ``top_k > 1``, each token's expert weights are its top-k router probabilities
    renormalised to sum to 1 (Mixtral's; Qwen3-MoE's ``norm_topk_prob``); False keeps the
    raw probabilities (Qwen2-MoE's)."""
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
        _apply_mlp_shorthand(self)
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
        if self.head_width is None and self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must divide by num_heads={self.num_heads}; "
                f"use e.g. d_model={self.num_heads * math.ceil(self.d_model / self.num_heads)}, or "
                f"set head_width."
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
        """The width of one attention head: ``head_width``, or ``d_model // num_heads``."""
        return self.head_width or self.d_model // self.num_heads

    @property
    def activation_fn(self):
        """The MLP's activation function (`activation`)."""
        return _ACTIVATION_FNS[self.activation]

    @property
    def q_width(self) -> int:
        """The queries' width, ``num_heads * head_dim`` (the output projection's input)."""
        return self.num_heads * self.head_dim

    def layer_kind(self, layer: int) -> str:
        """Layer ``layer``'s attention: ``"global"`` or ``"local"`` (`attention_pattern`)."""
        return self.attention_pattern[layer % len(self.attention_pattern)]

    @property
    def windowed(self) -> bool:
        """Whether some layer attends over a sliding window."""
        return "local" in self.attention_pattern

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
            num_experts=self.num_experts,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            normalize=self.normalize_top_k,
        )

    @property
    def num_moe_layers(self) -> int:
        """The mixture-of-experts blocks: ``num_layers // moe_every`` with experts, else 0."""
        return self.num_layers // self.moe_every if self.num_experts else 0


_ACTIVATION_FNS = {
    "gelu": jax.nn.gelu,
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


def _is_reduce_dtype(x: Any, compute: Any) -> bool:
    try:
        return jnp.dtype(x) in (jnp.dtype(compute), jnp.dtype(jnp.float32))
    except TypeError:
        return False


def _apply_mlp_shorthand(config: GPTConfig) -> None:
    """Sets ``activation`` and ``gated`` from ``mlp`` (then None), refusing a contradiction."""
    if config.mlp is None:
        return
    if config.mlp not in MLPS:
        raise ValueError(
            f"GPTConfig: mlp={config.mlp!r}; use one of {', '.join(map(repr, MLPS))}, or None "
            f"with activation and gated."
        )
    activation, gated = MLPS[config.mlp]
    default = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    for name, value in (("activation", activation), ("gated", gated)):
        given = getattr(config, name)
        if given != value and given != default[name]:
            raise ValueError(
                f"GPTConfig: mlp={config.mlp!r} means {name}={value!r}, but {name}={given!r} "
                f"was given; give one or the other."
            )
        object.__setattr__(config, name, value)
    object.__setattr__(config, "mlp", None)


def _check_architecture(config: GPTConfig) -> None:
    """`GPTConfig`'s checks of the architecture's options (norm, positions, MLP, heads)."""
    for name, allowed in (
        ("norm", NORMS),
        ("position", POSITIONS),
        ("activation", ACTIVATIONS),
    ):
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
    _check_attention_options(config)


def _check_attention_options(config: GPTConfig) -> None:
    """The checks of the per-layer attention pattern, caps and scales."""
    positive_int(config.head_width, api="GPTConfig", name="head_width", none=" or None")
    pattern = config.attention_pattern
    if isinstance(pattern, list):  # hashable, as the config is
        object.__setattr__(config, "attention_pattern", pattern := tuple(pattern))
    if not isinstance(pattern, tuple) or not pattern or set(pattern) - set(LAYER_KINDS):
        raise ValueError(
            f"GPTConfig: attention_pattern={pattern!r}; give a tuple of 'global' and 'local', "
            f"e.g. ('local', 'global') for Gemma 2's alternating layers, or ('global',)."
        )
    if config.num_experts and len(set(pattern)) > 1:
        raise ValueError(
            f"GPTConfig: attention_pattern={pattern} mixes layer kinds, which the "
            f"mixture-of-experts blocks do not follow yet; use one kind, e.g. ('global',)."
        )
    if config.windowed:
        positive_int(config.sliding_window, api="GPTConfig", name="sliding_window")
    elif config.sliding_window is not None:
        raise ValueError(
            f"GPTConfig: sliding_window={config.sliding_window} but no layer is 'local' in "
            f"attention_pattern={pattern}; add 'local' layers, or sliding_window=None."
        )
    for name in ("query_scale", "attn_softcap", "final_softcap", "local_rope_theta"):
        value = getattr(config, name)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ValueError(f"GPTConfig: {name}={value!r}; use a positive number, or None.")
    if config.norm_offset and config.norm != "rms":
        raise ValueError(
            f"GPTConfig: norm_offset={config.norm_offset} scales RMSNorms; use norm='rms'."
        )


DEFAULT = GPTConfig()
