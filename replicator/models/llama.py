"""Llama-family decoders (Llama, Mixtral, Qwen2): `replicator.models.gpt` with Llama's options.

The families are listed in `replicator.models.families`. Their options: RMSNorm, rotary
positions (Llama 3's rescaling too), a SwiGLU MLP, grouped-query attention with separate ``q``,
``k``, ``v`` matrices, no biases, and optionally a head tied to the token table. So they share
the GPT's parallel machinery: `gpt.place`, `gpt.place_pipeline`, `gpt.pipeline_value_and_grad`,
ZeRO-3 and the ``context`` axis.

`config` builds such a `gpt.GPTConfig` (`replicator.models.hf.decoder_config` reads one from a
Hugging Face ``config.json``); `params_from_state_dict` and
`state_dict_from_params` convert between transformers' parameter names (``model.layers.0.
self_attn.q_proj.weight``, ``[out, in]``) and `gpt.init`'s tree (``[in, out]``, the layers
stacked).

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
from replicator.models import gpt
from replicator.models.families import family, mixtral

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
    >>> c.norm, c.position, c.mlp, c.num_kv_heads, c.bias
    ('rms', 'rope', 'swiglu', 8, False)
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


def _check(config: gpt.GPTConfig, api: str) -> None:
    llama = (config.norm, config.position, config.mlp) == ("rms", "rope", "swiglu")
    biased_experts = config.num_experts and (config.bias or config.qkv_bias)
    if not llama or config.num_kv_heads is None or config.moe_every != 1 or biased_experts:
        raise ValueError(
            f"{api}: config is not a Llama's, a Mixtral's or a Qwen2's (norm='rms', "
            f"position='rope', mlp='swiglu', num_kv_heads set, and with experts moe_every=1 and "
            f"bias=False: a Mixtral has no biases, nor qkv_bias); build it with llama.config or "
            f"hf.decoder_config."
        )


def _biases(config: gpt.GPTConfig) -> frozenset[str]:
    """The linear leaves of ``config``'s blocks that have biases (`gpt.GPTConfig.has_bias`)."""
    return frozenset(filter(config.has_bias, family.ATTENTION + family.MLP))


class _Name(NamedTuple):
    keys: tuple[str, ...]  # our leaf's dict keys from the root
    index: tuple[int, ...]  # its entry on the leaf's leading axes (layer, expert)
    name: str  # transformers' tensor
    transposed: bool


def _names(config: gpt.GPTConfig) -> list[_Name]:
    """Every transformers tensor of ``config``'s model and where it sits in `gpt.init`'s tree
    (the names of the files: per-expert ``block_sparse_moe.experts.{j}`` for a Mixtral)."""
    if config.num_experts:
        layer, experts = mixtral.LAYER, mixtral.EXPERT_NAMES
    else:
        layer = family.LAYER_NAMES | family.biased_names(_biases(config))
        experts = {}
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
        for k, (n, t) in family.OUTER_NAMES.items()
        if k != ("head", "w") or not tied
    ]
    return out


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (any dtype, device): fp32 on the host
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32)


def _unfused(state_dict: Mapping[str, Any], config: gpt.GPTConfig) -> Mapping[str, Any]:
    """transformers 5's in-memory Mixtral experts (``mlp.experts.gate_up_proj`` ``[E, 2F, D]``,
    ``mlp.experts.down_proj`` ``[E, D, F]``, ``mlp.gate.weight``) as the files' per-expert
    ``block_sparse_moe`` tensors; any other state dict as it is."""
    if not config.num_experts or "model.layers.0.mlp.experts.gate_up_proj" not in state_dict:
        return state_dict
    out, f = dict(state_dict), config.hidden
    for i in range(config.num_layers):
        old, new = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        gate_up, down = (
            _numpy(out.pop(old + f"experts.{x}")) for x in ("gate_up_proj", "down_proj")
        )
        out[new + "gate.weight"] = out.pop(old + "gate.weight")
        for j in range(config.num_experts):
            w = {"w1": gate_up[j, :f], "w3": gate_up[j, f:], "w2": down[j]}
            out |= {f"{new}experts.{j}.{k}.weight": v for k, v in w.items()}
    return out


def params_from_state_dict(state_dict: Mapping[str, Any], *, config: gpt.GPTConfig) -> dict:
    """`gpt.init`'s tree (fp32 NumPy) from transformers' Llama-family parameters.

    Weights are transposed to ``[in, out]`` (``q``'s columns stay head-major), and the layers
    (and a Mixtral's experts) stacked.

    Args:
      state_dict: ``LlamaForCausalLM.state_dict()`` (torch tensors), or a safetensors file's
        arrays. A Mixtral's experts may come as the files hold them (``block_sparse_moe.
        experts.{j}.w1``, ``w2``, ``w3``) or as transformers 5 holds them in memory
        (``mlp.experts.gate_up_proj``, ``down_proj``).
      config: the model's `gpt.GPTConfig` (`hf.decoder_config`'s).

    Returns:
      `gpt.init`'s tree, fp32 NumPy.

    Raises:
      ValueError: if ``config`` is not a Llama-family one, or a name is missing, or left over
        (except ``lm_head.weight`` for a tied head, which is the token table), or a tensor's
        shape is not the config's.
    """
    _check(config, "llama.params_from_state_dict")
    state_dict, names = _unfused(state_dict, config), _names(config)
    missing = sorted(n.name for n in names if n.name not in state_dict)
    extra = set(state_dict) - {n.name for n in names}
    extra -= {"lm_head.weight"} if config.tie_embeddings else set()
    if missing or extra:
        raise ValueError(
            f"llama.params_from_state_dict: the state dict does not match config (a "
            f"{config.num_layers}-layer {'Mixtral' if config.num_experts else 'Llama'}, bias="
            f"{config.bias}, tie_embeddings={config.tie_embeddings}): missing {missing[:4]}, "
            f"unexpected {sorted(extra)[:4]}."
        )
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    params = jax.tree.map(lambda s: np.empty(s.shape, np.float32), shapes)
    for n in names:
        value, leaf = _numpy(state_dict[n.name]), _at(params, n.keys)
        want = leaf.shape[len(n.index) :][:: -1 if n.transposed else 1]
        if value.shape != want:
            raise ValueError(
                f"llama.params_from_state_dict: {n.name} is {list(value.shape)}; config's sizes "
                f"give {list(want)} (transformers' [out, in] layout)."
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


def state_dict_from_params(params: PyTree, *, config: gpt.GPTConfig) -> dict[str, np.ndarray]:
    """transformers' names and ``[out, in]`` layout of `gpt.init`'s tree.

    The inverse of `params_from_state_dict`.

    Args:
      params: `gpt.init`'s tree, or its gradients.
      config: the model's `gpt.GPTConfig`.

    Returns:
      ``{name: fp32 NumPy array}``, without ``lm_head.weight`` for a tied head, and a
      Mixtral's experts named as its files name them (``block_sparse_moe.experts.{j}.w1``...;
      ``MixtralForCausalLM.from_pretrained`` reads those).

    Raises:
      ValueError: if ``config`` is not a Llama-family one.
    """
    _check(config, "llama.state_dict_from_params")
    out = {}
    for n in _names(config):
        value = _numpy(_at(params, n.keys))[n.index]
        out[n.name] = value.T if n.transposed else value
    return out


def _at(tree: PyTree, keys: tuple) -> Any:
    for key in keys:
        tree = tree[key]
    return tree


__getattr__ = _moved_names(
    "replicator.models.llama", {"from_hf_config": "replicator.models.hf.decoder_config"}
)  # moved: one release
