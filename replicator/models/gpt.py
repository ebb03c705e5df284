"""A small GPT-style decoder, written for pipeline parallelism, and byte-level text that ships
with Python.

The parameters are plain pytrees. The transformer blocks are *stacked*: every leaf of
``params["blocks"]`` has a leading layer axis, so `replicator.pipeline.stack_stages` splits them
into stages and `stage_fn` runs one stage as a ``lax.scan`` over its layers. The embedding and
the head (final LayerNorm and output matrix) stay outside the stages: the embedding produces the
pipeline's input and its gradient flows back from ``g_inputs``; the head is ``loss_fn``'s
``head_params``. `loss` is the whole model on one device: the oracle.

>>> import jax, replicator as rp
>>> from replicator.models import gpt
>>> config = gpt.GPTConfig(vocab_size=256, seq_len=16, d_model=32, num_heads=4, num_layers=4)
>>> params = gpt.init(config, jax.random.key(0))
>>> params["blocks"]["attn"]["qkv"].shape      # stacked over 4 layers
(4, 32, 96)
>>> batch = next(gpt.token_batches(b"hello world, " * 50, batch_size=2, seq_len=16))
>>> round(float(gpt.loss(params, batch["tokens"], batch["targets"], config=config)), 1)
5.5
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from replicator import pipeline
from replicator._src.errors import positive_int

PyTree = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder. ``d_ff`` defaults to ``4 * d_model``; ``dtype`` is the compute
    dtype (parameters stay fp32, and the head's logits and loss are fp32)."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 4
    d_ff: int | None = None
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_heads", "num_layers"):
            positive_int(getattr(self, name), api="GPTConfig", name=name)
        positive_int(self.d_ff, api="GPTConfig", name="d_ff", none=" or None")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must divide by num_heads={self.num_heads}; "
                f"use e.g. d_model={self.num_heads * math.ceil(self.d_model / self.num_heads)}."
            )

    @property
    def hidden(self) -> int:
        return self.d_ff or 4 * self.d_model


def _layer_norm_params(d: int) -> dict:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _block_params(config: GPTConfig, key) -> dict:
    d, h = config.d_model, config.hidden
    k = jax.random.split(key, 4)
    normal = lambda key, shape, std=0.02: std * jax.random.normal(key, shape, jnp.float32)
    out_std = 0.02 / math.sqrt(2 * config.num_layers)  # GPT-2: scaled residual projections
    return {
        "ln1": _layer_norm_params(d),
        "attn": {
            "qkv": normal(k[0], (d, 3 * d)),
            "qkv_bias": jnp.zeros((3 * d,), jnp.float32),
            "out": normal(k[1], (d, d), out_std),
            "out_bias": jnp.zeros((d,), jnp.float32),
        },
        "ln2": _layer_norm_params(d),
        "mlp": {
            "up": normal(k[2], (d, h)),
            "up_bias": jnp.zeros((h,), jnp.float32),
            "down": normal(k[3], (h, d), out_std),
            "down_bias": jnp.zeros((d,), jnp.float32),
        },
    }


def init(config: GPTConfig, key: jax.Array) -> dict:
    """Parameters: ``{"embed": {...}, "blocks": <stacked over num_layers>, "head": {...}}``."""
    k_tok, k_pos, k_head, k_blocks = jax.random.split(key, 4)
    d = config.d_model
    blocks = [_block_params(config, k) for k in jax.random.split(k_blocks, config.num_layers)]
    return {
        "embed": {
            "tokens": 0.02 * jax.random.normal(k_tok, (config.vocab_size, d), jnp.float32),
            "positions": 0.01 * jax.random.normal(k_pos, (config.seq_len, d), jnp.float32),
        },
        "blocks": jax.tree.map(lambda *a: jnp.stack(a), *blocks),
        "head": {
            "norm": _layer_norm_params(d),
            "w": 0.02 * jax.random.normal(k_head, (d, config.vocab_size), jnp.float32),
        },
    }


def _layer_norm(p: dict, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.mean((x32 - mean) ** 2, -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


def embed(embed_params: dict, tokens: jax.Array) -> jax.Array:
    """Token plus position embeddings: ``[B, S]`` int tokens to ``[B, S, D]``."""
    s = tokens.shape[-1]
    return embed_params["tokens"][tokens] + embed_params["positions"][:s]


def block(layer_params: dict, x: jax.Array, *, config: GPTConfig) -> jax.Array:
    """One pre-LayerNorm decoder block: causal self-attention, then an MLP, each residual."""
    dtype = config.dtype
    p = jax.tree.map(lambda a: a.astype(dtype), layer_params)
    x = x.astype(dtype)
    b, s, d = x.shape
    nh = config.num_heads
    qkv = _layer_norm(p["ln1"], x) @ p["attn"]["qkv"] + p["attn"]["qkv_bias"]
    q, k, v = (a.reshape(b, s, nh, d // nh) for a in jnp.split(qkv, 3, axis=-1))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(d // nh)
    causal = jnp.tril(jnp.ones((s, s), bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
    attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
    x = x + attn @ p["attn"]["out"] + p["attn"]["out_bias"]
    h = jax.nn.gelu(_layer_norm(p["ln2"], x) @ p["mlp"]["up"] + p["mlp"]["up_bias"])
    return x + h @ p["mlp"]["down"] + p["mlp"]["down_bias"]


def blocks(stacked_params: dict, x: jax.Array, *, config: GPTConfig) -> jax.Array:
    """Every block in order, as a ``lax.scan`` over the leading layer axis."""
    step = lambda h, p: (block(p, h, config=config), None)
    return jax.lax.scan(step, x, stacked_params)[0]


def stage_fn(config: GPTConfig) -> Callable[[dict, jax.Array], jax.Array]:
    """``f(stage_params, x) -> x`` for the pipeline: the blocks of one stage (``[Lv, ...]``),
    built with `replicator.pipeline.scan_layers` so the pipeline steps through them one by one."""
    return pipeline.scan_layers(lambda p, x: block(p, x, config=config).astype(x.dtype))


def head_logits(head_params: dict, x: jax.Array) -> jax.Array:
    """Final LayerNorm and output matrix: ``[B, S, D]`` to fp32 logits ``[B, S, V]``."""
    x = _layer_norm(head_params["norm"], x.astype(jnp.float32))
    return x @ head_params["w"]


def head_loss(head_params: dict, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy of the head on ``x``, in fp32: the pipeline's ``loss_fn``."""
    logp = jax.nn.log_softmax(head_logits(head_params, x), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def apply(params: dict, tokens: jax.Array, *, config: GPTConfig) -> jax.Array:
    """The whole model: fp32 logits ``[B, S, V]``."""
    x = embed(params["embed"], tokens).astype(config.dtype)
    return head_logits(params["head"], blocks(params["blocks"], x, config=config))


def loss(params: dict, tokens: jax.Array, targets: jax.Array, *, config: GPTConfig) -> jax.Array:
    """The whole model's mean cross-entropy on one device: the oracle for the pipeline."""
    x = embed(params["embed"], tokens).astype(config.dtype)
    return head_loss(params["head"], blocks(params["blocks"], x, config=config), targets)


def pipeline_value_and_grad(
    config: GPTConfig, *, num_microbatches: int, schedule: Any = "gpipe"
) -> Callable[[dict, dict], tuple[jax.Array, dict]]:
    """``f(params, batch) -> (loss, grads)`` for one data replica, the blocks run as a pipeline.

    ``params`` is `place_pipeline`'s layout, ``{"embed", "stages", "head"}``, and ``batch`` is
    `token_batches`' ``{"tokens", "targets"}``. The embedding runs before the stages, and its
    gradient flows back from the pipeline's input gradient; the head is the pipeline's
    ``loss_fn`` (`head_loss`). Inside ``Replicator.run`` on a mesh with a ``stage`` axis the
    stages run as ``schedule`` says; elsewhere, in order on one device. Either way::

        Equivalent to: jax.value_and_grad(loss)(params with the stages unstacked, tokens, targets)

    Args:
      config: the model's sizes.
      num_microbatches: micro-batches per replica's batch (see
        `replicator.pipeline.value_and_grad`).
      schedule: a `replicator.pipeline` schedule such as ``pipeline.OneFOneB()``, or its name.

    Returns:
      The function; its ``grads`` have the structure of ``params``, and are this replica's own
      (reduce them across replicas, e.g. with an optimizer from ``repl.wrap_optimizer``).

    >>> import jax, jax.numpy as jnp
    >>> from replicator import pipeline
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=2)
    >>> params = gpt.init(config, jax.random.key(0))
    >>> batch = next(gpt.token_batches(b"abcdefgh" * 20, batch_size=4, seq_len=8))
    >>> blocks = params.pop("blocks")
    >>> staged = dict(params, stages=pipeline.stack_stages(blocks, num_stages=2))
    >>> grad_fn = gpt.pipeline_value_and_grad(config, num_microbatches=2)
    >>> loss, grads = grad_fn(staged, batch)
    >>> sorted(grads)
    ['embed', 'head', 'stages']
    >>> bool(jnp.allclose(loss, gpt.loss(params | {"blocks": blocks}, **batch, config=config)))
    True
    """
    grad_fn = pipeline.value_and_grad(
        stage_fn(config), head_loss, num_microbatches=num_microbatches, schedule=schedule
    )

    def value_and_grad(params: dict, batch: dict) -> tuple[jax.Array, dict]:
        x, embed_vjp = jax.vjp(lambda e: embed(e, batch["tokens"]), params["embed"])
        loss, (g_stages, g_x, g_head) = grad_fn(
            params["stages"], x, batch["targets"], params["head"]
        )
        return loss, {"embed": embed_vjp(g_x)[0], "stages": g_stages, "head": g_head}

    return value_and_grad


def place_pipeline(repl: rp.Replicator, params: dict, *, num_stages: int, repeats: int = 1) -> dict:
    """`init`'s parameters placed on ``repl``'s mesh for `pipeline_value_and_grad`.

    The blocks are stacked into ``num_stages`` stages (``repeats`` virtual stages per device, for
    the circular schedule) and sharded over the ``stage`` axis; the embedding and the head are
    replicated.

    Args:
      repl: the Replicator whose mesh holds the parameters.
      params: `init`'s ``{"embed", "blocks", "head"}``.
      num_stages: the size of the mesh's ``stage`` axis.
      repeats: virtual stages per device.

    Returns:
      ``{"embed", "stages", "head"}``, placed.

    >>> import jax, replicator as rp
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=4)
    >>> repl = rp.Replicator(lowering="local")
    >>> placed = gpt.place_pipeline(repl, gpt.init(config, jax.random.key(0)), num_stages=2)
    >>> placed["stages"]["attn"]["qkv"].shape       # [stages, layers per stage, ...]
    (2, 2, 16, 48)
    """
    stacked = pipeline.stack_stages(params["blocks"], num_stages=num_stages, repeats=repeats)
    return {
        "embed": repl.replicate(params["embed"]),
        "stages": repl.place(stacked, pipeline.stage_spec(repeats)),
        "head": repl.replicate(params["head"]),
    }


def num_params(params: PyTree) -> int:
    return int(sum(np.prod(np.shape(a)) for a in jax.tree.leaves(params)))


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token, ``6 N + 6 L S D`` (Kaplan et al.): N non-embedding parameters
    (``L (4 D^2 + 2 D F)`` plus the ``D V`` head), and attention over ``S`` positions."""
    d, f, n_layers = config.d_model, config.hidden, config.num_layers
    n = n_layers * (4 * d * d + 2 * d * f) + d * config.vocab_size
    return float(6 * n + 6 * n_layers * config.seq_len * d)


# -- text that ships with Python ----------------------------------------------------------------


def stdlib_text(max_bytes: int = 2_000_000) -> bytes:
    """The sources of Python's standard library, concatenated in sorted order: no download.

    Skips ``site-packages`` and test directories; stops at ``max_bytes``. Deterministic for a
    given Python installation.
    """
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "test", "tests", "idle_test")
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


def token_batches(
    data: bytes, *, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless random windows of ``data`` as byte tokens: ``{"tokens", "targets"}`` int32
    ``[batch_size, seq_len]``, targets shifted by one. Deterministic for a seed."""
    if len(data) < seq_len + 1:
        raise ValueError(
            f"token_batches: {len(data)} bytes are fewer than seq_len + 1 = {seq_len + 1}."
        )
    array = np.frombuffer(data, dtype=np.uint8)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(array) - seq_len, size=batch_size)
        window = np.stack([array[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        yield {"tokens": window[:, :-1], "targets": window[:, 1:]}
