"""What `save` writes of a tree: every Hugging Face tensor its leaves hold (`Entry`: a layer,
or a layer's expert, of a stacked leaf), in Hugging Face's order, its family (told by its
leaves, or by the config's ``model_type``), and its ``config.json``."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from replicator.models.families import FAMILIES, Family, family, mixtral
from replicator.models.hf import files
from replicator.models.hf.leaves import describe, dict_keys

PyTree = Any
_DROPPED = {"rope_parameters", "dtype", "transformers_version", "_name_or_path"}
_ROUTER = mixtral.ROUTER
_MIXTRAL = mixtral.MIXTRAL.layer_names


class Entry(NamedTuple):
    name: str  # the Hugging Face tensor
    value: Any  # our leaf
    layer: tuple[int, ...]  # its position on the leaf's leading axes (layers, then expert)
    transposed: bool
    dtype: np.dtype  # written as
    shape: tuple[int, ...]  # written as
    where: str  # our leaf, for messages

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _found(params: PyTree, dtype: Any) -> tuple[dict[str, Entry], int, int, bool]:
    """Every Hugging Face tensor of ``params`` by name, the number of layers and of experts
    (0 without) their leaves hold, and whether they are a Mixtral's (a leaf in ``blocks.moe``)."""
    found: dict[str, Entry] = {}
    moe = False
    layer_counts, expert_counts = set(), {}  # experts: each number -> a leaf that holds it
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape = tuple(np.shape(value))
        leaf = describe(path, len(shape), "hf.save")
        moe |= dict_keys(path)[1:] in _MIXTRAL
        lead, own = shape[: leaf.lead], shape[leaf.lead :]
        out = jnp.dtype(dtype if dtype is not None else value.dtype)
        if out not in files.CODES:
            raise ValueError(
                f"hf.save: {leaf.where} would be written as {out}; pass dtype= one of "
                f"float32, bfloat16, float16, float64."
            )
        layers = math.prod(lead[:-1] if leaf.experts else lead)
        if lead:
            layer_counts.add(layers)
        if leaf.experts or leaf.name.endswith(_ROUTER.removeprefix("model.layers.0")):
            expert_counts.setdefault(lead[-1] if leaf.experts else own[-1], leaf.where)
        for i, name in enumerate(leaf.names(layers, lead[-1] if leaf.experts else 1)):
            layer = tuple(int(j) for j in np.unravel_index(i, lead)) if lead else ()
            own_hf = own[::-1] if leaf.transposed else own
            found[name] = Entry(name, value, layer, leaf.transposed, out, own_hf, leaf.where)
    if len(layer_counts) > 1:
        raise ValueError(
            f"hf.save: the blocks' leaves hold different numbers of layers "
            f"({sorted(layer_counts)}); every leaf of params['blocks'] stacks the same layers."
        )
    if len(expert_counts) > 1:
        held = ", ".join(f"{where} {n}" for n, where in expert_counts.items())
        raise ValueError(
            f"hf.save: the Mixtral leaves hold different numbers of experts ({held}); the "
            f"router [layers, d, E] and the experts' gate, up and down [layers, E, ...] hold "
            f"the same E."
        )
    layers = layer_counts.pop() if layer_counts else 0
    return found, layers, next(iter(expert_counts), 0), moe


def _biased(names: dict | set) -> frozenset[str]:
    """The linear leaves (``q``, ..., ``down``) whose layer-0 bias is among ``names``."""
    return frozenset(
        leaf.removesuffix("_bias")
        for (_, leaf), (name, _) in family.BIAS_NAMES.items()
        if f"model.layers.0.{name}" in names
    )


def _family(found: dict[str, Entry], experts: bool, config: dict) -> Family:
    """The family of a tree with the tensors ``found`` (``experts``: a Mixtral's leaves): the
    config's ``model_type``, checked against the tree, or else the first family (in
    `FAMILIES`' order) whose model has the tree's biases."""
    biased = _biased(found)
    kind = config.get("model_type")
    if experts:
        chosen = mixtral.MIXTRAL
    elif isinstance(kind, str) and kind in FAMILIES and not FAMILIES[kind].experts:
        chosen = FAMILIES[kind]
    else:
        fits = [f for f in FAMILIES.values() if not f.experts and f.bias_keys(biased) is not None]
        chosen = fits[0] if fits else FAMILIES["llama"]
    if kind not in (None, chosen.model_type):
        raise ValueError(
            f"hf.save: config has model_type={kind!r}, but params are a {chosen.name}'s tree "
            f"({'blocks.moe' if experts else 'blocks.mlp'}). Pass the config of the model these "
            f"parameters belong to."
        )
    if not experts and chosen.bias_keys(biased) is None:
        have = ", ".join(sorted(biased)) or "none"
        raise ValueError(
            f"hf.save: params have biases on {have} of the linear layers, which a "
            f"{chosen.name} does not: {_BIASES.get(chosen.model_type, 'it has none')}."
        )
    return chosen


_BIASES = {  # what each family's biases are, for messages
    "llama": (
        "Llama has biases in all of attention's linears (q, k, v, out) or none, and the same "
        "for the MLP's (gate, up, down)"
    ),
    "qwen2": "Qwen2 has biases on q, k and v (and none on out or the MLP)",
}


