"""Gemma 2 (``Gemma2ForCausalLM``): Llama's attention and a GeGLU MLP (tanh-approximated GELU,
gated), with four RMSNorms a block (before and after attention and the MLP), each scaling by
``1 + w``; token embeddings times ``sqrt(hidden_size)``; attention scores scaled by
``query_pre_attn_scalar ** -0.5`` and soft-capped at ``attn_logit_softcapping``, the logits
at ``final_logit_softcapping``; layers alternating between a sliding window of
``sliding_window`` tokens and global attention; heads ``head_dim`` wide apart from
``hidden_size``; the output matrix tied to the token table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families import architecture
from replicator.models.families.family import LAYER_NAMES, NO_BIASES, Family, refuse

DEFAULTS = {  # transformers' Gemma2Config's, for keys a config.json omits
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
LAYER = {k: v for k, v in LAYER_NAMES.items() if k[0] not in ("ln1", "ln2")}
LAYER |= architecture.GEMMA_NORM_NAMES


def gemma_options(hf: Mapping[str, Any], kinds: Mapping[str, Any]) -> dict:
    """The `GPTConfig` fields every Gemma shares, with ``kinds``: its attention pattern."""
    if hf.get("attention_bias"):
        raise refuse("attention_bias=true: a Gemma's attention with biases is not implemented.")
    if hf.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention=true: the decoder's attention is causal.")
    act = architecture.activation(
        hf, "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    )
    return {
        "bias": False,
        "activation": act,
        "gated": True,
        "norm_offset": 1.0,
        "scale_embeddings": True,
        "post_norms": True,
        "query_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_softcap": hf.get("attn_logit_softcapping"),
        "final_softcap": hf.get("final_logit_softcapping"),
        **kinds,
    }


def _layer_types(hf: Mapping[str, Any]) -> dict:
    """Gemma 2's pattern: ``layer_types``, else even layers sliding and odd ones global."""
    if not hf.get("layer_types"):
        n = hf["num_hidden_layers"]
        hf = {**hf, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                    for i in range(n)]}  # fmt: skip
    return architecture.pattern(hf)


GEMMA2 = Family(
    model_type="gemma2",
    architecture="Gemma2ForCausalLM",
    defaults=DEFAULTS,
    layer_names=LAYER,
    biases=lambda hf: NO_BIASES,
    bias_keys=lambda biases: {} if biases == NO_BIASES else None,
    options=lambda hf, seq_len: gemma_options(hf, _layer_types(hf)),
)
