"""Llama-family decoders (Llama, Mixtral, Qwen2): `replicator.models.gpt` with Llama's options.

The families are listed in `replicator.models.families`. Their options: RMSNorm, rotary
positions (Llama 3's rescaling too), a SwiGLU MLP, grouped-query attention with separate ``q``,
``k``, ``v`` matrices, no biases, and optionally a head tied to the token table. So they share
the GPT's parallel machinery: `gpt.place`, `gpt.place_pipeline`, `gpt.pipeline_value_and_grad`,
ZeRO-3 and the ``context`` axis.

`config` builds such a `gpt.GPTConfig` (`replicator.models.hf.decoder_config` reads one from a
Hugging Face ``config.json``); `params_from_state_dict` and
`state_dict_from_params` convert between transformers' parameter names (``model.layers.0.
self_attn.q_proj.weight``, ``[out, in]``), as the model's family names them (its `Family`
record, ``family=``; by default the first family with the config's experts and biases), and
`gpt.init`'s tree (``[in, out]``, the layers stacked).

>>> import jax, numpy as np
>>> from replicator.models import gpt, llama
>>> config = llama.config(vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
...                       d_ff=96, seq_len=16)
>>> shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
>>> jax.tree.map(lambda a: a.shape, shapes["blocks"]["attn"])
{'k': (2, 64, 32), 'out': (2, 64, 64), 'q': (2, 64, 64), 'v': (2, 64, 32)}
>>> params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
>>> state = llama.state_dict_from_params(params, config=config)
>>> state["model.layers.1.self_attn.k_proj.weight"].shape
(32, 64)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from replicator._src.core.deprecation import moved_names as _moved_names
from replicator.models import families, gpt
from replicator.models.families import family

if TYPE_CHECKING:  # annotations only: not a name of this module
    from collections.abc import Mapping

PyTree = Any


def config(
    *,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    d_ff: int,
    num_kv_heads: int | None = None,
    **options: Any,
) -> gpt.GPTConfig:
    """A `gpt.GPTConfig` of a Llama: RMSNorm, rotary positions, SwiGLU, no biases.

    The attention has separate ``q``/``k``/``v`` matrices with ``num_kv_heads`` key/value heads.

    Args:
      vocab_size: tokens in the vocabulary.
      d_model: the model width.
      num_layers: transformer blocks.
      num_heads: query heads.
      d_ff: the MLP's hidden width.
      num_kv_heads: key/value heads; None for ``num_heads``.
      **options: other `gpt.GPTConfig` fields: ``rope_theta`` (the rotary base frequency,
        10000.0), ``rope_scaling`` (Llama 3's rescaling, a `gpt.RopeScaling`, or None),
        ``norm_eps`` (RMSNorm's epsilon, 1e-5), ``tie_embeddings`` (the output matrix is the
        token table, False), ``seq_len``, ``dtype``, ``remat``, ``attention``, ``bias``, ...

    Returns:
      The `gpt.GPTConfig`.

    >>> from replicator.models import llama
    >>> c = llama.config(vocab_size=256, d_model=64, num_layers=2, num_heads=8, d_ff=128)
    >>> c.norm, c.position, c.activation, c.gated, c.num_kv_heads, c.bias
    ('rms', 'rope', 'silu', True, 8, False)
    """
    return gpt.GPTConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        d_ff=d_ff,
        num_kv_heads=num_kv_heads or num_heads,
        **(family.LLAMA_BLOCK | options),
    )


_LLAMA_BLOCK_ONLY = {  # the GPTConfig fields of Llama's block beyond family.LLAMA_BLOCK
    "activation": "silu", "qk_norm": False, "post_norms": False, "norm_offset": 0.0,
    "scale_embeddings": False, "query_scale": None, "attn_softcap": None, "final_softcap": None,
    "attention_pattern": ("global",), "local_rope_theta": None, "normalize_top_k": True,
}  # fmt: skip


def _family(
    config: gpt.GPTConfig, family: families.Family | None, api: str = "llama"
) -> families.Family:
    """``family``, or by default the first of `FAMILIES` with ``config``'s experts (or none)
    and biases (a Llama, Mixtral or Qwen2), or else the first with its experts. The default
    is refused for a config beyond Llama's block (Gemma's norms, Qwen3's query/key norms, a
    sliding window, ...), whose tensors another family names: that family must be given."""
    if family is not None:
        return family
    beyond = {
        k: getattr(config, k) for k, v in _LLAMA_BLOCK_ONLY.items() if getattr(config, k) != v
    }
    llama_like = (config.norm, config.position, config.gated) == ("rms", "rope", True)
    if beyond and llama_like:  # else `_check` says what Llama's block is
        raise ValueError(
            f"{api}: config has {', '.join(f'{k}={v!r}' for k, v in beyond.items())}, beyond "
            f"Llama's block, so its family cannot be told from it; pass family=, e.g. "
            f"family=FAMILIES[hf_config['model_type']] (replicator.models.families)."
        )
    experts, biases = bool(config.num_experts), _biases(config)
    same = [f for f in families.FAMILIES.values() if f.experts == experts]
    return next((f for f in same if f.bias_keys(biases) is not None), same[0])


def _check(config: gpt.GPTConfig, family: families.Family, api: str) -> None:
    llama = (config.norm, config.position, config.gated) == ("rms", "rope", True)
    fits = bool(config.num_experts) == family.experts  # and the family's biases:
    fits = fits and family.bias_keys(_biases(config)) is not None
    if not llama or config.num_kv_heads is None or config.moe_every != 1 or not fits:
        moe = "num_experts > 0 and moe_every=1" if family.experts else "num_experts=0"
        rule = family.bias_rule or f"bias=False: a {family.name} has no biases, nor qkv_bias"
        raise ValueError(
            f"{api}: config is not a {family.name}'s (norm='rms', position='rope', "
            f"mlp='swiglu', num_kv_heads set, {moe}, and {rule}); build it with llama.config "
            f"or hf.decoder_config, or pass the family= of its model (FAMILIES: "
            f"{', '.join(families.FAMILIES)})."
        )


def _biases(config: gpt.GPTConfig) -> frozenset[str]:
    """The linear leaves of ``config``'s blocks that have biases (`gpt.GPTConfig.has_bias`)."""
    return frozenset(filter(config.has_bias, family.ATTENTION + family.MLP))


