"""A loss summed over chunks of tokens, each chunk's gradient taken in the forward pass:
`chunked_sum` (the head's cross-entropy under ``GPTConfig.loss_chunks``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunked_sum(
    loss: Callable, gather: Callable, params: Any, xs: jax.Array, ts: jax.Array
) -> jax.Array:
    """``sum_c loss(gather(params), xs[c], ts[c])``, in fp32: ``[C, T / C, D]`` activations and
    ``[C, T / C]`` targets a chunk at a time, the parameters gathered once for the chunks.

    Differentiated, each chunk's gradient is taken in the forward pass, while its logits are
    live (`_grads`), and the stored parameters' gradient (``gather``'s transpose: ZeRO-3's
    scatter) is taken before the activations' gradient leaves: the backward pass only scales
    what the forward kept. One loop over the chunks and one pass of the head's matmul, and
    neither the gathered matrix nor its whole gradient is held while the layers' backward pass
    runs (XLA schedules a second loop, and the scatter, as late as it may: after the layers).

    >>> w = jnp.arange(6.0).reshape(3, 2)
    >>> loss = lambda w, x, t: jnp.sum((x @ w - t) ** 2)
    >>> xs, ts = jnp.ones((2, 4, 3)), jnp.zeros((2, 4, 2))
    >>> float(chunked_sum(loss, lambda p: p, w, xs, ts)), float(loss(w, xs[0], ts[0]) * 2)
    (936.0, 936.0)
    >>> jax.grad(lambda w: chunked_sum(loss, lambda p: p, w, xs, ts))(w)[0].tolist()
    [96.0, 144.0]
    """
    head = gather(params)
    total = lambda t, xt: (t + loss(head, *xt), None)
    return jax.lax.scan(total, jnp.zeros((), jnp.float32), (xs, ts))[0]


def _grads(loss, gather, params, xs, ts):
    """`chunked_sum`'s forward pass differentiated: the sum, with the gradients of the stored
    parameters (summed over the chunks in the gathered ones' dtype, then transposed through
    ``gather``) and of the activations (stacked)."""
    head, scatter = jax.vjp(gather, params)

    def chunk(carry, xt):
        total, grads = carry
        x, t = xt
        value, vjp = jax.vjp(lambda h, x: loss(h, x, t), head, x)
        dh, dx = vjp(jnp.ones((), value.dtype))
        return (total + value, jax.tree.map(jnp.add, grads, dh)), dx

    zeros = jax.tree.map(jnp.zeros_like, head)
    (total, dh), dxs = jax.lax.scan(chunk, (jnp.zeros((), jnp.float32), zeros), (xs, ts))
    # the stored parameters' gradient before the activations' leaves: its scatter runs here
    stored, dxs = jax.lax.optimization_barrier((scatter(dh)[0], dxs))
    return total, (stored, dxs)


def _scaled(loss, gather, grads, g):
    stored, dxs = grads
    scale = lambda d: (d * g).astype(d.dtype)
    return jax.tree.map(scale, stored), scale(dxs), None


chunked_sum.defvjp(_grads, _scaled)
