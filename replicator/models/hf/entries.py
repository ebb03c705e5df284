"""What `save` writes of a tree: every Hugging Face tensor its leaves hold (`Entry`: a layer,
or a layer's expert, of a stacked leaf), in Hugging Face's order, its family (told by its
leaves, and the config's ``model_type``), named as that family's record names them, and its
``config.json``."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from replicator.models.families import FAMILIES, Family
from replicator.models.hf import files
from replicator.models.hf.leaves import STACKED, describe, dict_keys, outline

PyTree = Any
_DROPPED = {"rope_parameters", "dtype", "transformers_version", "_name_or_path"}


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


def _found(flat: list, dtype: Any, chosen: Family) -> tuple[dict[str, Entry], int, int]:
    """Every Hugging Face tensor of the leaves ``flat`` (paths and values of a ``chosen``
    family's tree) by name, and the number of layers and of experts (0 without) they hold."""
    found: dict[str, Entry] = {}
    layer_counts, expert_counts = set(), {}  # experts: each number -> a leaf that holds it
    for path, value in flat:
        shape = tuple(np.shape(value))
        leaf = describe(path, len(shape), "hf.save", chosen)
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
        if leaf.experts or dict_keys(path)[-1] == "router":  # the router: [layers, d, E]
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
            f"hf.save: the {chosen.name} leaves hold different numbers of experts ({held}); "
            f"the router [layers, d, E] and the experts' gate, up and down [layers, E, ...] "
            f"hold the same E."
        )
    layers = layer_counts.pop() if layer_counts else 0
    return found, layers, next(iter(expert_counts), 0)


def _biased(chosen: Family, names: dict | set) -> frozenset[str]:
    """The linear leaves (``q``, ..., ``down``) whose layer-0 bias, as ``chosen`` names it, is
    among ``names``."""
    return frozenset(
        keys[-1].removesuffix("_bias")
        for keys, (name, _) in chosen.layer_names.items()
        if keys[-1].endswith("_bias") and f"model.layers.0.{name}" in names
    )


def _own_leaves(family: Family) -> set[tuple[str, ...]]:
    """The block leaves ``family`` names, biases aside."""
    return {keys for keys in family.layer_names if not keys[-1].endswith("_bias")}


def _family(paths: list[tuple[str, ...]], config: dict) -> Family:
    """The family of a tree whose leaves have the dict keys ``paths``: of the families that
    name the most of its leaves (biases aside), and of those the ones naming fewest leaves it
    lacks, the config's ``model_type``'s, or else the
    first (in `FAMILIES`' order) whose model has the tree's biases; checked against both."""
    plain = [keys for keys in paths if not keys[-1].endswith("_bias")]
    named = {t: sum(_names(keys, f) for keys in plain) for t, f in FAMILIES.items()}
    most = [t for t, n in named.items() if n == max(named.values())]
    # of those, the ones with no leaf the tree lacks (Qwen3's tree is Gemma 3's less its norms)
    tree = {keys[1:] for keys in plain if keys[:1] and keys[0] in STACKED}
    lacks = {t: len(_own_leaves(FAMILIES[t]) - tree) for t in most}
    fits = [FAMILIES[t] for t in most if lacks[t] == min(lacks.values())]
    biased = frozenset(
        keys[-1].removesuffix("_bias")
        for keys in paths
        if keys[:1] and keys[0] in STACKED and keys[-1].endswith("_bias")
    )
    kind = config.get("model_type")
    if isinstance(kind, str) and kind in FAMILIES and FAMILIES[kind] in fits:
        chosen = FAMILIES[kind]
    else:
        chosen = next((f for f in fits if f.bias_keys(biased) is not None), fits[0])
    if kind not in (None, chosen.model_type):
        raise ValueError(
            f"hf.save: config has model_type={kind!r}, but params are a {chosen.name}'s tree "
            f"({outline(chosen)}). Pass the config of the model these parameters belong to."
        )
    if chosen.bias_keys(biased) is None:
        have = ", ".join(sorted(biased)) or "none"
        raise ValueError(
            f"hf.save: params have biases on {have} of the linear layers, which a "
            f"{chosen.name} does not: {chosen.bias_rule or 'it has none'}."
        )
    return chosen


def _names(keys: tuple[str, ...], family: Family) -> bool:
    """Whether ``family`` names our leaf ``keys``."""
    stacked = keys[:1] and keys[0] in STACKED and keys[1:] in family.layer_names
    return keys in family.outer_names or bool(stacked)


