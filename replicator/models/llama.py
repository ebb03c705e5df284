"""Llama-family decoders (Llama, Mixtral, Qwen2): `replicator.models.gpt` with Llama's options.

The families are listed in `replicator.models.families`. Their options: RMSNorm, rotary
positions (Llama 3's rescaling too), a SwiGLU MLP, grouped-query attention with separate ``q``,
``k``, ``v`` matrices, no biases, and optionally a head tied to the token table. So they share
the GPT's parallel machinery: `gpt.place`, `gpt.place_pipeline`, `gpt.pipeline_value_and_grad`,
ZeRO-3 and the ``context`` axis.

`config` builds such a `gpt.GPTConfig`; `from_hf_config` reads transformers' ``LlamaConfig``
(``config.json``, or ``LlamaConfig.to_dict()``); `params_from_state_dict` and
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

from replicator.models import families, gpt
from replicator.models.families import FAMILIES, family, mixtral
from replicator.models.hf import config_checks, configs

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
    llama = dict(norm="rms", position="rope", mlp="swiglu", bias=False)
    return gpt.GPTConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        d_ff=d_ff,
        num_kv_heads=num_kv_heads or num_heads,
        **(llama | options),
    )


def _rope(hf: Mapping[str, Any], default: float) -> tuple[float, gpt.RopeScaling | None]:
    """``rope_theta`` and the scaling of transformers' ``rope_parameters`` (v5) or
    ``rope_theta`` and ``rope_scaling`` (v4, most ``config.json`` files)."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", default)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise family.refuse("partial_rotary_factor != 1 (rotary positions on part of a head).")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise family.refuse(
            f"rope_type={kind!r} is not implemented; 'default' and 'llama3' are (the GPT's "
            f"rotary positions with gpt.RopeScaling)."
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if rope.get(f) is None]
    if missing:  # from_hf_config checked them; a direct call may not have
        raise family.refuse(f"rope_type 'llama3' without {', '.join(missing)}; it needs {fields}.")
    return theta, gpt.RopeScaling(**{f: rope[f] for f in fields})


def _family(hf: Mapping[str, Any]) -> family.Family:
    """``hf``'s family, its values checked as `hf.read_config` checks a config.json's."""
    kind = hf.get("model_type", "llama")
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise family.refuse(
            f"model_type={kind!r}; this reads the configs of {', '.join(FAMILIES)}."
        )
    found = FAMILIES[kind]
    sizes = configs.REQUIRED + found.required
    where = "llama.from_hf_config: config"
    config_checks.check_config(dict(hf), where, sizes, families.defaults())
    return found


def from_hf_config(hf: Mapping[str, Any], **options: Any) -> gpt.GPTConfig:
    """The `gpt.GPTConfig` of transformers' ``LlamaConfig``, ``MixtralConfig`` or ``Qwen2Config``.

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
      **options: other `gpt.GPTConfig` fields (``seq_len``, ``dtype``, ...).

    Returns:
      The `gpt.GPTConfig`.

    Raises:
      ValueError: for what the GPT does not compute: a ``model_type`` of no family, a
        ``hidden_act`` other than SiLU, a ``head_dim`` other than ``hidden_size /
        num_attention_heads``, a Llama's biases in attention but not the MLP (or the reverse),
        a rotary scaling other than Llama 3's, a sliding window shorter than ``seq_len`` (a
        Mixtral's or a Qwen2's), or router jitter; and for a size missing or not a whole
        number >= 1, or a value of the wrong type or range (as ``hf.read_config`` refuses
        them).

    >>> from replicator.models import llama
    >>> c = llama.from_hf_config({"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    ...     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, seq_len=32)
    >>> c.num_kv_heads, c.rope_theta, c.seq_len, c.norm_eps
    (1, 500000.0, 32, 1e-06)
    >>> m = llama.from_hf_config({"model_type": "mixtral", "vocab_size": 128, "hidden_size": 64,
    ...     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2})
    >>> m.num_experts, m.top_k, m.capacity_factor, m.rope_theta, m.norm_eps
    (8, 2, None, 1000000.0, 1e-05)
    >>> q = llama.from_hf_config({"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64,
    ...     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "rope_theta": 1e6, "tie_word_embeddings": True})
    >>> q.qkv_bias, q.bias, q.tie_embeddings, q.seq_len
    (True, False, True, 32768)
    """
    found = _family(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise family.refuse(f"hidden_act={hf['hidden_act']!r}; the SwiGLU MLP uses 'silu'.")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    if head_dim * heads != d:
        raise family.refuse(
            f"head_dim={head_dim} with {heads} heads is not hidden_size={d} wide (q_proj.weight "
            f"would be [{head_dim * heads}, {d}]); the GPT's heads are hidden_size / "
            f"num_attention_heads = {d / heads:g} wide. If the checkpoint's q_proj.weight is "
            f"[{d}, {d}], head_dim is wrong: remove it from config.json; else the GPT cannot "
            f"hold this model."
        )
    unset = found.defaults
    seq_len = hf.get("max_position_embeddings", unset["max_position_embeddings"])
    defaults = {"seq_len": seq_len} | found.options(hf, options.get("seq_len", seq_len))
    theta, scaling = _rope(hf, unset["rope_theta"])
    return config(
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        d_ff=hf["intermediate_size"],
        num_kv_heads=hf.get("num_key_value_heads", unset.get("num_key_value_heads")) or heads,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", unset["rms_norm_eps"])),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **defaults | options,
    )


def _check(config: gpt.GPTConfig, api: str) -> None:
    llama = (config.norm, config.position, config.mlp) == ("rms", "rope", "swiglu")
    biased_experts = config.num_experts and (config.bias or config.qkv_bias)
    if not llama or config.num_kv_heads is None or config.moe_every != 1 or biased_experts:
        raise ValueError(
            f"{api}: config is not a Llama's, a Mixtral's or a Qwen2's (norm='rms', "
            f"position='rope', mlp='swiglu', num_kv_heads set, and with experts moe_every=1 and "
            f"bias=False: a Mixtral has no biases, nor qkv_bias); build it with llama.config or "
            f"llama.from_hf_config."
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
      config: the model's `gpt.GPTConfig` (`from_hf_config`'s).

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
