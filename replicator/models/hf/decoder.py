"""A Hugging Face ``config.json`` as the decoder's `GPTConfig`: `decoder_config`, for every
family of `replicator.models.families` (Llama, Mixtral, Qwen2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicator.models import families
from replicator.models.config import GPTConfig, RopeScaling
from replicator.models.families import FAMILIES, architecture, family
from replicator.models.hf import config_checks, configs


def _rope(hf: Mapping[str, Any], default: float) -> tuple[float, RopeScaling | None]:
    """``rope_theta`` and the scaling of transformers' ``rope_parameters`` (v5) or
    ``rope_theta`` and ``rope_scaling`` (v4, most ``config.json`` files)."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", default)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise family.refuse("partial_rotary_factor != 1 (rotary positions on part of a head).")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(factor=float(rope["factor"]), rope_type="linear")
    if kind != "llama3":
        raise family.refuse(
            f"rope_type={kind!r} is not implemented; 'default', 'linear' and 'llama3' are."
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if rope.get(f) is None]
    if missing:  # decoder_config checked them; a direct call may not have
        raise family.refuse(f"rope_type 'llama3' without {', '.join(missing)}; it needs {fields}.")
    return theta, RopeScaling(**{f: rope[f] for f in fields})


def _family(hf: Mapping[str, Any]) -> family.Family:
    """``hf``'s family, its values checked as `hf.read_config` checks a config.json's."""
    kind = hf.get("model_type", "llama")
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise family.refuse(
            f"model_type={kind!r}; this reads the configs of {', '.join(FAMILIES)}."
        )
    found = FAMILIES[kind]
    sizes = configs.REQUIRED + found.required
    where = "hf.decoder_config: config"
    config_checks.check_config(found.canonical(hf), where, sizes, families.defaults())
    return found


def decoder_config(hf: Mapping[str, Any], **options: Any) -> GPTConfig:
    """The `GPTConfig` of a Hugging Face model's config: a Llama's, a Mixtral's or a Qwen2's.

    It reads the sizes, ``rms_norm_eps``, rotary positions (``rope_theta``, Llama 3's
    ``rope_scaling``), ``tie_word_embeddings``, and a Llama's biases when ``attention_bias``
    and ``mlp_bias`` both say so. ``seq_len`` defaults to ``max_position_embeddings``. The
    families are `replicator.models.families.FAMILIES`.

    A Mixtral (``model_type: "mixtral"``) is a Llama whose every MLP is a mixture of
    ``num_local_experts`` SwiGLU experts, each token going to its ``num_experts_per_tok`` most
    probable ones: ``num_experts``, ``top_k``, and ``capacity_factor=None``, so that no token
    is dropped, as in transformers (every expert then runs on every token's row of its buffer:
    ``num_experts / top_k`` times the experts' ideal FLOPs; pass ``capacity_factor=1.25`` to
    train at ``1.25 x`` the ideal, dropping what overflows). ``aux_weight`` defaults to 0, as
    transformers' loss has no load-balancing term unless ``output_router_logits``; with
    ``aux_weight > 0`` the term is `replicator.moe`'s (per sequence, first choices), not
    transformers' (pooled over the batch and the layers).

    A Qwen2 (``model_type: "qwen2"``) is a Llama with biases on the query, key and value
    projections only: ``qkv_bias=True``.

    Args:
      hf: the config's ``to_dict()``, or a checkpoint's ``config.json``.
      **options: other `GPTConfig` fields (``seq_len``, ``dtype``, ...).

    Returns:
      The `GPTConfig`.

    Raises:
      ValueError: for what the GPT does not compute: a ``model_type`` of no family, a
        ``hidden_act`` other than SiLU, a ``head_dim`` other than ``hidden_size /
        num_attention_heads``, a Llama's biases in attention but not the MLP (or the reverse),
        a rotary scaling other than Llama 3's, a sliding window shorter than ``seq_len`` (a
        Mixtral's or a Qwen2's), or router jitter; and for a size missing or not a whole
        number >= 1, or a value of the wrong type or range (as ``hf.read_config`` refuses
        them).

    >>> from replicator.models import hf
    >>> c = hf.decoder_config({"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    ...     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, seq_len=32)
    >>> c.num_kv_heads, c.rope_theta, c.seq_len, c.norm_eps
    (1, 500000.0, 32, 1e-06)
    >>> m = hf.decoder_config({"model_type": "mixtral", "vocab_size": 128, "hidden_size": 64,
    ...     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2})
    >>> m.num_experts, m.top_k, m.capacity_factor, m.rope_theta, m.norm_eps
    (8, 2, None, 1000000.0, 1e-05)
    >>> q = hf.decoder_config({"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64,
    ...     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "rope_theta": 1e6, "tie_word_embeddings": True})
    >>> q.qkv_bias, q.bias, q.tie_embeddings, q.seq_len
    (True, False, True, 32768)
    """
    found = _family(hf)
    hf = found.canonical(hf)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or found.defaults.get("head_dim") or d // heads
    unset = found.defaults
    seq_len = hf.get("max_position_embeddings", unset["max_position_embeddings"])
    theta, scaling = _rope(_global_rope(hf), unset["rope_theta"])
    config = dict(
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        head_width=None if head_dim * heads == d else head_dim,
        d_ff=hf["intermediate_size"],
        num_kv_heads=hf.get("num_key_value_heads", unset.get("num_key_value_heads")) or heads,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", unset["rms_norm_eps"])),
        tie_embeddings=bool(hf.get("tie_word_embeddings", unset["tie_word_embeddings"])),
        seq_len=seq_len,
    )
    act = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"  # Gemma's first
    config |= family.LLAMA_BLOCK | {"activation": architecture.activation(hf, act)}
    config |= found.options(hf, options.get("seq_len", seq_len))
    return GPTConfig(**config | options)


def _global_rope(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """``hf`` with the global layers' rotary settings where ``rope_parameters`` gives them by
    layer kind (Gemma 3's ``full_attention`` and ``sliding_attention``)."""
    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope:
        return {**hf, "rope_parameters": rope["full_attention"]}
    return hf
