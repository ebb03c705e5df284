"""What a model family is to Hugging Face: its ``config.json`` (``model_type``, the
architecture, transformers' defaults for the keys a file omits, the sizes it requires), the
names of its tensors, which of the decoder's linear layers have biases, and the `GPTConfig`
options it maps to.

Every family here is the one decoder of `replicator.models.gpt` with options: Llama's RMSNorm,
rotary positions, SwiGLU MLP and grouped-query attention, and what a family changes on top
(Mixtral's experts, Qwen2's query/key/value biases). Adding one is a `Family` in a module of
its own and a line in `replicator.models.families.FAMILIES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

ATTENTION = ("q", "k", "v", "out")  # the attention's linear leaves
MLP = ("gate", "up", "down")  # the SwiGLU MLP's
QKV = frozenset({"q", "k", "v"})

OUTER_NAMES = {  # (our leaf) -> (transformers' name, transposed), outside the blocks
    ("embed", "tokens"): ("model.embed_tokens.weight", False),
    ("head", "norm", "scale"): ("model.norm.weight", False),
    ("head", "w"): ("lm_head.weight", True),
}
LAYER_NAMES = {  # (our block's leaf) -> (transformers' name in layer {i}, transposed)
    ("ln1", "scale"): ("input_layernorm.weight", False),
    ("attn", "q"): ("self_attn.q_proj.weight", True),
    ("attn", "k"): ("self_attn.k_proj.weight", True),
    ("attn", "v"): ("self_attn.v_proj.weight", True),
    ("attn", "out"): ("self_attn.o_proj.weight", True),
    ("ln2", "scale"): ("post_attention_layernorm.weight", False),
    ("mlp", "gate"): ("mlp.gate_proj.weight", True),
    ("mlp", "up"): ("mlp.up_proj.weight", True),
    ("mlp", "down"): ("mlp.down_proj.weight", True),
}
BIAS_NAMES = {  # each linear leaf's bias, ``{leaf}_bias`` (``[out]``) -> ``..._proj.bias``
    (group, f"{leaf}_bias"): (name.removesuffix("weight") + "bias", False)
    for (group, leaf), (name, transposed) in LAYER_NAMES.items()
    if transposed
}
NO_BIASES: frozenset[str] = frozenset()
Unfuse = Callable[[Mapping[str, Any], int, int, int], Mapping[str, Any]]
"""A `Family`'s ``unfuse``: ``(state_dict, num_layers, num_experts, expert_hidden)``."""


