"""The model families Hugging Face checkpoints are read as and written as (`Family`): one
module each, listed in `FAMILIES`."""

from __future__ import annotations

from replicator.models.families.family import Family as Family
from replicator.models.families.llama import LLAMA
from replicator.models.families.mixtral import MIXTRAL
from replicator.models.families.qwen2 import QWEN2

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MIXTRAL, QWEN2)}
"""Each family by ``config.json``'s ``model_type``; a new family is one line here."""


def names() -> str:
    """The families for messages: ``'llama' (LlamaForCausalLM), ...``."""
    return ", ".join(f"{t!r} ({f.architecture})" for t, f in FAMILIES.items())


def defaults() -> dict:
    """Every family's defaults in one dict (the first family's where two differ), for the
    examples of messages."""
    return {k: v for f in reversed(FAMILIES.values()) for k, v in f.defaults.items()}
