"""Qwen3-MoE (``Qwen3MoeForCausalLM``, Qwen3-30B-A3B and 235B-A22B): Qwen3's attention (query
and key norms, 128-wide heads) and in every block, in place of the MLP, a mixture of
``num_experts`` fine-grained SwiGLU experts ``moe_intermediate_size`` wide, each token going to
its ``num_experts_per_tok`` most probable ones, their weights renormalised to sum to 1 with
``norm_topk_prob`` (raw router probabilities without)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families import architecture, qwen3
from replicator.models.families.family import (
    LAYER_NAMES,
    NO_BIASES,
    Family,
    refuse,
    unfuse_experts,
)
from replicator.models.families.qwen3 import qwen3_kinds

DEFAULTS = {  # transformers' Qwen3MoeConfig's, for keys a config.json omits
    **{k: v for k, v in qwen3.DEFAULTS.items() if k not in ("max_window_layers", "head_dim")},
    "num_key_value_heads": 4,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "mlp_only_layers": [],
}
LAYER = {  # a block under blocks.moe: Qwen3's attention and norms, and the router
    **{("moe", *k): v for k, v in (LAYER_NAMES | architecture.QK_NORM_NAMES).items()
       if k[0] != "mlp"},
    ("moe", "moe", "router"): ("mlp.gate.weight", True),
}  # fmt: skip
EXPERT_NAMES = {  # one tensor per expert j of a block
    ("moe", "moe", "gate"): ("mlp.experts.{j}.gate_proj.weight", True),
    ("moe", "moe", "up"): ("mlp.experts.{j}.up_proj.weight", True),
    ("moe", "moe", "down"): ("mlp.experts.{j}.down_proj.weight", True),
}


def _options(hf: Mapping[str, Any], seq_len: int) -> dict:
    """Qwen3's attention and the experts' `GPTConfig` fields (no token dropped, as in
    transformers; no load-balancing term unless asked for)."""
    del seq_len
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise refuse(
            f"decoder_sparse_step={hf.get('decoder_sparse_step')}, mlp_only_layers="
            f"{hf.get('mlp_only_layers')}: dense layers among the mixtures (of another width) "
            f"are not implemented; every layer is a mixture (decoder_sparse_step 1, "
            f"mlp_only_layers [])."
        )
    if hf.get("attention_bias"):
        raise refuse("attention_bias=true: a Qwen3's attention with biases is not implemented.")
    return {
        "bias": False,
        "activation": architecture.activation(hf),
        "qk_norm": True,
        "d_ff": hf.get("moe_intermediate_size") or hf["intermediate_size"],
        "num_experts": hf["num_experts"],
        "top_k": hf.get("num_experts_per_tok", 8),
        "normalize_top_k": bool(hf.get("norm_topk_prob", False)),
        "capacity_factor": None,
        "aux_weight": 0.0,
    } | qwen3_kinds(hf)


QWEN3_MOE = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    defaults=DEFAULTS,
    layer_names=LAYER | EXPERT_NAMES,
    biases=lambda hf: NO_BIASES,
    bias_keys=lambda biases: {} if biases == NO_BIASES else None,
    options=_options,
    required=("num_experts", "moe_intermediate_size"),
    experts=True,
    unfuse=unfuse_experts(LAYER | EXPERT_NAMES),
    experts_key="num_experts",
    expert_hidden_key="moe_intermediate_size",
    aliases={"num_local_experts": "num_experts"},  # transformers 5's spelling
)
