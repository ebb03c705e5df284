"""Text from the decoder: `generate`, prompt in, tokens out, with a key/value cache.

The prompt is read once (the prefill), each layer's keys and values kept in a cache of the
whole length, ``[layers, batch, prompt + new tokens, kv_heads, head_dim]``; then each new token
goes through the layers alone, attending over the cache (`masked_attention`'s causal mask by
position hides the entries not written yet). The prefill and every step are one compiled
program: a ``lax.scan`` over the new tokens, each a ``lax.scan`` over the layers (over groups of
``len(attention_pattern)`` layers, as `replicator.models.decoder.blocks` runs them). The layers
are the decoder's own (`project_qkv`, `prepare_qk`, `masking`, `masked_attention`,
`residual_branch`, `mlp`, `mixture`, `head_logits`), so every architecture `GPTConfig` describes generates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.models import decoder, placement
from replicator.models.config import GPTConfig
from replicator.models.layers.common import residual_branch
from replicator.models.layers.head import head_logits, output_head
from replicator.models.layers.masked_attention import masked_attention
from replicator.models.layers.mlp import mlp
from replicator.models.layers.moe_mlp import mixture
from replicator.models.layers.norms import norm
from replicator.models.layers.self_attention import heads_first, masking, prepare_qk, project_qkv

PyTree = Any
_AXES = ("data", "dcn_data", "model")  # the mesh axes generation runs over


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the compiled program depends on besides its arguments' shapes (hashable)."""

    config: GPTConfig
    new_tokens: int  # >= 1
    sample: bool  # False: greedy (argmax)
    cache: NamedSharding | None  # the cache's sharding on a mesh; None on one device


def generate(
    params: PyTree,
    config: GPTConfig,
    prompt_ids: Any,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    repl: rp.Replicator | None = None,
) -> jax.Array:
    """The prompts followed by ``max_new_tokens`` tokens the decoder generates, one at a time.

    The prompt goes through the model once, filling a key/value cache; each new token then
    goes through it alone. Equivalent to (without the cache, as `gpt.apply` computes it)::

        tokens = prompt_ids
        for i in range(max_new_tokens):
            logits = gpt.apply(params, tokens, config=config)[:, -1]
            tokens = concat([tokens, choose(logits, fold_in(key(seed), i))], axis=1)

    where ``choose`` is the argmax at ``temperature=0``, else a draw from ``softmax(logits /
    temperature)`` restricted to its top-p nucleus: the most probable tokens, in order, until
    their probabilities sum to at least ``top_p`` (at least one; tokens tied with the last one
    kept are kept too), as transformers' ``top_p``. The same ``seed`` gives the same tokens.
    The program is compiled once per config, prompt shape, ``max_new_tokens`` and whether it
    samples; temperature, top-p and seed are its arguments. A mixture of experts routes each
    step's tokens as a group of their own: exact with ``capacity_factor=None`` (dropless, as
    transformers' Mixtral); with a capacity, tokens `gpt.apply` would drop are kept.

    Args:
      params: `gpt.init`'s parameters (NumPy or JAX arrays, fp32), e.g. a Hugging Face
        checkpoint's (`llama.params_from_state_dict`, `hf.load`).
      config: the model's `GPTConfig`.
      prompt_ids: ``[B, P]`` int token ids, the ``B`` prompts all ``P`` tokens long (pad
        shorter ones on the left yourself: no attention mask is applied), or a 1-D sequence of
        ``P`` ids (a list too).
      max_new_tokens: how many tokens to add, >= 0; ``P + max_new_tokens`` is at most
        ``config.seq_len``.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_p: the nucleus, in ``(0, 1]``; 1 samples from every token.
      seed: the sampling key's seed (`jax.random.key`).
      repl: a `replicator.Replicator` to generate on its mesh (``data``, ``dcn_data`` and
        ``model`` axes): the parameters placed with `gpt.MEGATRON_RULES` (heads and MLP units
        over ``model``), the cache split over ``model`` by its key/value heads (whole where
        they do not divide) and over the data axes by the prompts (where they divide). None:
        the default device. The same tokens either way.

    Returns:
      ``[B, P + max_new_tokens]`` int32 token ids, the prompts first (``[P +
      max_new_tokens]`` for a 1-D prompt).

    Raises:
      ValueError: for a negative ``max_new_tokens`` or ``temperature``, a ``top_p`` outside
        ``(0, 1]``, a prompt that is not ``[B, P]`` ids of the vocabulary, a length over
        ``config.seq_len``, or a mesh with other axes.

    >>> import jax
    >>> from replicator.models import generate, gpt
    >>> config = gpt.GPTConfig(vocab_size=32, seq_len=16, d_model=16, num_heads=2, num_layers=2)
    >>> params = gpt.init(config, jax.random.key(0))
    >>> tokens = generate(params, config, [1, 2, 3], 5)
    >>> tokens.shape, tokens[:3].tolist()
    ((8,), [1, 2, 3])
    >>> sampled = generate(params, config, [[1, 2], [3, 4]], 4, temperature=0.8, top_p=0.9, seed=1)
    >>> sampled.shape, bool((sampled == generate(params, config, [[1, 2], [3, 4]], 4,
    ...                                          temperature=0.8, top_p=0.9, seed=1)).all())
    ((2, 6), True)
    """
    prompt, flat = _checked(config, prompt_ids, max_new_tokens, temperature, top_p)
    if heads_first(config):  # the layers here take `project_qkv`'s layout, whatever trains
        config = dataclasses.replace(config, attention="dot_product")
    if max_new_tokens == 0:
        out = jnp.asarray(prompt)
        return out[0] if flat else out
    cache = None
    if repl is not None:
        params, prompt, cache = _on_mesh(repl, params, prompt, config)
    else:
        params = jax.tree.map(_on_default_device, params)
    plan = _Plan(config, int(max_new_tokens), temperature > 0, cache)
    out = _program(
        params, prompt, jax.random.key(seed), jnp.float32(temperature), jnp.float32(top_p), plan
    )
    return out[0] if flat else out


