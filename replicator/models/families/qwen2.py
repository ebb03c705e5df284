"""Qwen2 (``Qwen2ForCausalLM``, the Qwen2 and Qwen2.5 models): Llama's decoder with biases on
the query, key and value projections (and none on the output projection or the MLP), rotary
positions of base 1e6 in most checkpoints, and the output matrix tied to the token table in
the small ones. Its sliding window is off unless ``use_sliding_window``; a window is computed
exactly when it is at least the sequence (whole causal attention), and refused otherwise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families.family import (
    LAYER_NAMES,
    QKV,
    Family,
    biased_names,
    check_window,
)

DEFAULTS = {  # transformers' Qwen2Config's, for keys a config.json omits
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
}


def _options(hf: Mapping[str, Any], seq_len: int) -> dict:
    layers = hf.get("layer_types") or ()
    if hf.get("use_sliding_window") or "sliding_attention" in layers:
        check_window({"sliding_window": hf.get("sliding_window") or 4096}, seq_len)
    return {"bias": False, "qkv_bias": True}


QWEN2 = Family(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    defaults=DEFAULTS,
    layer_names=LAYER_NAMES | biased_names(QKV),
    biases=lambda hf: QKV,
    bias_keys=lambda biases: {} if biases == QKV else None,
    options=_options,
    bias_rule="Qwen2 has biases on q, k and v (and none on out or the MLP)",
)
