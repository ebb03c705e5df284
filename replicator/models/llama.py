"""Llama-family decoders: `replicator.models.gpt` with Llama's options, so that they share its
parallel machinery (`gpt.place`, `gpt.place_pipeline`, `gpt.pipeline_value_and_grad`, ZeRO-3,
the ``context`` axis): RMSNorm, rotary positions (Llama 3's rescaling too), a SwiGLU MLP,
grouped-query attention with separate ``q``, ``k``, ``v`` matrices, no biases, and optionally a
head tied to the token table.

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

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from replicator.models import gpt

PyTree = Any

LAYER_NAMES = {  # (our block's leaf) -> (transformers' name in a layer, transposed)
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
BIAS_NAMES = {  # with bias=True (transformers' attention_bias and mlp_bias)
    (group, f"{leaf}_bias"): (name.removesuffix("weight") + "bias", False)
    for (group, leaf), (name, transposed) in LAYER_NAMES.items()
    if transposed
}
OUTER_NAMES = {  # outside the blocks
    ("embed", "tokens"): ("model.embed_tokens.weight", False),
    ("head", "norm", "scale"): ("model.norm.weight", False),
    ("head", "w"): ("lm_head.weight", True),
}


def config(
    *,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    d_ff: int,
    num_kv_heads: int | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: gpt.RopeScaling | None = None,
    norm_eps: float = 1e-5,
    tie_embeddings: bool = False,
    **options: Any,
) -> gpt.GPTConfig:
    """A `gpt.GPTConfig` of a Llama: RMSNorm, rotary positions, SwiGLU, no biases, and separate
    ``q``/``k``/``v`` matrices with ``num_kv_heads`` key/value heads (default ``num_heads``).

    ``options`` are other `gpt.GPTConfig` fields (``seq_len``, ``dtype``, ``remat``,
    ``attention``, ``bias``, ...).

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
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=norm_eps,
        tie_embeddings=tie_embeddings,
        **(llama | options),
    )


def _refuse(what: str) -> ValueError:
    return ValueError(f"llama.from_hf_config: {what}")