class _Name(NamedTuple):
    keys: tuple[str, ...]  # our leaf's dict keys from the root
    index: tuple[int, ...]  # its entry on the leaf's leading axes (layer, expert)
    name: str  # transformers' tensor
    transposed: bool


def _names(config: gpt.GPTConfig, family: families.Family) -> list[_Name]:
    """Every transformers tensor of ``config``'s model and where it sits in `gpt.init`'s tree,
    as ``family`` names them (the files' names: per-expert ``block_sparse_moe.experts.{j}``
    for a Mixtral)."""
    names = family.block_names(_biases(config))
    layer = {keys: value for keys, value in names.items() if "{j}" not in value[0]}
    experts = {keys: value for keys, value in names.items() if "{j}" in value[0]}
    out = [
        _Name(("blocks", *keys), (i,), f"model.layers.{i}.{name}", t)
        for i in range(config.num_layers)
        for keys, (name, t) in layer.items()
    ]
    out += [
        _Name(("blocks", *keys), (i, j), f"model.layers.{i}.{name.format(j=j)}", t)
        for i in range(config.num_layers)
        for keys, (name, t) in experts.items()
        for j in range(config.num_experts)
    ]
    tied = config.tie_embeddings
    out += [
        _Name(k, (), n, t)
        for k, (n, t) in family.outer_names.items()
        if k != ("head", "w") or not tied
    ]
    return out


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (any dtype, device): fp32 on the host
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32)


def files_state_dict(
    state_dict: Mapping[str, Any], *, config: gpt.GPTConfig, family: families.Family | None = None
) -> Mapping[str, Any]:
    """``state_dict`` with the names a checkpoint's files give its tensors.

    transformers 5 holds some tensors fused in memory (a Mixtral's experts: ``mlp.experts.
    gate_up_proj``, ``down_proj``); the family's ``unfuse`` splits them into the files' ones
    (``block_sparse_moe.experts.{j}.w1``, ...). Any other state dict comes back as it is.

    Args:
      state_dict: ``model.state_dict()`` (torch tensors), its gradients by name, or a
        safetensors file's arrays.
      config: the model's `gpt.GPTConfig`.
      family: the model's family; None for the first with ``config``'s experts and biases,
        as `params_from_state_dict` says.

    Returns:
      The state dict by the files' names (its tensors not copied nor converted).
    """
    family = _family(config, family, "llama.files_state_dict")
    if family.unfuse is None:
        return state_dict
    return family.unfuse(state_dict, config.num_layers, config.num_experts, config.hidden)


