"""Llama (``LlamaForCausalLM``): the decoder with RMSNorm, rotary positions, a SwiGLU MLP and
grouped-query attention, and biases in every linear layer of the attention
(``attention_bias``) and of the MLP (``mlp_bias``), or none."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families.family import (
    ATTENTION,
    BIAS_NAMES,
    LAYER_NAMES,
    MLP,
    NO_BIASES,
    Family,
    refuse,
)

DEFAULTS = {  # transformers' LlamaConfig's, for keys a config.json omits
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


def _biases(hf: Mapping[str, Any]) -> frozenset[str]:
    attention = ATTENTION if hf.get("attention_bias") else ()
    return frozenset(attention + (MLP if hf.get("mlp_bias") else ()))


def _bias_keys(biases: frozenset[str]) -> dict | None:
    keys = {"attention_bias": set(ATTENTION) <= biases, "mlp_bias": set(MLP) <= biases}
    return keys if _biases(keys) == biases else None


def _options(hf: Mapping[str, Any], seq_len: int) -> dict:
    del seq_len
    bias = bool(hf.get("attention_bias", False))
    if bias != bool(hf.get("mlp_bias", False)):
        raise refuse(
            f"attention_bias={bias} but mlp_bias={hf.get('mlp_bias', False)}; the GPT has "
            f"biases in every linear layer or none (bias=True or False)."
        )
    return {"bias": bias}


LLAMA = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    defaults=DEFAULTS,
    layer_names=LAYER_NAMES | BIAS_NAMES,
    biases=_biases,
    bias_keys=_bias_keys,
    options=_options,
    bias_rule=(
        "Llama has biases in all of attention's linears (q, k, v, out) or none, and the same "
        "for the MLP's (gate, up, down)"
    ),
)
assert _bias_keys(NO_BIASES) == {"attention_bias": False, "mlp_bias": False}
