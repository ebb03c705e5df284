"""Checks of ``config.json``'s values (sizes, numbers, flags, rotary settings), shared by
`replicator.models.hf` and `replicator.models.llama`. Each refusal is one line (a
``ValueError``) that names the key, what is wrong and what to write instead.
"""

from __future__ import annotations

import math
from typing import Any

_JSON_TYPES = {str: "a string", list: "a list", dict: "an object", bool: "a boolean"}
_SIZES = {  # config.json's sizes: what each counts
    "vocab_size": "the number of tokens",
    "hidden_size": "the model's width",
    "intermediate_size": "the MLP's width",
    "num_attention_heads": "the number of query heads",
    "num_hidden_layers": "the number of layers",
    "num_key_value_heads": "the number of key/value heads",
    "head_dim": "each head's width",
    "max_position_embeddings": "the longest sequence",
    "num_local_experts": "the number of experts",
    "num_experts": "the number of experts",
    "moe_intermediate_size": "each expert's width",
    "num_experts_per_tok": "the experts of each token",
    "sliding_window": "the attention window",
}
_OPTIONAL = (
    "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
    "num_local_experts", "num_experts_per_tok", "num_experts", "moe_intermediate_size",
)  # fmt: skip
_FLOATS = ("rms_norm_eps", "rope_theta")
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_BOOLS = (
    "tie_word_embeddings", "attention_bias", "mlp_bias", "output_router_logits",
    "use_sliding_window",
)  # fmt: skip


def json_kind(value: Any) -> str:
    """``value``'s JSON type, for messages."""
    if value is None:
        return "null"
    return _JSON_TYPES.get(type(value), "a fractional number" if isinstance(value, float) else "")


# -- config.json ---------------------------------------------------------------------------------


def _positive_int(config: dict, key: str, where: str) -> None:
    """Refuses ``config[key]`` unless it is a whole number >= 1 (JSON's, not a string)."""
    value = config[key]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    write = "the model's own value"
    if isinstance(value, str) and value.strip().isdigit() and int(value) >= 1:
        write = f'"{key}": {int(value)}, a number without quotes'
    elif isinstance(value, float) and value.is_integer() and value >= 1:
        write = f'"{key}": {int(value)}, without a fraction'
    problem = f"is {json_kind(value)}" if json_kind(value) else "is below 1"
    raise ValueError(
        f"{where}: {key}={value!r} {problem}; {key} ({_SIZES[key]}) must be a whole number "
        f">= 1: write {write} in config.json."
    )


def _number(
    config: dict, key: str, where: str, *, positive: bool = True, defaults: dict | None = None
) -> None:
    """Refuses ``config[key]`` unless it is a finite number, > 0 (``positive``) or >= 0;
    ``defaults`` (transformers' own) give the example in the message."""
    value = config[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and math.isfinite(value) and (value > 0 if positive else value >= 0):
        return
    default = (defaults or {}).get(key)
    example = f" (e.g. {default}), or remove the key for transformers' default" * (
        default is not None
    )
    kind = f" but {json_kind(value)}" if json_kind(value) else ""
    raise ValueError(
        f"{where}: {key}={value!r} is not a finite number {'>' if positive else '>='} 0{kind}; "
        f"write the model's own {key} in config.json{example}."
    )


def _rope(config: dict, where: str) -> None:
    """Refuses rotary settings that are not objects, and Llama 3's scaling without its
    numbers."""
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ValueError(
                f"{where}: {key}={config[key]!r} is {json_kind(config[key]) or 'a number'}; it "
                f'is an object such as {{"rope_type": "llama3", "factor": 8.0, ...}}, or null.'
            )
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if rope.get("rope_theta") is not None:
        _number(rope, "rope_theta", f"{where}: rope_parameters")
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return
    for key in LLAMA3_ROPE:
        if rope.get(key) is None:
            raise ValueError(
                f"{where}: rope_scaling has rope_type 'llama3' but no {key}; Llama 3's scaling "
                f"gives {', '.join(LLAMA3_ROPE)} (Llama 3.1 8B: 8.0, 1.0, 4.0, 8192): write "
                f"the model's own in config.json."
            )
        _number(rope, key, f"{where}: rope_scaling")


def check_config(
    config: dict, where: str, required: tuple[str, ...], defaults: dict | None = None
) -> None:
    """Refuses a value of ``config`` (a ``config.json``) that is missing from ``required`` or
    of the wrong type or range: sizes that are not whole numbers >= 1, norms' epsilon and
    rotary base that are not finite and positive, flags that are not true or false, rotary
    settings that are not objects, and head or expert counts that do not fit together."""
    missing = [key for key in required if config.get(key) is None]
    if missing:
        raise ValueError(
            f"{where}: the config lacks {', '.join(missing)}; a config.json gives every size "
            f"({', '.join(required)})."
        )
    for key in dict.fromkeys(required + tuple(k for k in _OPTIONAL if config.get(k) is not None)):
        _positive_int(config, key, where)
    for key in _FLOATS:
        if config.get(key) is not None:
            _number(config, key, where, defaults=defaults)
    for key in ("router_jitter_noise", "router_aux_loss_coef"):
        if config.get(key) is not None:
            _number(config, key, where, positive=False, defaults=defaults)
    for key in _BOOLS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise ValueError(
                f"{where}: {key}={config[key]!r} is {json_kind(config[key]) or 'a number'}; "
                f'write "{key}": true or "{key}": false in config.json (JSON\'s booleans).'
            )
    _rope(config, where)
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise ValueError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads="
            f"{kv} (each key/value head serves a whole group of query heads); write the "
            f"model's own num_key_value_heads in config.json, a divisor of {heads}."
        )
    experts = config.get("num_local_experts") or config.get("num_experts")
    top_k = config.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        raise ValueError(
            f"{where}: num_experts_per_tok={top_k} is more than num_local_experts={experts}; "
            f"each token goes to at most all the experts: write the model's own "
            f"num_experts_per_tok (Mixtral 8x7B's is 2)."
        )
