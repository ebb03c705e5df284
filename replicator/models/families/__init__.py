"""The model families Hugging Face checkpoints are read and written as.

Each family is a `Family`, in a module of its own, listed in `FAMILIES`.
"""

from __future__ import annotations

from replicator.models.families.family import Family as Family
from replicator.models.families.gemma2 import GEMMA2
from replicator.models.families.gemma3 import GEMMA3
from replicator.models.families.llama import LLAMA
from replicator.models.families.mistral import MISTRAL
from replicator.models.families.mixtral import MIXTRAL
from replicator.models.families.qwen2 import QWEN2
from replicator.models.families.qwen3 import QWEN3
from replicator.models.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (LLAMA, MIXTRAL, QWEN2, GEMMA2, GEMMA3, QWEN3, QWEN3_MOE, MISTRAL)
}
"""Each family by ``config.json``'s ``model_type``; a new family is one line here."""


def names() -> str:
    """The families for messages: ``'llama' (LlamaForCausalLM), ...``."""
    return ", ".join(f"{t!r} ({f.architecture})" for t, f in FAMILIES.items())


def defaults() -> dict:
    """Every family's defaults in one dict, for the examples of messages.

    Where two families differ, the first family's value is kept.
    """
    return {k: v for f in reversed(FAMILIES.values()) for k, v in f.defaults.items()}
