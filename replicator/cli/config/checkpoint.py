"""The ``model:`` section of a config with ``init_from``: the sizes of the Hugging Face Llama,
Mixtral or Qwen2 it starts from (`CHECKPOINT_SIZES`, read from its config.json; the family's
own options, such as Qwen2's query/key/value biases, come with it)."""

from __future__ import annotations

import dataclasses

from replicator.cli.checks import where_of
from replicator.cli.config.sections import ModelConfig

# model: keys that init_from's config.json sets, and where they come from
CHECKPOINT_SIZES = {
    "vocab": "vocab_size",
    "d_model": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
}


def checkpoint_model(config) -> ModelConfig:
    """``config.model`` with the sizes of ``init_from``'s Llama, Mixtral or Qwen2 (kind gpt,
    family llama); a size the config sets to another value than the checkpoint's is refused."""
    from replicator.models import hf

    where = f"{where_of(config)}init_from={config.init_from!r}"
    if not isinstance(config.init_from, str) or not config.init_from:
        raise ValueError(
            f"{where} must be a directory (a Hugging Face Llama, Mixtral or Qwen2 checkpoint)."
        )
    try:
        hf_config = hf.read_config(config.init_from)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {str(e).splitlines()[0]}") from None
    model, defaults = config.model, ModelConfig()
    sizes = {key: hf_config.get(name) for key, name in CHECKPOINT_SIZES.items()}
    sizes = {key: value for key, value in sizes.items() if value is not None}
    for key, value in sizes.items():
        mine = getattr(model, key)
        if mine != getattr(defaults, key) and mine != value:
            raise ValueError(
                f"{where}: model.{key}={mine!r}, but the checkpoint's config.json has "
                f"{CHECKPOINT_SIZES[key]}={value!r}; remove model.{key} (the checkpoint sets it)."
            )
    if model.kind not in ("gpt", "llama"):
        raise ValueError(
            f"{where}: model.kind={model.kind!r}; init_from loads a Llama (kind: llama)."
        )
    if model.experts and "experts" not in sizes:
        raise ValueError(
            f"{where}: model.experts={model.experts}, but the checkpoint is a dense Llama (its "
            f"config.json has no num_local_experts); remove model.experts, or start from a "
            f"Mixtral checkpoint."
        )
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    try:
        return ModelConfig(**(fields | sizes | {"kind": "gpt", "family": "llama"}))
    except ValueError as e:  # e.g. a rope_theta of 0 in config.json
        message = str(e).removeprefix("ModelConfig: ")
        raise ValueError(f"{where}: with the sizes of its config.json, model.{message}") from None