def params_from_state_dict(
    state_dict: Mapping[str, Any], *, config: gpt.GPTConfig, family: families.Family | None = None
) -> dict:
    """`gpt.init`'s tree (fp32 NumPy) from transformers' Llama-family parameters.

    Weights are transposed to ``[in, out]`` (``q``'s columns stay head-major), and the layers
    (and a Mixtral's experts) stacked.

    Args:
      state_dict: ``LlamaForCausalLM.state_dict()`` (torch tensors), or a safetensors file's
        arrays. A Mixtral's experts may come as the files hold them (``block_sparse_moe.
        experts.{j}.w1``, ``w2``, ``w3``) or as transformers 5 holds them in memory
        (``mlp.experts.gate_up_proj``, ``down_proj``).
      config: the model's `gpt.GPTConfig` (`hf.decoder_config`'s).
      family: the model's family (`replicator.models.families.FAMILIES`), whose names the
        state dict has; None for the first family with ``config``'s experts and biases (a
        Mixtral with experts, a Qwen2 with ``qkv_bias``, else a Llama).

    Returns:
      `gpt.init`'s tree, fp32 NumPy.

    Raises:
      ValueError: if ``config`` is not the family's, or a name is missing, or left over
        (except ``lm_head.weight`` for a tied head, which is the token table), or a tensor's
        shape is not the config's.
    """
    api = "llama.params_from_state_dict"
    family = _family(config, family, api)
    _check(config, family, api)
    state_dict = files_state_dict(state_dict, config=config, family=family)
    names = _names(config, family)
    missing = sorted(n.name for n in names if n.name not in state_dict)
    extra = set(state_dict) - {n.name for n in names}
    extra -= {"lm_head.weight"} if config.tie_embeddings else set()
    if missing or extra:
        raise ValueError(
            f"{api}: the state dict does not match config (a {config.num_layers}-layer "
            f"{family.name}, bias={config.bias}, tie_embeddings={config.tie_embeddings}): "
            f"missing {missing[:4]}, unexpected {sorted(extra)[:4]}."
        )
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    _check_leaves(shapes, names, family, api)
    params = jax.tree.map(lambda s: np.empty(s.shape, np.float32), shapes)
    for n in names:
        value, leaf = _numpy(state_dict[n.name]), _at(params, n.keys)
        want = leaf.shape[len(n.index) :][:: -1 if n.transposed else 1]
        if value.shape != want:
            raise ValueError(
                f"{api}: {n.name} is {list(value.shape)}; config's sizes give {list(want)} "
                f"(transformers' [out, in] layout)."
            )
        leaf[n.index] = value.T if n.transposed else value
    filled = {n.keys: (len(n.index), 0) for n in names}
    for n in names:
        filled[n.keys] = (len(n.index), filled[n.keys][1] + 1)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:  # none uninitialised
        keys = tuple(k.key for k in path)
        lead, count = filled.get(keys, (0, 0))
        assert count == math.prod(leaf.shape[:lead]) > 0, f"{'.'.join(keys)} is not filled"
    return params


def state_dict_from_params(
    params: PyTree, *, config: gpt.GPTConfig, family: families.Family | None = None
) -> dict[str, np.ndarray]:
    """transformers' names and ``[out, in]`` layout of `gpt.init`'s tree.

    The inverse of `params_from_state_dict`.

    Args:
      params: `gpt.init`'s tree, or its gradients.
      config: the model's `gpt.GPTConfig`.
      family: the model's family, whose names the state dict gets; None for the first
        family with ``config``'s experts and biases, as `params_from_state_dict` says.

    Returns:
      ``{name: fp32 NumPy array}``, without ``lm_head.weight`` for a tied head, and a
      Mixtral's experts named as its files name them (``block_sparse_moe.experts.{j}.w1``...;
      ``MixtralForCausalLM.from_pretrained`` reads those).

    Raises:
      ValueError: if ``config`` is not the family's, or ``params`` lack a leaf it names.
    """
    api = "llama.state_dict_from_params"
    family = _family(config, family, api)
    _check(config, family, api)
    names = _names(config, family)
    _check_leaves(params, names, family, api)  # no leaf left out of the state dict
    out = {}
    for n in names:
        value = _numpy(_at(params, n.keys))[n.index]
        out[n.name] = value.T if n.transposed else value
    return out


def _check_leaves(
    tree: PyTree, names: list[_Name], family: families.Family, api: str, *, extra: bool = True
) -> None:
    """Refuses a ``tree`` (``config``'s) that lacks a leaf ``family`` names in ``names``, or,
    with ``extra``, that has a leaf it does not name."""
    missing = sorted({n.keys for n in names if not _holds(tree, n.keys)})
    unnamed = []
    if extra:
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        keys = lambda path: tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        unnamed = sorted({keys(path) for path in paths} - {n.keys for n in names})
    if missing or unnamed:
        show = lambda keys: ", ".join(".".join(k) for k in keys[:4]) or "none"
        raise ValueError(
            f"{api}: config's tree and the {family.name} family's names differ: the tree lacks "
            f"{show(missing)}, and the family does not name {show(unnamed)}; pass the family= "
            f"of config's model (FAMILIES: {', '.join(families.FAMILIES)})."
        )


def _holds(tree: PyTree, keys: tuple) -> bool:
    try:
        _at(tree, keys)
    except (KeyError, TypeError, IndexError):
        return False
    return True


def _at(tree: PyTree, keys: tuple) -> Any:
    for key in keys:
        tree = tree[key]
    return tree


__getattr__ = _moved_names(
    "replicator.models.llama", {"from_hf_config": "replicator.models.hf.decoder_config"}
)  # moved: one release
