"""What the layers share: the linear layers' weights, biases and residual projections, and
ZeRO-3's stored parts (`rp.ShardedParam`), cast to ``GPTConfig.reduce_dtype``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import replicator as rp
from replicator._src.core.binding import xla_cpu_with
from replicator._src.core.mesh import MODEL_AXIS
from replicator._src.pipeline import remat
from replicator.models.config import GPTConfig

PyTree = Any


def normal(key, shape, std=0.02):
    return std * jax.random.normal(key, shape, jnp.float32)


def with_biases(config: GPTConfig, leaves: dict, bias: Callable[[Any], Any]) -> dict:
    """``leaves`` (one per linear layer, by name) with ``{name}_bias``, ``bias(leaf)``, after
    each layer that has one (``config.has_bias``): the parameters' tree, or their roles'."""
    out = {}
    for name, leaf in leaves.items():
        out[name] = leaf
        if config.has_bias(name):
            out[f"{name}_bias"] = bias(leaf)
    return out


def linears(config: GPTConfig, weights: dict) -> dict:
    """``{name: weight}`` and ``{name}_bias`` zeros after each that has a bias."""
    return with_biases(config, weights, lambda w: jnp.zeros(w.shape[-1:], jnp.float32))


def linear(p: dict, name: str, x: jax.Array, label: str | None = None) -> jax.Array:
    """``x @ p[name]``, plus ``p[name + "_bias"]`` when the layer has one; the product named
    ``label`` for the remat policies by name (`remat.ACTIVATIONS`)."""
    y = _named(x @ p[name], label)
    return y + p[f"{name}_bias"] if f"{name}_bias" in p else y


def residual(x: jax.Array, p: dict, name: str, h: jax.Array, label: str | None = None) -> jax.Array:
    """``x + h @ p[name]`` (plus its bias): a residual branch's output projection, the product
    named ``label``."""
    y = x + _named(h @ p[name], label)
    return y + p[f"{name}_bias"] if f"{name}_bias" in p else y


POST_NORMS = {"attn": "post_attn_norm", "mlp": "post_mlp_norm"}
"""Each residual branch's norm on its output, with ``GPTConfig.post_norms``."""


def residual_branch(
    x: jax.Array, p: dict, group: str, name: str, h: jax.Array, label: str, config: GPTConfig
) -> jax.Array:
    """`residual` of the block's ``group`` (``"attn"``, ``"mlp"``), with the branch's output
    normed first (``p[POST_NORMS[group]]``) under ``config.post_norms``."""
    if not config.post_norms:
        return residual(x, p[group], name, h, label)
    from replicator.models.layers.norms import norm

    y = _named(h @ p[group][name], label)
    y = y + p[group][f"{name}_bias"] if f"{name}_bias" in p[group] else y
    return x + norm(p[POST_NORMS[group]], y, config)


def _named(y: jax.Array, label: str | None) -> jax.Array:
    return y if label is None else remat.named(y, label)


def is_stored(x: Any) -> bool:
    return isinstance(x, rp.ShardedParam)


def reduce_cast(params: PyTree, config: GPTConfig) -> PyTree:
    """``params`` with their ZeRO-3 parts (`rp.ShardedParam`) cast to ``config.reduce_dtype``.

    Raises:
      ValueError: for bf16 parts in a program for XLA:CPU with a ``model`` axis, whose compiler
        aborts on it (its AllReducePromotion pass clones a bf16 all-reduce whose reducer is a
        copy, for the parts kept whole over ``model``, such as the norms'). The TPU compiles it.
    """
    if config.reduce_dtype is None:
        return params
    dtype = jnp.dtype(config.reduce_dtype)
    stored = any(is_stored(a) for a in jax.tree.leaves(params, is_leaf=is_stored))
    if stored and dtype != jnp.float32 and xla_cpu_with(MODEL_AXIS):
        raise ValueError(
            f"GPTConfig(reduce_dtype={config.reduce_dtype!r}) under ZeRO-3 with a "
            f"{MODEL_AXIS!r} axis aborts XLA:CPU's compiler; on the CPU use reduce_dtype=None "
            f"(model.reduce_dtype: null: the gradients summed in fp32, as on one device) or a "
            f"mesh without {MODEL_AXIS!r}. A TPU compiles it: `replicator explain CONFIG "
            f"--target TYPE` reads that program from here."
        )
    cast = lambda a: a.like(a.value.astype(dtype)) if is_stored(a) else a
    return jax.tree.map(cast, params, is_leaf=is_stored)
