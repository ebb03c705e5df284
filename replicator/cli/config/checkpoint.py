"""The ``model:`` section of a config with ``init_from``: the sizes and the family of the
Hugging Face checkpoint (of a family of `replicator.models.families`) it starts from (`CHECKPOINT_SIZES`, read from its
config.json; the family's own options, such as Qwen2's query/key/value biases, come with it),
merged into the section as plain data before the config is built (`short_forms`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from replicator.cli.config.sections import ModelConfig

# model: keys that init_from's config.json sets, and where they come from
CHECKPOINT_SIZES = {
    "vocab": "vocab_size",
    "d_model": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def _same(mine: Any, value: Any) -> bool:
    """Whether a config's ``mine`` is the checkpoint's ``value`` (a number written as YAML 1.1
    reads ``1e-5``, a string, is the number)."""
    if isinstance(mine, str) and isinstance(value, float):
        try:
            return float(mine) == value
        except ValueError:
            return False
    return mine == value


def checkpoint_model(model: dict, init_from: Any, where: str) -> dict:
    """The ``model:`` section ``model`` (a mapping, its short forms long) with the sizes and
    the family of ``init_from``'s Llama, Mixtral or Qwen2 (kind gpt); a size the section sets
    to another value than the checkpoint's is refused.

    Args:
      model: the section as read (plain data).
      init_from: the checkpoint's directory.
      where: the config's file, for the messages.

    Returns:
      The section, a new mapping, with the checkpoint's sizes, ``kind: gpt`` and its family.

    Raises:
      ValueError: naming ``init_from`` and the key, with the fix.
    """
    from replicator.models import hf
    from replicator.models.families import FAMILIES

    where = f"{where}: init_from={init_from!r}"
    if not isinstance(init_from, str) or not init_from:
        raise ValueError(
            f"{where} must be a directory (a Hugging Face Llama, Mixtral or Qwen2 checkpoint)."
        )
    try:
        hf_config = hf.read_config(init_from)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {str(e).splitlines()[0]}") from None
    size_key = FAMILIES[hf_config["model_type"]].size_key  # Qwen3-MoE's num_experts, ...
    sizes = {key: hf_config.get(size_key(name)) for key, name in CHECKPOINT_SIZES.items()}
    sizes = {key: value for key, value in sizes.items() if value is not None}
    for key, value in sizes.items():
        mine = model.get(key, DEFAULTS[key])
        if not _same(mine, DEFAULTS[key]) and not _same(mine, value):
            raise ValueError(
                f"{where}: model.{key}={mine!r}, but the checkpoint's config.json has "
                f"{size_key(CHECKPOINT_SIZES[key])}={value!r}; remove model.{key} (the checkpoint "
                f"sets it)."
            )
    kind, family = model.get("kind", "gpt"), model.get("family", "gpt")
    if kind != "gpt":
        raise ValueError(
            f"{where}: model.kind={kind!r}; init_from loads a Llama, Mixtral or Qwen2 (kind: "
            f"llama)."
        )
    found = hf_config.get("model_type", "llama")
    if family not in ("gpt", "llama", found):
        raise ValueError(
            f"{where}: model.family={family!r}, but the checkpoint's config.json has "
            f"model_type={found!r}; remove model.family (the checkpoint sets it)."
        )
    if model.get("experts") and "experts" not in sizes:
        raise ValueError(
            f"{where}: model.experts={model['experts']}, but the checkpoint is a dense Llama (its "
            f"config.json has no num_local_experts); remove model.experts, or start from a "
            f"Mixtral checkpoint."
        )
    return model | sizes | {"kind": "gpt", "family": found}