def _rope(hf: Mapping[str, Any]) -> tuple[float, gpt.RopeScaling | None]:
    """``rope_theta`` and the scaling of transformers' ``rope_parameters`` (v5) or
    ``rope_theta`` and ``rope_scaling`` (v4, most ``config.json`` files)."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse("partial_rotary_factor != 1 (rotary positions on part of a head).")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _refuse(
            f"rope_type={kind!r} is not implemented; 'default' and 'llama3' are (the GPT's "
            f"rotary positions with gpt.RopeScaling)."
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, gpt.RopeScaling(**{f: rope[f] for f in fields})


def from_hf_config(hf: Mapping[str, Any], **options: Any) -> gpt.GPTConfig:
    """The `gpt.GPTConfig` of transformers' ``LlamaConfig`` (its ``to_dict()``, or a checkpoint's
    ``config.json``): sizes, ``rms_norm_eps``, rotary positions (``rope_theta``, Llama 3's
    ``rope_scaling``), ``tie_word_embeddings``, and biases when ``attention_bias`` and
    ``mlp_bias`` both say so. ``seq_len`` defaults to ``max_position_embeddings``; ``options``
    are other `gpt.GPTConfig` fields (``seq_len``, ``dtype``, ...).

    >>> from replicator.models import llama
    >>> c = llama.from_hf_config({"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    ...     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, seq_len=32)
    >>> c.num_kv_heads, c.rope_theta, c.seq_len, c.norm_eps
    (1, 500000.0, 32, 1e-06)

    Raises:
      ValueError: for what the GPT does not compute: another ``model_type`` or ``hidden_act``
        than Llama's, a ``head_dim`` other than ``hidden_size / num_attention_heads``, biases in
        attention but not the MLP (or the reverse), or a rotary scaling other than Llama 3's.
    """
    if hf.get("model_type", "llama") != "llama":
        raise _refuse(f"model_type={hf['model_type']!r}; this reads Llama configs ('llama').")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(f"hidden_act={hf['hidden_act']!r}; the SwiGLU MLP uses 'silu'.")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    if head_dim * heads != d:
        raise _refuse(
            f"head_dim={head_dim} with {heads} heads is not hidden_size={d} wide; the GPT's "
            f"heads are hidden_size / num_attention_heads = {d / heads:g} wide."
        )
    bias = bool(hf.get("attention_bias", False))
    if bias != bool(hf.get("mlp_bias", False)):
        raise _refuse(
            f"attention_bias={bias} but mlp_bias={hf.get('mlp_bias', False)}; the GPT has "
            f"biases in every linear layer or none (bias=True or False)."
        )
    theta, scaling = _rope(hf)
    return config(
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        d_ff=hf["intermediate_size"],
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **{"bias": bias, "seq_len": hf.get("max_position_embeddings", 2048)} | options,
    )


def _check(config: gpt.GPTConfig, api: str) -> None:
    llama = (config.norm, config.position, config.mlp) == ("rms", "rope", "swiglu")
    if not llama or config.num_kv_heads is None or config.num_experts:
        raise ValueError(
            f"{api}: config is not a Llama's (norm='rms', position='rope', mlp='swiglu', "
            f"num_kv_heads set, no experts); build it with llama.config or llama.from_hf_config."
        )


def _names(config: gpt.GPTConfig) -> dict[tuple, tuple[str, bool]]:
    """Our leaf path (``("blocks", layer, group, leaf)`` for a block's) -> transformers' name."""
    layer = LAYER_NAMES | (BIAS_NAMES if config.bias else {})
    names = {
        ("blocks", i, *path): (f"model.layers.{i}.{name}", t)
        for i in range(config.num_layers)
        for path, (name, t) in layer.items()
    }
    outer = {
        p: v for p, v in OUTER_NAMES.items() if p != ("head", "w") or not config.tie_embeddings
    }
    return names | outer


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (any dtype, device): fp32 on the host
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32)


def params_from_state_dict(state_dict: Mapping[str, Any], *, config: gpt.GPTConfig) -> dict:
    """`gpt.init`'s tree (fp32 NumPy) from transformers' Llama parameters (``LlamaForCausalLM.
    state_dict()``, torch tensors, or a safetensors file's arrays): weights transposed to
    ``[in, out]`` (``q``'s columns stay head-major), the layers stacked.

    Raises:
      ValueError: if ``config`` is not a Llama's, or a name is missing, or left over (except
        ``lm_head.weight`` for a tied head, which is the token table).
    """
    _check(config, "llama.params_from_state_dict")
    names = _names(config)
    missing = sorted(name for name, _ in names.values() if name not in state_dict)
    extra = set(state_dict) - {name for name, _ in names.values()}
    extra -= {"lm_head.weight"} if config.tie_embeddings else set()
    if missing or extra:
        raise ValueError(
            f"llama.params_from_state_dict: the state dict does not match config (a "
            f"{config.num_layers}-layer Llama, bias={config.bias}, tie_embeddings="
            f"{config.tie_embeddings}): missing {missing[:4]}, unexpected {sorted(extra)[:4]}."
        )
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    params: dict = {}
    for path, (name, transposed) in names.items():
        value = _numpy(state_dict[name])
        want = _at(shapes, path).shape
        want = want[::-1] if transposed else want
        if value.shape != want:
            raise ValueError(
                f"llama.params_from_state_dict: {name} is {list(value.shape)}; config's sizes "
                f"give {list(want)} (transformers' [out, in] layout)."
            )
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value.T if transposed else value
    blocks = params.pop("blocks")
    stacked = {
        group: {leaf: np.stack([blocks[i][group][leaf] for i in range(config.num_layers)])
                for leaf in blocks[0][group]}
        for group in blocks[0]
    }  # fmt: skip
    return {**params, "blocks": stacked}


def state_dict_from_params(params: PyTree, *, config: gpt.GPTConfig) -> dict[str, np.ndarray]:
    """transformers' Llama names and ``[out, in]`` layout of `gpt.init`'s tree (or of its
    gradients): the inverse of `params_from_state_dict`, fp32 NumPy, without ``lm_head.weight``
    for a tied head."""
    _check(config, "llama.state_dict_from_params")
    out = {}
    for path, (name, transposed) in _names(config).items():
        value = _numpy(_at(params, path))
        out[name] = value.T if transposed else value
    return out


def _at(tree: PyTree, path: tuple) -> Any:
    """The leaf of `_names`' ``path`` (a block's: layer ``path[1]`` of its stacked leaf; of
    ``jax.eval_shape``'s tree, its shape and dtype)."""
    if path[0] != "blocks":
        for key in path:
            tree = tree[key]
        return tree
    leaf = tree["blocks"][path[2]][path[3]]
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return leaf[path[1]]
