"""What a ``config.json`` says of the decoder's architecture beyond Llama's, shared by the
families: the MLP's activation, the per-layer attention pattern (sliding-window and global
layers, `GPTConfig.attention_pattern`), and the names of the extra norms' tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models.families.family import refuse as refuse

ACTIVATIONS = {  # transformers' ACT2FN name -> GPTConfig.activation
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_new": "gelu",
    "gelu_fast": "gelu",
    "gelu": "gelu_exact",
    "relu": "relu",
}
KINDS = {"sliding_attention": "local", "full_attention": "global"}
QK_NORM_NAMES = {  # (our block's leaf) -> (transformers' name in layer {i}, transposed)
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", False),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", False),
}
GEMMA_NORM_NAMES = {  # Gemma's four norms a block: before and after each branch
    ("ln1", "scale"): ("input_layernorm.weight", False),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("ln2", "scale"): ("pre_feedforward_layernorm.weight", False),
    ("post_mlp_norm", "scale"): ("post_feedforward_layernorm.weight", False),
}


def activation(hf: Mapping[str, Any], key: str = "hidden_act") -> str:
    """``GPTConfig.activation`` of ``hf[key]`` (transformers' name), refusing others."""
    name = hf.get(key) or "silu"
    if name not in ACTIVATIONS:
        raise refuse(
            f"{key}={name!r} is not implemented; the MLP computes "
            f"{', '.join(map(repr, ACTIVATIONS))}."
        )
    return ACTIVATIONS[name]


def layer_kinds(hf: Mapping[str, Any]) -> list[str]:
    """Each layer's attention, ``"local"`` or ``"global"``: ``layer_types`` when given, else
    every layer local with a ``sliding_window`` (unless ``use_sliding_window`` is false)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        unknown = sorted(set(types) - set(KINDS))
        if unknown or len(types) != n:
            raise refuse(
                f"layer_types={types!r}: give one of {', '.join(map(repr, KINDS))} for each of "
                f"the {n} layers."
            )
        kinds = [KINDS[t] for t in types]
    else:
        windowed = hf.get("sliding_window") and hf.get("use_sliding_window", True)
        kinds = ["local" if windowed else "global"] * n
    if "local" in kinds and not hf.get("sliding_window"):
        raise refuse("layer_types has sliding_attention layers but sliding_window is not set.")
    return kinds


def pattern(hf: Mapping[str, Any]) -> dict:
    """``attention_pattern`` (the shortest that repeats into `layer_kinds`) and
    ``sliding_window`` of ``hf``, as `GPTConfig` fields."""
    kinds = layer_kinds(hf)
    period = next(p for p in range(1, len(kinds) + 1)
                  if all(k == kinds[i % p] for i, k in enumerate(kinds)))  # fmt: skip
    local = "local" in kinds
    return {
        "attention_pattern": tuple(kinds[:period]),
        "sliding_window": hf["sliding_window"] if local else None,
    }
