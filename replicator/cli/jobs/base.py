"""What the built-in jobs share: the `Job` each kind's job function returns (its step, its
state's init, its data), and the helpers of their data."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

import replicator as rp


class Job(NamedTuple):
    """A built-in job before its state exists: what `build` and `abstract_job` share."""

    step_fn: Callable  # step_fn(state, batch) -> (state, metrics), one replica's step
    init: Callable[[], Any]  # builds the state: arrays when called, shapes under repl.abstract
    input_fn: Callable  # the kind's own data; reads nothing until it is iterated
    batch: Callable[[], dict]  # the global batch, as jax.ShapeDtypeStruct leaves
    tokens: int | None  # tokens per step, for the metrics
    vocab: int | None  # token ids below it (checked in data.path's examples)


def sliced(make: Callable[[int], Iterator[dict]], ctx, global_batch: int) -> Iterator[dict]:
    """This input pipeline's rows of the global batches ``make(global_batch)`` yields: the data
    does not depend on how many processes read it (a job resized by the launcher sees the same
    batches)."""
    per = ctx.per_pipeline_batch_size(global_batch)
    lo = ctx.input_pipeline_id * per
    for batch in make(global_batch):
        yield {k: v[lo : lo + per] for k, v in batch.items()}


def grad_dtype(config) -> str | None:
    """The dtype `wrap_optimizer` sends the gradients in: ``model.reduce_dtype`` below ZeRO-3
    (ZeRO-3's gathers and scatters are the model's own: `gpt.GPTConfig.reduce_dtype`), and with
    hybrid ZeRO-3 for the parts' mean across the slices; None, their own, for fp32 or unset."""
    dtype = getattr(config.model, "reduce_dtype", None)
    hybrid = getattr(config, "zero_axes", None) is not None
    if dtype in (None, "float32") or (config.zero_stage == 3 and not hybrid):
        return None
    return dtype


def local_sgd(config) -> dict:
    """`wrap_optimizer`'s local-SGD keywords for ``config``: DiLoCo's ``local_steps`` and its
    outer step (SGD with Nesterov momentum), or none for synchronous training."""
    if getattr(config, "local_steps", None) is None:
        return {}
    momentum = config.outer_momentum or None
    outer = optax.sgd(config.outer_learning_rate, momentum=momentum, nesterov=bool(momentum))
    return {"local_steps": config.local_steps, "outer_optimizer": outer}


def zero_axes(config) -> dict:
    """`wrap_optimizer`'s ``zero_axes`` keyword for ``config`` (hybrid ZeRO), or none."""
    axes = getattr(config, "zero_axes", None)
    return {} if axes is None else {"zero_axes": tuple(axes)}


def first_of(input_fn: Callable) -> dict:
    """``input_fn``'s first global batch (one input pipeline)."""
    batches = input_fn(rp.InputContext())
    first = next(iter(batches))
    if hasattr(batches, "close"):
        batches.close()
    return first


def first_batch(input_fn: Callable) -> Callable[[], dict]:
    """The shapes of ``input_fn``'s first global batch, generated when called."""
    return lambda: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), first_of(input_fn)
    )
