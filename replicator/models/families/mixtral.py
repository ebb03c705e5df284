"""Mixtral (``MixtralForCausalLM``): Llama's attention and norms, and in every block, in place
of the MLP, a mixture of ``num_local_experts`` SwiGLU experts without biases, each token going
to its ``num_experts_per_tok`` most probable ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families.family import (
    LAYER_NAMES,
    NO_BIASES,
    Family,
    check_window,
    refuse,
    unfuse_experts,
)

DEFAULTS = {  # transformers' MixtralConfig's, for keys a config.json omits
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "rope_scaling": None,
    "max_position_embeddings": 4096 * 32,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "router_jitter_noise": 0.0,
}
LAYER = {  # a block under blocks.moe: Llama's attention and norms, and the router
    **{("moe", *keys): value for keys, value in LAYER_NAMES.items() if keys[0] != "mlp"},
    ("moe", "moe", "router"): ("block_sparse_moe.gate.weight", True),
}
EXPERT_NAMES = {  # one tensor per expert j of a block
    ("moe", "moe", "gate"): ("block_sparse_moe.experts.{j}.w1.weight", True),
    ("moe", "moe", "up"): ("block_sparse_moe.experts.{j}.w3.weight", True),
    ("moe", "moe", "down"): ("block_sparse_moe.experts.{j}.w2.weight", True),
}
ROUTER = "model.layers.0.block_sparse_moe.gate.weight"  # in the first layer


def _options(hf: Mapping[str, Any], seq_len: int) -> dict:
    """The experts' `GPTConfig` fields (no token dropped, as in transformers; no
    load-balancing term in the loss unless asked for), refusing what they do not compute."""
    check_window(hf, seq_len)
    if hf.get("router_jitter_noise", 0.0):
        raise refuse(
            f"router_jitter_noise={hf['router_jitter_noise']}: the router's multiplicative "
            f"noise is not implemented; set it to 0 in config.json."
        )
    return dict(
        bias=False,
        num_experts=hf["num_local_experts"],
        top_k=hf.get("num_experts_per_tok", 2),
        capacity_factor=None,
        aux_weight=0.0,
    )


MIXTRAL = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    defaults=DEFAULTS,
    layer_names=LAYER | EXPERT_NAMES,
    biases=lambda hf: NO_BIASES,
    bias_keys=lambda biases: {} if biases == NO_BIASES else None,
    options=_options,
    required=("num_local_experts", "num_experts_per_tok"),
    experts=True,
    unfuse=unfuse_experts(LAYER | EXPERT_NAMES),
)
