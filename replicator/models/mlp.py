"""A multi-layer perceptron."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
from flax import nnx


class MLP(nnx.Module):
    """Dense layers with GELU between them.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> MLP([4, 8, 2], rngs=nnx.Rngs(0))(jnp.ones((5, 4))).shape
    (5, 2)
    """

    def __init__(self, sizes: Sequence[int], *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)