def _checked(
    config: GPTConfig, prompt_ids: Any, max_new_tokens: Any, temperature: Any, top_p: Any
) -> tuple[np.ndarray, bool]:
    """The prompt as ``[B, P]`` int32 NumPy (and whether it was 1-D), every argument checked."""
    api = "generate"
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"{api}: max_new_tokens must be an int >= 0; got {max_new_tokens!r}.")
    if max_new_tokens < 0:
        raise ValueError(
            f"{api}: max_new_tokens={max_new_tokens} is negative; give 0 or more new tokens."
        )
    if not _real(temperature) or temperature < 0 or not math.isfinite(temperature):
        raise ValueError(
            f"{api}: temperature={temperature!r}; use 0 for greedy decoding (the argmax) or a "
            f"positive number to sample, e.g. temperature=0.8."
        )
    if not _real(top_p) or not 0 < top_p <= 1:
        raise ValueError(
            f"{api}: top_p={top_p!r} is outside (0, 1]; use e.g. top_p=0.9 (the smallest set "
            f"of tokens with 90% of the probability), or top_p=1.0 for every token."
        )
    prompt = np.asarray(prompt_ids)
    flat = prompt.ndim == 1
    prompt = prompt[None] if flat else prompt
    if prompt.ndim != 2 or 0 in prompt.shape or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(
            f"{api}: prompt_ids must be [batch, length] int token ids (prompts of one length), "
            f"or one prompt's 1-D ids, at least one token; got {prompt.dtype} of shape "
            f"{list(np.shape(prompt_ids))}."
        )
    if prompt.min() < 0 or prompt.max() >= config.vocab_size:
        raise ValueError(
            f"{api}: prompt_ids hold ids from {prompt.min()} to {prompt.max()}, outside the "
            f"vocabulary's 0 to {config.vocab_size - 1}; encode the prompt with the model's "
            f"tokenizer."
        )
    length = prompt.shape[1] + max_new_tokens
    if length > config.seq_len:
        positions = "learned position table" if config.position == "learned" else "config"
        fix = (
            "a model trained on longer sequences"
            if config.position == "learned"
            else "a config with a larger seq_len (dataclasses.replace(config, seq_len=...)), "
            "if the model holds up beyond its training length"
        )
        raise ValueError(
            f"{api}: a prompt of {prompt.shape[1]} tokens plus max_new_tokens={max_new_tokens} "
            f"is {length} tokens, but the {positions} allows seq_len={config.seq_len}; use "
            f"max_new_tokens <= {max(config.seq_len - prompt.shape[1], 0)}, a shorter prompt, "
            f"or {fix}."
        )
    return prompt.astype(np.int32), flat


