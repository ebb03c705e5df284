"""Gemma 3's text model (``Gemma3ForCausalLM``, ``model_type: "gemma3_text"``): Gemma 2's
block (`replicator.models.families.gemma2`) with RMSNorms over each head's queries and keys, five
sliding-window layers to a global one (``sliding_window_pattern`` 6, or ``layer_types``), the
local layers rotating by their own base (``rope_local_base_freq``, 10,000) and the global ones
by ``rope_theta`` (1,000,000) with its scaling (linear in the 4B and larger), and no soft cap
on the attention scores (transformers' Gemma 3 leaves ``attn_logit_softcapping`` unused, and so
does this); the logits' with ``final_logit_softcapping``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families import architecture
from replicator.models.families.family import NO_BIASES, Family
from replicator.models.families.gemma2 import LAYER, gemma_options

DEFAULTS = {  # transformers' Gemma3TextConfig's, for keys a config.json omits
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": None,
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


def _layer_types(hf: Mapping[str, Any]) -> dict:
    """Gemma 3's pattern: ``layer_types``, else every ``sliding_window_pattern``-th layer global."""
    if not hf.get("layer_types"):
        n, every = hf["num_hidden_layers"], hf.get("sliding_window_pattern") or 6
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
        ]
        hf = {**hf, "layer_types": types}
    return architecture.pattern(hf)


def _local_theta(hf: Mapping[str, Any]) -> float:
    """The local layers' rotary base: ``rope_parameters["sliding_attention"]``'s, else
    ``rope_local_base_freq``."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise architecture.refuse(
            f"rope_parameters.sliding_attention.rope_type={local['rope_type']!r}; the local "
            f"layers' rotary positions are plain ('default')."
        )
    return float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))


GEMMA3 = Family(
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    defaults=DEFAULTS,
    layer_names=LAYER | architecture.QK_NORM_NAMES,
    biases=lambda hf: NO_BIASES,
    bias_keys=lambda biases: {} if biases == NO_BIASES else None,
    options=lambda hf, seq_len: (
        gemma_options(hf, _layer_types(hf))
        | {"qk_norm": True, "local_rope_theta": _local_theta(hf), "attn_softcap": None}
    ),
)
