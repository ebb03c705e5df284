"""Mistral (``MistralForCausalLM``): Llama's decoder with every layer attending over a sliding
window of ``sliding_window`` tokens (Mistral 7B v0.1's 4096; null, causal over the whole
sequence, from v0.2), and heads ``head_dim`` wide apart from ``hidden_size`` (Mistral Nemo's
128 with 32 heads of a 5120-wide model)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families import architecture
from replicator.models.families.family import LAYER_NAMES, NO_BIASES, Family

DEFAULTS = {  # transformers' MistralConfig's, for keys a config.json omits
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096 * 32,
    "tie_word_embeddings": False,
    "sliding_window": 4096,
    "hidden_act": "silu",
}


def _options(hf: Mapping[str, Any], seq_len: int) -> dict:
    del seq_len
    return {"bias": False, "activation": architecture.activation(hf)} | architecture.pattern(hf)


MISTRAL = Family(
    model_type="mistral",
    architecture="MistralForCausalLM",
    defaults=DEFAULTS,
    layer_names=LAYER_NAMES,
    biases=lambda hf: NO_BIASES,
    bias_keys=lambda biases: {} if biases == NO_BIASES else None,
    options=_options,
)
