"""Qwen3 (``Qwen3ForCausalLM``): Llama's decoder with RMSNorms over each head's queries and
keys (``q_norm``, ``k_norm``), heads ``head_dim`` wide apart from ``hidden_size`` (128 in
every size), no biases, and the output matrix tied to the token table in the small ones. Its
sliding window is off unless ``use_sliding_window`` (then on the layers from
``max_window_layers``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families import architecture
from replicator.models.families.family import LAYER_NAMES, NO_BIASES, Family, refuse

DEFAULTS = {  # transformers' Qwen3Config's, for keys a config.json omits
    "num_key_value_heads": 32,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "hidden_act": "silu",
}


def qwen3_kinds(hf: Mapping[str, Any]) -> dict:
    """Qwen3's attention pattern: its ``layer_types``, or sliding from ``max_window_layers``
    with ``use_sliding_window``."""
    if not hf.get("layer_types") and hf.get("use_sliding_window") and hf.get("sliding_window"):
        n = hf["num_hidden_layers"]
        first = hf.get("max_window_layers", n)
        types = ["full_attention" if i < first else "sliding_attention" for i in range(n)]
        hf = {**hf, "layer_types": types}
    if not hf.get("use_sliding_window"):
        hf = {**hf, "layer_types": None, "sliding_window": None}
    return architecture.pattern(hf)


def _options(hf: Mapping[str, Any], seq_len: int) -> dict:
    del seq_len
    if hf.get("attention_bias"):
        raise refuse("attention_bias=true: a Qwen3's attention with biases is not implemented.")
    options = {"bias": False, "activation": architecture.activation(hf), "qk_norm": True}
    return options | qwen3_kinds(hf)


QWEN3 = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    defaults=DEFAULTS,
    layer_names=LAYER_NAMES | architecture.QK_NORM_NAMES,
    biases=lambda hf: NO_BIASES,
    bias_keys=lambda biases: {} if biases == NO_BIASES else None,
    options=_options,
)