def _on_default_device(a: Any) -> jax.Array:
    """``a`` on the default device, its type naming no mesh: an array placed on a mesh of
    explicit axes (``jax.make_mesh``'s) keeps that mesh in its type through ``device_put``,
    which the cache's updates would then not match."""
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
        a = np.asarray(a)
    return jax.device_put(a, jax.devices()[0])


def _real(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _on_mesh(
    repl: rp.Replicator, params: PyTree, prompt: np.ndarray, config: GPTConfig
) -> tuple[PyTree, jax.Array, NamedSharding]:
    """The parameters placed by Megatron's rules on ``repl``'s mesh, the prompts split over
    its data axes (where they divide), and the cache's sharding."""
    mesh = repl.mesh
    other = {a: n for a, n in mesh.shape.items() if a not in _AXES and n > 1}
    if other:
        raise ValueError(
            f"generate: the mesh {dict(mesh.shape)} has axes {sorted(other)}; generation runs "
            f"over 'data' (the prompts) and 'model' (heads and MLP units) only: use a "
            f"Replicator with mesh_shape={{'data': ..., 'model': ...}}."
        )
    t = mesh.shape.get("model", 1)
    split_kv = t > 1 and config.kv_heads % t == 0
    rules = dict(placement.MEGATRON_RULES)
    if not split_kv and config.num_kv_heads is not None:
        rules["kv_heads"] = None  # fewer key/value heads than devices: whole on each
    params = placement.place(repl, params, config=config, rules=rules)
    data = repl.replica_axes
    batch = data if data and prompt.shape[0] % repl.num_replicas == 0 else None
    prompt = jax.device_put(prompt, NamedSharding(mesh, P(batch, None)))
    cache = NamedSharding(mesh, P(None, batch, None, "model" if split_kv else None, None))
    return params, prompt, cache


@functools.partial(jax.jit, static_argnames=("plan",))
def _program(
    params: PyTree,
    prompt: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    plan: _Plan,
) -> jax.Array:
    """The prompt's prefill, then a ``lax.scan`` over the new tokens: ``[B, P + N]`` ids.

    Equivalent to: ``token = choose(prefill(prompt)); for i in 1..N-1: token =
    choose(step(token, position P + i - 1))``, each token's key ``fold_in(key, i)``.
    """
    config, n = plan.config, plan.new_tokens
    b, p = prompt.shape
    total = p + n
    blocks = _grouped(params["blocks"], config)  # once, outside the loop
    shape = (config.num_layers, b, total, config.kv_heads, config.head_dim)
    cache = _constrained((jnp.zeros(shape, config.dtype),) * 2, plan.cache)
    choose = functools.partial(_choose, temperature=temperature, top_p=top_p, sample=plan.sample)
    logits, cache = _forward(params, blocks, prompt, jnp.arange(p), cache, config, total)
    first = choose(logits, jax.random.fold_in(key, 0))

    def step(carry, i):
        cache, token = carry
        pos = (p + i - 1)[None]
        logits, cache = _forward(params, blocks, token[:, None], pos, cache, config, total)
        token = choose(logits, jax.random.fold_in(key, i))
        return (_constrained(cache, plan.cache), token), token

    rest = jax.lax.scan(step, (cache, first), jnp.arange(1, n))[1]  # [N - 1, B]
    return jnp.concatenate([prompt, first[:, None], rest.T], axis=1)


def _constrained(cache: tuple, sharding: NamedSharding | None) -> tuple:
    if sharding is None:
        return cache
    return tuple(jax.lax.with_sharding_constraint(c, sharding) for c in cache)


def _forward(
    params: PyTree,
    blocks: tuple,
    tokens: jax.Array,
    pos: jax.Array,
    cache: tuple,
    config: GPTConfig,
    total: int,
) -> tuple[jax.Array, tuple]:
    """The last position's fp32 logits ``[B, V]`` of ``tokens`` ``[B, S]`` at positions
    ``pos`` ``[S]``, their keys and values written to the cache; ``S > 1`` is the prefill
    (from position 0: it attends over its own keys), ``S == 1`` a step (over the cache)."""
    embed = params["embed"]
    if "positions" in embed:  # learned positions: `embed` adds the table's first S rows
        embed = {**embed, "positions": jnp.asarray(embed["positions"])[pos]}
    x = decoder.embed(embed, tokens, None, config.dtype, decoder.embed_scale(config))
    x, cache = _layers(blocks, x, pos, cache, config, total, prefill=tokens.shape[1] > 1)
    logits = head_logits(output_head(params, config=config), x[:, -1:], config=config)
    return logits[:, 0], cache


def _grouped(blocks: PyTree, config: GPTConfig) -> tuple[PyTree, PyTree]:
    """``(groups, tail)``: the stacked blocks as ``[groups, len(attention_pattern), ...]``
    and the layers a last group lacks (`decoder.blocks`' scan); a mixture of experts' groups
    as `decoder.init` stacks them, no tail."""
    if config.num_experts:
        return blocks, None
    n = len(config.attention_pattern)
    groups = config.num_layers // n
    split = lambda a: a[: groups * n].reshape(groups, n, *a.shape[1:])
    return jax.tree.map(split, blocks), jax.tree.map(lambda a: a[groups * n :], blocks)


def _layers(
    blocks: tuple, x: jax.Array, pos: jax.Array, cache: tuple, config: GPTConfig, total: int,
    prefill: bool,
) -> tuple[jax.Array, tuple]:  # fmt: skip
    """Every layer in order: a ``lax.scan`` over the groups of `_grouped`, each layer of a
    group of its own kind (the pattern's, or a mixture of experts' dense blocks then its MoE
    block), then the tail."""
    run = functools.partial(_layer, pos=pos, config=config, total=total, prefill=prefill)
    at = lambda tree, j: jax.tree.map(lambda a: a[j], tree)
    groups, tail = blocks
    if config.num_experts:
        n, kind = config.moe_every, config.attention_pattern[0]
        members = [("dense", j, kind, False) for j in range(n - 1)] + [("moe", None, kind, True)]
    else:
        n = len(config.attention_pattern)
        members = [(None, j, kind, False) for j, kind in enumerate(config.attention_pattern)]

    def group(carry, xs):
        (x, cache), (g, p) = carry, xs
        for j, (name, index, kind, experts) in enumerate(members):
            layer = p if name is None else p[name]
            layer = layer if index is None else at(layer, index)
            x, cache = run(layer, x, cache, g * n + j, kind, experts=experts)
        return (x, cache), None

    count = config.num_layers // n
    if count:
        x, cache = jax.lax.scan(group, (x, cache), (jnp.arange(count), groups))[0]
    for i in range(count * n, config.num_layers):  # the tail: dense layers
        x, cache = run(at(tail, i - count * n), x, cache, i, config.layer_kind(i))
    return x, cache


def _layer(
    layer_params: PyTree, x: jax.Array, cache: tuple, layer: Any, kind: str, *, pos: jax.Array,
    config: GPTConfig, total: int, prefill: bool, experts: bool = False,
) -> tuple[jax.Array, tuple]:  # fmt: skip
    """One block (`decoder.block`'s, or `decoder.moe_block`'s with ``experts``) on ``x``
    ``[B, S, D]`` at positions ``pos``, its keys and values written to layer ``layer`` of the
    cache: the prefill attends over its own, a step over the cache's ``total`` entries."""
    p = decoder.layer_params_in_dtype(layer_params, config)
    x = x.astype(config.dtype)
    q, k, v = project_qkv(p["attn"], norm(p["ln1"], x, config), config)
    q, k = prepare_qk(p["attn"], q, k, pos, config, kind)
    at = (layer, 0, pos[0], 0, 0)
    cache = tuple(
        jax.lax.dynamic_update_slice(c, new[None].astype(c.dtype), at)
        for c, new in zip(cache, (k, v))
    )
    if prefill:
        keys, values, k_pos = k, v, pos
    else:
        keys, values = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False) for c in cache)
        k_pos = jnp.arange(total)
    window, cap = masking(config, kind, pos.shape[0] if prefill else total)
    attn = masked_attention(q, keys, values, q_pos=pos, k_pos=k_pos, window=window, soft_cap=cap)
    b, s = x.shape[:2]
    context = attn.reshape(b, s, config.q_width)
    x = residual_branch(x, p, "attn", "out", context, "out_proj", config)
    x = mixture(p, x, config)[0] if experts else mlp(p, x, config)
    return x, cache


