"""The config's sections besides ``data:`` and ``optimizer:``: ``model:`` (`ModelConfig`),
``pipeline:``, ``profile:`` and ``wandb:``, each checked on its own when it is built."""

from __future__ import annotations

import dataclasses
import math

from replicator.cli.checks import at_least, finite_positive, one_of, where_of
from replicator.cli.config.constants import (
    ATTENTIONS,
    DTYPES,
    EXPERT_FAMILIES,
    GPT_ONLY,
    LLAMA_BLOCK_ONLY,
    MODEL_FAMILIES,
    MODEL_KINDS,
    OWN_KIND,
    SCHEDULES,
    WANDB_MODES,
)
from replicator.pipeline import remat_policy


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # "gpt": a byte-level decoder on Python's stdlib sources (d_model, layers, heads, seq_len,
    #   and the gpt-only vocab, d_ff, dtype, remat);
    # "mlp": a residual MLP regression (d_model, layers);
    # "cnn": a classifier with cross-replica BatchNorm on generated shape images (width);
    # "module:function": your own job, `function(config, repl, tx)` (see jobs.own_model).
    kind: str = "gpt"
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    width: int = 16  # cnn: channels of the first conv block (the second has twice as many)
    vocab: int = 256  # gpt: token ids (the built-in text and untokenized text are bytes, 0-255)
    d_ff: int | None = None  # gpt: the MLP's hidden units; null: 4 * d_model
    dtype: str = "float32"  # gpt: the compute dtype, "float32" or "bfloat16" (params stay fp32)
    # gpt: what each block keeps for its backward pass (the same numbers whatever it is):
    # none (false) all its activations; full (true) its input, recomputing the block; dots the
    # outputs of its linear layers, recomputing attention's scores (Megatron-LM's selective
    # recomputation); one of MaxText's presets by activation name (save_dot_except_mlpwi,
    # save_dot_except_mlp, save_qkv_proj, save_out_proj, minimal, minimal_offloaded,
    # qkv_proj_offloaded); or a mapping {activation: save | offload | recompute} (MaxText's
    # remat_policy=custom; offload keeps it in host memory), e.g.
    #   remat: {decoder_layer_input: offload, query_proj: offload, out_proj: save}
    # In a pipeline it is the engine's remat, for every schedule (no offload there).
    remat: bool | str | dict = False
    # gpt: attention over a `context` axis (the sequence split over it): ring (each device's
    # keys and values passed round the axis) or all_to_all (DeepSpeed-Ulysses: the heads split
    # over it instead, heads / mesh.model a multiple of mesh.context); the same numbers.
    # dot_product: jax.nn.dot_product_attention (the platform's own; no context axis).
    # splash: the TPU's splash-attention kernel (Pallas; interpreted off a TPU; no context
    # axis: ring and all_to_all run the same kernel on a TPU).
    attention: str = "ring"
    zigzag: bool = True  # gpt, ring: chunks in zigzag order, the causal work even over `context`
    # gpt: the vocabulary split over `model` too (the token table by rows, the output matrix by
    # columns: each device computes its share of the logits, as Megatron-LM's vocab-parallel
    # embedding and cross-entropy), when the vocabulary divides by mesh.model and the mesh has
    # no context or expert axis (XLA's partitioner aborts there); false keeps them whole on
    # every device (each then computes every logit). The same numbers either way.
    vocab_parallel: bool = True
    # gpt: the blocks as one lax.scan (compiled once); false unrolls them, a copy per layer
    scan_layers: bool = True
    # gpt: the dtype the gradients are summed over the replicas in: null their own (fp32, summed
    # as one device sums them), or bfloat16 (half the bytes on the wire, across slices too;
    # each gradient rounded to bf16 once more). zero_stage 3 (gpt): the stored parameters are
    # gathered in it too, as MaxText's FSDP; 0-2: the all-reduce or reduce-scatter of the
    # gradients is sent in it (Horovod's compression), the update gathered in fp32
    reduce_dtype: str | None = None
    # gpt, a `model` axis: each block's input (the residual stream, and what remat keeps or
    # offloads of it) split over `model` by its width (MaxText's activation_embed on its tensor
    # axis): 1/model of it a device; false keeps it whole on each (Megatron's). Same numbers.
    residual_split: bool = False
    # gpt: the head's cross-entropy over this many chunks of each device's tokens, one chunk's
    # logits live at a time, its gradient taken in the forward pass (MaxText's
    # num_vocab_tiling): less memory, the same matmuls; the same numbers.
    # It divides the tokens a device's head takes (sequences a device x seq_len).
    loss_chunks: int = 1
    # gpt, experts: the mixture-of-experts blocks take each device's sequences this many chunks
    # at a time, each computed again in the backward pass (each sequence is its own routing
    # group: the same numbers): the experts' rows held for a chunk's tokens. It divides the
    # sequences a device's block takes (per expert-axis device).
    moe_chunks: int = 1
    # gpt: a mixture of experts: experts per MoE block (0: dense MLPs; the keys below are then
    # unused), split over an `expert` axis; every moe_every-th block is one (layers a multiple
    # of it); each token goes to its top_k experts, each taking at most capacity_factor x its
    # share of a sequence's token-choices (the rest dropped: the token keeps its residual only;
    # null: none dropped); aux_weight x the load-balancing loss is added to the loss;
    # normalize_top_k: a token's top_k weights renormalised to sum to 1 (true), or its raw
    # router probabilities (false); null: the family's (Mixtral's true, Qwen3-MoE's as its
    # config.json's norm_topk_prob, false by default).
    experts: int = 0
    moe_every: int = 1
    top_k: int = 1
    capacity_factor: float | None = 1.25
    aux_weight: float = 0.01
    normalize_top_k: bool | None = None
    # gpt: the model family: gpt (LayerNorm, learned positions, GELU MLP, biases), or one of
    # replicator.models.families: llama (RMSNorm, rotary positions, SwiGLU, no biases,
    # grouped-query attention), qwen2 (Llama's block with biases on the query, key and value
    # projections), mixtral (Llama's block with a mixture of `experts` in every block). In a
    # file, kind: llama is short for kind: gpt with family: llama. The keys of the families on
    # Llama's block: kv_heads (key/value heads; null: heads), rope_theta, norm_eps,
    # tie_embeddings (the head is the token table), head_dim (each head's width; null:
    # d_model / heads; Gemma's 256, Qwen3's 128), sliding_window (the local layers' window;
    # null: the family's own, such as Gemma 2's 4096 on every other layer). gemma2,
    # gemma3_text, qwen3, qwen3_moe and mistral are the families of their names (their
    # modules in replicator.models.families say what each adds).
    family: str = "gpt"
    kv_heads: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "llama":
            raise ValueError(
                f"{where_of(self)}kind='llama' is a config file's short form of kind='gpt' "
                f"with family='llama'; build ModelConfig(kind='gpt', family='llama'), or read "
                f"the config with replicator.cli.config.from_dict, which takes the short forms."
            )
        self._check_family()
        for name, example in (("rope_theta", "rope_theta=10000.0"), ("norm_eps", "norm_eps=1e-5")):
            finite_positive(self, name, example=example)  # else NaN from the first step
        if self.kv_heads is not None:
            at_least(self, "kv_heads", 1)
            if self.heads % self.kv_heads:
                raise ValueError(
                    f"{where_of(self)}kv_heads={self.kv_heads} must divide heads={self.heads} "
                    f"(each key/value head serves heads / kv_heads query heads)."
                )
        if not OWN_KIND.fullmatch(str(self.kind)):  # else "module:function", your own model
            one_of(self, "kind", MODEL_KINDS, what="a model kind (or 'module:function')")
        for name in ("d_model", "layers", "heads", "seq_len", "width"):
            at_least(self, name, 1)
        if self.kind in ("mlp", "cnn"):  # your own job reads what it likes of the section
            for name, default in GPT_ONLY.items():
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{where_of(self)}{name}={getattr(self, name)!r} is for model.kind='gpt'; "
                        f"model.kind={self.kind!r} has no {name}. Remove the key (or set it to "
                        f"{default!r})."
                    )
        at_least(self, "vocab", 1)
        at_least(self, "loss_chunks", 1)
        at_least(self, "moe_chunks", 1)
        if self.d_ff is not None:
            at_least(self, "d_ff", 1)
        one_of(self, "dtype", DTYPES, what="a compute dtype")
        if self.reduce_dtype is not None:
            one_of(self, "reduce_dtype", DTYPES, what="a dtype to reduce gradients in (or null)")
        if not isinstance(self.remat, bool):
            remat_policy(self.remat, type(self).__name__)  # "ModelConfig: remat must be ..."
        self._check_attention_and_experts()
        for name in ("head_dim", "sliding_window"):
            if getattr(self, name) is not None:
                at_least(self, name, 1)
        if self.kind == "gpt" and self.d_model % self.heads and self.head_dim is None:
            raise ValueError(
                f"{where_of(self)}heads={self.heads} does not divide d_model={self.d_model}; use a "
                f"d_model that is a multiple of heads (e.g. "
                f"d_model={self.heads * math.ceil(self.d_model / self.heads)})."
            )

    @property
    def label(self) -> str:
        """What the model is, as a report names it: its kind, or its family of the GPT
        (``"llama"``, ``"qwen2"``)."""
        return self.family if self.kind == "gpt" and self.family != "gpt" else self.kind

    def _check_family(self) -> None:
        """The model family, and the keys only the families on Llama's block read."""
        one_of(self, "family", MODEL_FAMILIES, what="a model family")
        if self.family == "gpt":
            for name, default in LLAMA_BLOCK_ONLY.items():
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{where_of(self)}{name}={getattr(self, name)!r} is for the families on "
                        f"Llama's block (family: {', '.join(MODEL_FAMILIES[1:])}); remove the "
                        f"key, or use kind: llama."
                    )

    def _check_attention_and_experts(self) -> None:
        """The attention and mixture-of-experts keys, each on its own."""
        one_of(self, "attention", ATTENTIONS, what="an attention over the context axis")
        at_least(self, "experts", 0)
        at_least(self, "moe_every", 1)
        at_least(self, "top_k", 1)
        if self.capacity_factor is not None:
            finite_positive(self, "capacity_factor", example="capacity_factor=1.25", none=True)
        value = self.aux_weight
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (math.isfinite(value) and value >= 0)
        ):
            raise ValueError(
                f"{where_of(self)}aux_weight must be a finite number >= 0; got {value!r} (e.g. "
                f"aux_weight=0.01, or 0 for no load-balancing loss)."
            )
        if self.family in EXPERT_FAMILIES and (not self.experts or self.moe_every != 1):
            raise ValueError(
                f"{where_of(self)}family={self.family!r} has a mixture of experts in every "
                f"block; got experts={self.experts}, moe_every={self.moe_every}. Set "
                f"model.experts (e.g. model.experts=8, with model.top_k=2) and "
                f"model.moe_every=1, or use model.family=llama for a dense model."
            )
        if not self.experts:
            return
        if self.top_k > self.experts:
            raise ValueError(
                f"{where_of(self)}top_k={self.top_k} is more than experts={self.experts} (each "
                f"token goes to top_k different experts); use top_k <= {self.experts} (e.g. "
                f"top_k={min(2, self.experts)}), or more experts."
            )
        if self.layers % self.moe_every:
            raise ValueError(
                f"{where_of(self)}moe_every={self.moe_every} does not divide layers={self.layers} "
                f"(every moe_every-th block is a mixture of experts); use layers a multiple of "
                f"{self.moe_every} (e.g. layers="
                f"{self.moe_every * math.ceil(self.layers / self.moe_every)}), or moe_every=1."
            )


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    # "gpipe", "circular", "1f1b", "interleaved" (Megatron-LM's interleaved 1F1B) or "zerobubble"
    schedule: str = "1f1b"
    microbatches: int = 4  # interleaved: a multiple of the stage axis
    repeats: int = 2  # virtual stages per device, for "circular" and "interleaved" (>= 2)
    # zero_stage 3: "step" sums the stages' gradients whole over the micro-batches and
    # reduce-scatters them once a step; "microbatch" in each micro-batch's backward pass
    scatter_grads: str = "microbatch"
    # with --slices N (explain, plan): the stages cross the TPU slices (mesh.stage a multiple
    # of N, no mesh.dcn_data; only the stage sends cross the data-centre network) instead of
    # a dcn_data axis of the slices; no effect on one slice
    across_slices: bool = False

    def __post_init__(self) -> None:
        one_of(self, "schedule", SCHEDULES, what="a schedule")
        one_of(self, "scatter_grads", ("microbatch", "step"), what="a reduce-scatter setting")
        at_least(self, "microbatches", 1)
        at_least(self, "repeats", 1)
        if self.schedule == "interleaved" and self.repeats < 2:
            raise ValueError(
                f"{where_of(self)}repeats={self.repeats}: schedule='interleaved' needs 2 or more "
                f"virtual stages per device; use repeats=2 (layers a multiple of 2 x the stage "
                f"axis), or schedule='1f1b' for one stage per device."
            )


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    start_step: int = 3  # the first traced step, counted from 1 (step 1 compiles)
    num_steps: int = 3

    def __post_init__(self) -> None:
        at_least(self, "start_step", 1)
        at_least(self, "num_steps", 1)


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    # A Weights & Biases run in out_dir/name/wandb; `wandb: true` is short for `wandb: {}`.
    project: str | None = None  # null: the run's name
    name: str | None = None  # the W&B run's display name; null: the run's name
    mode: str = "offline"  # nothing sent: `wandb sync` the run later; "online" or "disabled"

    def __post_init__(self) -> None:
        one_of(self, "mode", WANDB_MODES, what="a wandb mode")
        for key in ("project", "name"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                raise ValueError(
                    f"{where_of(self)}{key} must be a non-empty name or null; got {value!r}."
                )
