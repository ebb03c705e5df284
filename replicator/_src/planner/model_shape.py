"""The sizes of a decoder-only transformer and its training step, as the planner prices them
(`pricing.price`): `ModelShape`."""

from __future__ import annotations

import dataclasses
import math

TILE = 64  # `replicator.attention`'s tile: shorter sequences are attended in one block


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer and its training step, as pricing needs them.

    Attributes:
      num_layers, d_model, num_heads, kv_heads, head_dim, hidden, vocab, seq_len: the model.
      global_batch: sequences per step, over all replicas.
      gated: SwiGLU MLPs (three matrices) rather than two.
      bias: biases in the linear layers.
      qkv_bias: biases on the query, key and value projections only (Qwen2's), without
        ``bias``.
      layer_norm: LayerNorm (a scale and a bias) rather than RMSNorm (a scale).
      learned_positions: a ``[seq_len, D]`` position table.
      tied: the head is the token table.
      compute_bytes: the activations' bytes per element (4 for fp32, 2 for bf16).
      opt_slots: fp32 copies of the parameters the optimizer keeps (Adam 2, SGD 0).
      attention: ``"blockwise"`` (`replicator.attention`'s kernel, tile by tile), ``"splash"``
        (the TPU's Pallas kernel): a log-sum-exp a head kept for the backward; or
        ``"dot_product"``: the ``S x S`` scores kept. A sequence of at most `TILE` tokens on
        one device is attended in one block.
      experts, top_k, capacity_factor, moe_every: a mixture of experts in every
        ``moe_every``-th layer (`replicator.moe`): ``experts`` MLPs, each token to its
        ``top_k``, each expert ``ceil(capacity_factor * seq_len * top_k / experts)`` rows a
        sequence (``capacity_factor=None``: dropless, the routed rows). 0 experts: dense.
      loss_chunks: the head's cross-entropy over this many chunks of a device's tokens, one
        chunk's logits live at a time (`GPTConfig.loss_chunks`).
      moe_chunks: the mixtures take a device's sequences this many chunks at a time
        (`GPTConfig.moe_chunks`).
      residual_split: each block's input split over ``model`` by its width
        (`GPTConfig.residual_split`).
      local_layers, window: the fraction of the layers that attend over a sliding window of
        ``window`` keys (``GPTConfig.attention_pattern``); their scores cost
        ``min(window, seq_len)`` keys a query, not ``seq_len`` (`attended_keys`).
      post_norms, qk_norm: norms after each branch, and over each head's queries and keys.
      whole_sequences: attention that needs each sequence whole on a device (a sliding window
        shorter than it, or soft-capped scores): no ``context`` axis.
      mixed_layers: layers of more than one kind of attention, which a pipeline's stages do
        not take.
      reduce_bytes: bytes an element of the gradients' sums over the replicas, and of ZeRO-3's
        gathers of the parameters (``model.reduce_dtype``: 2 for bf16; 4, the fp32
        parameters', by default).
    """

    num_layers: int
    d_model: int
    num_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    seq_len: int
    global_batch: int
    gated: bool = False
    bias: bool = True
    layer_norm: bool = True
    learned_positions: bool = True
    tied: bool = False
    compute_bytes: int = 4
    opt_slots: int = 2
    attention: str = "blockwise"
    experts: int = 0
    top_k: int = 1
    capacity_factor: float | None = 1.25
    moe_every: int = 1
    qkv_bias: bool = False
    loss_chunks: int = 1
    moe_chunks: int = 1
    residual_split: bool = False
    reduce_bytes: int = 4
    local_layers: float = 0.0
    window: int = 0
    post_norms: bool = False
    qk_norm: bool = False
    whole_sequences: bool = False
    mixed_layers: bool = False

    @property
    def attended_keys(self) -> float:
        """The keys a query's scores are computed against, on average over the layers."""
        local = min(self.window, self.seq_len) if self.window else self.seq_len
        return (1 - self.local_layers) * self.seq_len + self.local_layers * local

    @property
    def qkv_columns(self) -> int:
        return (self.num_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def mlp_params(self) -> tuple[int, int]:
        """One MLP's ``(matrix entries, biases)``."""
        gates = 2 if self.gated else 1
        bias = self.hidden * gates + self.d_model if self.bias else 0
        return (gates + 1) * self.d_model * self.hidden, bias

    @property
    def moe_layers(self) -> int:
        return self.num_layers // self.moe_every if self.experts else 0

    @property
    def expert_params(self) -> int:
        """Every expert's parameters, over the layers (split over ``expert`` and ``model``)."""
        return self.moe_layers * self.experts * sum(self.mlp_params)

    @property
    def expert_rows(self) -> float:
        """A mixture's rows per token: ``experts * capacity / seq_len`` (each expert's slots of
        a sequence are computed, empty or not; `replicator.moe`); dropless
        (``capacity_factor=None``), ``top_k``: the routed rows only, sorted by expert."""
        if not self.experts:
            return 1.0
        if self.capacity_factor is None:
            return float(self.top_k)
        share = self.capacity_factor * self.seq_len * self.top_k / self.experts
        rows = max(1, min(self.seq_len, math.ceil(round(share, 9))))
        return self.experts * rows / self.seq_len

    @property
    def mlp_rows(self) -> float:
        """The MLP rows a token makes in a layer, on average over the layers: 1 for a dense
        MLP, `expert_rows` for a mixture."""
        dense = self.num_layers - self.moe_layers
        return (dense + self.moe_layers * self.expert_rows) / self.num_layers

    @property
    def block_matmul_params(self) -> int:
        """One layer's matrix entries: queries, keys, values, output, MLP."""
        d = self.d_model
        attention = d * self.qkv_columns + self.num_heads * self.head_dim * d
        return attention + (3 if self.gated else 2) * d * self.hidden

    @property
    def block_params(self) -> tuple[int, int]:
        """One layer's parameters: ``(split over model, whole on each model device)``."""
        split = self.block_matmul_params
        norms = 4 if self.post_norms else 2
        whole = norms * self.d_model * (2 if self.layer_norm else 1)
        whole += 2 * self.head_dim if self.qk_norm else 0
        if self.bias:
            split += self.qkv_columns + self.hidden * (2 if self.gated else 1)
            whole += 2 * self.d_model
        elif self.qkv_bias:
            split += self.qkv_columns
        return split, whole

    @property
    def outer_params(self) -> tuple[int, int]:
        """The embedding's and head's: ``(split over model: the vocabulary, whole)``."""
        d = self.d_model
        split = self.vocab * d * (1 if self.tied else 2)
        whole = d * (2 if self.layer_norm else 1) + (
            self.seq_len * d if self.learned_positions else 0
        )
        return split, whole

    @property
    def num_params(self) -> int:
        block = sum(self.block_params)
        moe = self.moe_layers * (self.d_model * self.experts - sum(self.mlp_params))
        return self.num_layers * block + moe + self.expert_params + sum(self.outer_params)