def _choose(
    logits: jax.Array, key: jax.Array, *, temperature: jax.Array, top_p: jax.Array, sample: bool
) -> jax.Array:
    """The next token of each row of ``logits`` ``[B, V]``: the argmax (``sample`` False), or
    a draw from ``softmax(logits / temperature)`` restricted to its top-p `nucleus`."""
    if not sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / temperature
    scaled = jnp.where(nucleus(scaled, top_p), scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def nucleus(logits: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """The top-p nucleus of each row of ``logits`` ``[..., V]``, as a bool mask.

    The most probable tokens of ``softmax(logits)``, in order, until their probabilities sum
    to at least ``top_p``: a token is in it when the tokens more probable than it sum to less
    than ``top_p`` (so the most probable always is); a token as probable as the last one in
    is in too. ``top_p >= 1``: every token.

    >>> import jax.numpy as jnp
    >>> nucleus(jnp.log(jnp.array([0.5, 0.1, 0.3, 0.1])), 0.7).tolist()
    [True, False, True, False]
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    ranked = -jnp.sort(-probs, axis=-1)  # descending
    before = jnp.cumsum(ranked, axis=-1) - ranked  # what the more probable tokens hold
    count = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: before[0] == 0
    last = jnp.take_along_axis(ranked, count - 1, axis=-1)
    return (probs >= last) | (top_p >= 1)


@functools.partial(jax.jit, static_argnames=("config", "prompt_len"))
def _forced_logits(
    params: PyTree, tokens: jax.Array, *, config: GPTConfig, prompt_len: int
) -> jax.Array:
    """The fp32 logits ``[B, S - P + 1, V]`` of positions ``P - 1`` to ``S - 1`` of ``tokens``
    ``[B, S]`` as `generate` computes them: ``tokens[:, :P]`` prefilled, then each later token
    fed in a step over the cache (teacher-forced, for tests against `gpt.apply`)."""
    b, s = tokens.shape
    blocks = _grouped(params["blocks"], config)
    shape = (config.num_layers, b, s, config.kv_heads, config.head_dim)
    cache = (jnp.zeros(shape, config.dtype),) * 2
    prompt = tokens[:, :prompt_len]
    first, cache = _forward(params, blocks, prompt, jnp.arange(prompt_len), cache, config, s)

    def step(cache, i):
        token = jax.lax.dynamic_slice_in_dim(tokens, i, 1, axis=1)
        logits, cache = _forward(params, blocks, token, i[None], cache, config, s)
        return cache, logits

    rest = jax.lax.scan(step, cache, jnp.arange(prompt_len, s))[1]  # [S - P, B, V]
    return jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)