def biased_names(biases: frozenset[str]) -> dict:
    """`BIAS_NAMES` of the linear leaves in ``biases`` (e.g. `QKV`)."""
    return {keys: name for keys, name in BIAS_NAMES.items() if keys[1][:-5] in biases}


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's ``config.json`` and names.

    Attributes:
      model_type: ``config.json``'s ``model_type`` (``"llama"``).
      architecture: transformers' class (``"LlamaForCausalLM"``), written by ``hf.save``.
      defaults: transformers' config class's defaults, for keys a ``config.json`` omits.
      layer_names: each block leaf's tensor, ``(keys) -> (name after model.layers.{i}.,
        transposed)``, biases included (``{j}`` for an expert's).
      biases: the linear leaves (`ATTENTION`, `MLP`) with biases in the model a checked
        ``config.json`` describes.
      bias_keys: the ``config.json`` keys that give a model those biases, or None where the
        family has no such model (``hf.save`` tells a family by its tree).
      options: the `GPTConfig` fields of a ``config.json`` besides the decoder's sizes and
        rotary positions (biases, experts), given the ``seq_len`` trained at; raises
        ``ValueError`` for what the decoder does not compute.
      required: sizes the family requires besides every family's.
      experts: whether every block is a mixture of experts (``blocks.moe``).
      outer_names: each leaf's tensor outside the blocks, ``(keys) -> (name, transposed)``,
        the token table first; ``head.w`` is left out of a checkpoint that ties it.
      bias_rule: the biases of the family's models in words, for messages ("" for none).
      experts_key, expert_hidden_key: the ``config.json`` keys of the number of experts and
        of each expert's hidden width (Mixtral's ``num_local_experts`` and
        ``intermediate_size``; Qwen3-MoE's ``num_experts`` and ``moe_intermediate_size``).
      aliases: other spellings of ``config.json`` keys, ``{other: ours}`` (`canonical`).
      unfuse: ``(state_dict, num_layers, num_experts, expert_hidden) -> state_dict``, the
        tensors transformers holds in memory fused (transformers 5's experts) as the files'
        `layer_names` name them, any other state dict as it is; None where there are none.
    """

    model_type: str
    architecture: str
    defaults: Mapping[str, Any]
    layer_names: Mapping[tuple, tuple[str, bool]]
    biases: Callable[[Mapping[str, Any]], frozenset[str]]
    bias_keys: Callable[[frozenset[str]], dict | None]
    options: Callable[[Mapping[str, Any], int], dict]
    required: tuple[str, ...] = ()
    experts: bool = False
    outer_names: Mapping[tuple, tuple[str, bool]] = dataclasses.field(
        default_factory=lambda: OUTER_NAMES
    )
    bias_rule: str = ""
    unfuse: Unfuse | None = None
    experts_key: str = "num_local_experts"
    expert_hidden_key: str = "intermediate_size"
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def canonical(self, config: Mapping[str, Any]) -> dict:
        """``config`` with each key of `aliases` (``{other spelling: ours}``, such as
        transformers 5's ``num_local_experts`` for Qwen3-MoE's ``num_experts``) under ours."""
        out = dict(config)
        for other, ours in self.aliases.items():
            if out.get(ours) is None and out.get(other) is not None:
                out[ours] = out[other]
            out.pop(other, None)
        return out

    def experts_in(self, config: Mapping[str, Any]) -> int | None:
        """The number of experts ``config`` gives (None for a dense family)."""
        return config.get(self.experts_key) if self.experts else None

    def size_key(self, key: str) -> str:
        """``config.json``'s key for the size Mixtral calls ``key`` in this family."""
        if not self.experts:
            return key
        return {"num_local_experts": self.experts_key,
                "intermediate_size": self.expert_hidden_key}.get(key, key)  # fmt: skip

    @property
    def name(self) -> str:
        """``"Llama"``, for messages."""
        return self.architecture.removesuffix("ForCausalLM")

    def block_names(self, biases: frozenset[str]) -> dict[tuple, tuple[str, bool]]:
        """`layer_names` of a model whose linear leaves ``biases`` (``"q"``, ...) have biases:
        without the other leaves' ``{leaf}_bias``."""
        return {
            keys: name
            for keys, name in self.layer_names.items()
            if not keys[-1].endswith("_bias") or keys[-1].removesuffix("_bias") in biases
        }


LLAMA_BLOCK = {
    "norm": "rms",
    "position": "rope",
    "activation": "silu",
    "gated": True,
    "bias": False,
}
"""The `GPTConfig` options of Llama's block, which every family here builds on."""


def unfuse_experts(layer_names: Mapping[tuple, tuple[str, bool]]) -> Unfuse:
    """A mixture of experts family's ``unfuse``: transformers 5's in-memory experts of each
    layer (``mlp.experts.gate_up_proj`` ``[E, 2F, D]``, ``mlp.experts.down_proj``
    ``[E, D, F]``, the router ``mlp.gate.weight``) as ``layer_names`` name the leaves
    ``moe.moe.gate``, ``up``, ``down`` (per expert) and ``router`` in the files; a state dict
    without them as it is."""
    files = {leaf: layer_names[("moe", "moe", leaf)][0] for leaf in ("router", *MLP)}

    def unfuse(state_dict: Mapping[str, Any], num_layers: int, num_experts: int, hidden: int):
        if "model.layers.0.mlp.experts.gate_up_proj" not in state_dict:
            return state_dict
        out = dict(state_dict)
        for i in range(num_layers):
            layer = f"model.layers.{i}."
            gate_up, down = (
                out.pop(f"{layer}mlp.experts.{x}") for x in ("gate_up_proj", "down_proj")
            )
            out[layer + files["router"]] = out.pop(layer + "mlp.gate.weight")
            for j in range(num_experts):
                w = {"gate": gate_up[j, :hidden], "up": gate_up[j, hidden:], "down": down[j]}
                out |= {layer + files[k].format(j=j): v for k, v in w.items()}
        return out

    return unfuse


def refuse(what: str) -> ValueError:
    """A refusal of ``hf.decoder_config``, whose options the families' ``options`` are."""
    return ValueError(f"hf.decoder_config: {what}")


def check_window(hf: Mapping[str, Any], seq_len: int) -> None:
    """Refuses a sliding window shorter than ``seq_len`` (the decoder attends causally over
    the whole sequence, which a window at least as long as it computes exactly)."""
    window = hf.get("sliding_window")
    if window is not None and window < seq_len:
        raise refuse(
            f"sliding_window={window} is shorter than seq_len={seq_len}; the GPT's attention is "
            f"causal over the whole sequence. Train with seq_len <= {window}."
        )