def entries(params: PyTree, dtype: Any, config: dict) -> tuple[Family, list[Entry]]:
    """The family of ``params`` (`_family`) and every Hugging Face tensor they hold, in
    Hugging Face's order."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    chosen = _family([dict_keys(path) for path, _ in flat], config)
    found, layers, experts = _found(flat, dtype, chosen)
    names = [name for name, _ in chosen.layer_names.values()]
    suffixes = [
        suffix.format(j=j)
        for suffix in names
        if not suffix.endswith(".bias") or f"model.layers.0.{suffix}" in found
        for j in range(experts if "{j}" in suffix else 1)
    ]
    top = [n for keys, (n, _) in chosen.outer_names.items() if keys != ("head", "w") or n in found]
    order = top[:1] + [f"model.layers.{i}.{suffix}" for i in range(layers) for suffix in suffixes]
    order += top[1:]
    missing = [name for name in order if name not in found]
    assert not set(found) - set(order), sorted(set(found) - set(order))  # all described
    if missing or not layers:
        raise ValueError(
            f"hf.save: params lack the leaves for {', '.join(missing[:4]) or 'the blocks'}"
            f"{' and more' * (len(missing) > 4)}; a {chosen.name} tree has "
            f"embed.tokens, {outline(chosen)} and head.norm (module docstring)."
        )
    return chosen, [found[name] for name in order]


def _first(chosen: Family, leaf: str) -> str:
    """The tensor of layer 0 (and expert 0) of ``chosen``'s block leaf ``...leaf``."""
    name = next(n for keys, (n, _) in chosen.layer_names.items() if keys[-1] == leaf)
    return "model.layers.0." + name.format(j=0)


def _sizes(config: dict, by_name: dict[str, Entry], chosen: Family) -> dict:
    """The sizes ``config.json`` gives, from the tensors ``by_name`` (and ``config``'s numbers
    of heads and of experts per token, which they cannot tell), checked against ``config``."""
    embed = chosen.outer_names[("embed", "tokens")][0]
    v, d = by_name[embed].shape
    q, k = (by_name[_first(chosen, x)].shape[0] for x in "qk")
    heads = config.get("num_attention_heads")
    if not heads:
        raise ValueError(
            "hf.save: config lacks num_attention_heads, which the shapes cannot tell (they give "
            "heads * head_dim); pass config={'num_attention_heads': ..., ...}."
        )
    head_dim = config.get("head_dim") or q // heads
    mlp = _first(chosen, "gate" if chosen.experts else "up")
    sizes = {
        "vocab_size": v,
        "hidden_size": d,
        chosen.size_key("intermediate_size"): by_name[mlp].shape[0],
        "num_hidden_layers": len(
            {name.split(".")[2] for name in by_name if name.startswith("model.layers.")}
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": k // head_dim,
        "head_dim": head_dim,
        "tie_word_embeddings": chosen.outer_names[("head", "w")][0] not in by_name,
    }
    if chosen.experts:
        sizes |= _expert_sizes(config, by_name, chosen)
    wrong = {key: (config[key], value) for key, value in sizes.items() if key in config}
    wrong = {key: pair for key, pair in wrong.items() if pair[0] is not None and pair[0] != pair[1]}
    if q != heads * head_dim or k % head_dim or wrong:
        raise ValueError(
            f"hf.save: config does not match params: q has {q} columns and k {k} for "
            f"num_attention_heads={heads}, head_dim={head_dim}; config (given, from params): "
            f"{wrong}. Pass the config of the model these parameters belong to."
        )
    return sizes


def _expert_sizes(config: dict, by_name: dict[str, Entry], chosen: Family) -> dict:
    """The experts' ``num_local_experts`` (the params') and ``num_experts_per_tok`` (the
    config's), checked against each other and the config."""
    router = by_name[_first(chosen, "router")]
    key = chosen.experts_key
    experts, given = router.shape[0], config.get(key)
    if given is not None and given != experts:
        leaf = by_name[_first(chosen, "gate")].where
        raise ValueError(
            f"hf.save: {leaf} holds {experts} experts (as does {router.where}), but "
            f"config has {key}={given}. Pass the config of the model these "
            f"parameters belong to."
        )
    top_k = config.get("num_experts_per_tok")
    if not top_k or not 0 < top_k <= experts:
        raise ValueError(
            f"hf.save: config has num_experts_per_tok={top_k!r}, which the shapes cannot tell "
            f"(each token's experts, at most the {experts} experts); pass "
            f"config={{'num_experts_per_tok': ..., ...}}, e.g. 2 as Mixtral 8x7B."
        )
    return {key: experts, "num_experts_per_tok": top_k}


def config_json(config: dict, chosen: Family, entries: list[Entry]) -> dict:
    """The ``config.json`` of ``entries`` (a ``chosen`` family's tensors): the family and the
    sizes they give, and ``config``'s other settings."""
    by_name = {e.name: e for e in entries}
    sizes = _sizes(config, by_name, chosen)
    dtypes: dict[np.dtype, int] = {}
    for e in entries:  # the dtype of most of the bytes, for a mixed tree
        dtypes[e.dtype] = dtypes.get(e.dtype, 0) + e.nbytes
    kept = {key: value for key, value in config.items() if key not in _DROPPED}
    biased = _biased(chosen, by_name)
    kind = {"architectures": [chosen.architecture], "model_type": chosen.model_type}
    given = {"hidden_act", "hidden_activation"} & (set(config) | set(chosen.defaults))
    activation = {} if given else {"hidden_act": "silu"}  # Llama's, which its defaults omit
    kind |= activation | chosen.bias_keys(biased)
    torch_dtype = {"torch_dtype": str(max(dtypes, key=dtypes.__getitem__))}
    return dict(chosen.defaults) | kept | sizes | kind | torch_dtype