def entries(params: PyTree, dtype: Any, config: dict) -> tuple[Family, list[Entry]]:
    """The family of ``params`` and every Hugging Face tensor they hold, in Hugging Face's
    order: a Mixtral's if ``params`` have a Mixtral leaf (``blocks.moe``), else the family
    `_family` tells."""
    found, layers, experts, moe = _found(params, dtype)
    chosen = _family(found, moe, config)
    names = [name for name, _ in chosen.layer_names.values()]
    suffixes = [
        suffix.format(j=j)
        for suffix in names
        if not suffix.endswith(".bias") or f"model.layers.0.{suffix}" in found
        for j in range(experts if "{j}" in suffix else 1)
    ]
    order = ["model.embed_tokens.weight"]
    order += [f"model.layers.{i}.{suffix}" for i in range(layers) for suffix in suffixes]
    order += ["model.norm.weight"] + ["lm_head.weight"] * ("lm_head.weight" in found)
    missing = [name for name in order if name not in found]
    extra = sorted(set(found) - set(order))
    if extra and moe:
        raise ValueError(
            f"hf.save: params have {extra[0]}, which a Mixtral does not: its blocks are "
            f"blocks.moe (ln1, attn q/k/v/out, ln2, moe router/gate/up/down), without biases "
            f"or a Llama MLP."
        )
    assert not extra, extra  # a bias of the family's names, or a leaf describe refused
    if missing or not layers:
        tree = "blocks.moe (ln1, attn q/k/v/out, ln2, moe router/gate/up/down)" * moe
        raise ValueError(
            f"hf.save: params lack the leaves for {', '.join(missing[:4]) or 'the blocks'}"
            f"{' and more' * (len(missing) > 4)}; a {chosen.name} tree has "
            f"embed.tokens, {tree or 'blocks (ln1, attn q/k/v/out, ln2, mlp gate/up/down)'} "
            f"and head.norm (module docstring)."
        )
    return chosen, [found[name] for name in order]


def _sizes(config: dict, by_name: dict[str, Entry], moe: bool) -> dict:
    """The sizes ``config.json`` gives, from the tensors ``by_name`` (and ``config``'s numbers
    of heads and of experts per token, which they cannot tell), checked against ``config``."""
    v, d = by_name["model.embed_tokens.weight"].shape
    q, k = (by_name[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0] for x in "qk")
    heads = config.get("num_attention_heads")
    if not heads:
        raise ValueError(
            "hf.save: config lacks num_attention_heads, which the shapes cannot tell (they give "
            "heads * head_dim); pass config={'num_attention_heads': ..., ...}."
        )
    head_dim = config.get("head_dim") or q // heads
    mlp = "block_sparse_moe.experts.0.w1" if moe else "mlp.up_proj"
    sizes = {
        "vocab_size": v,
        "hidden_size": d,
        "intermediate_size": by_name[f"model.layers.0.{mlp}.weight"].shape[0],
        "num_hidden_layers": sum(
            e.name.endswith("input_layernorm.weight") for e in by_name.values()
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": k // head_dim,
        "head_dim": head_dim,
        "tie_word_embeddings": "lm_head.weight" not in by_name,
    }
    if moe:
        sizes |= _expert_sizes(config, by_name)
    wrong = {key: (config[key], value) for key, value in sizes.items() if key in config}
    wrong = {key: pair for key, pair in wrong.items() if pair[0] is not None and pair[0] != pair[1]}
    if q != heads * head_dim or k % head_dim or wrong:
        raise ValueError(
            f"hf.save: config does not match params: q has {q} columns and k {k} for "
            f"num_attention_heads={heads}, head_dim={head_dim}; config (given, from params): "
            f"{wrong}. Pass the config of the model these parameters belong to."
        )
    return sizes


def _expert_sizes(config: dict, by_name: dict[str, Entry]) -> dict:
    """A Mixtral's ``num_local_experts`` (the params') and ``num_experts_per_tok`` (the
    config's), checked against each other and the config."""
    experts, given = by_name[_ROUTER].shape[0], config.get("num_local_experts")
    if given is not None and given != experts:
        leaf = by_name["model.layers.0.block_sparse_moe.experts.0.w1.weight"].where
        raise ValueError(
            f"hf.save: {leaf} holds {experts} experts (as does {by_name[_ROUTER].where}), but "
            f"config has num_local_experts={given}. Pass the config of the model these "
            f"parameters belong to."
        )
    top_k = config.get("num_experts_per_tok")
    if not top_k or not 0 < top_k <= experts:
        raise ValueError(
            f"hf.save: config has num_experts_per_tok={top_k!r}, which the shapes cannot tell "
            f"(each token's experts, at most the {experts} experts); pass "
            f"config={{'num_experts_per_tok': ..., ...}}, e.g. 2 as Mixtral 8x7B."
        )
    return {"num_local_experts": experts, "num_experts_per_tok": top_k}


def config_json(config: dict, chosen: Family, entries: list[Entry]) -> dict:
    """The ``config.json`` of ``entries`` (a ``chosen`` family's tensors): the family and the
    sizes they give, and ``config``'s other settings."""
    by_name = {e.name: e for e in entries}
    sizes = _sizes(config, by_name, chosen.experts)
    dtypes: dict[np.dtype, int] = {}
    for e in entries:  # the dtype of most of the bytes, for a mixed tree
        dtypes[e.dtype] = dtypes.get(e.dtype, 0) + e.nbytes
    kept = {key: value for key, value in config.items() if key not in _DROPPED}
    biased = _biased(by_name)
    kind = {"architectures": [chosen.architecture], "model_type": chosen.model_type}
    kind |= {"hidden_act": "silu"} | chosen.bias_keys(biased)
    torch_dtype = {"torch_dtype": str(max(dtypes, key=dtypes.__getitem__))}
    return dict(chosen.defaults) | kept | sizes | kind | torch_dtype
