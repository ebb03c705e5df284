"""A multi-layer perceptron, and a regression to train one on."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    """Dense layers with GELU between them.

    Args:
      sizes: the widths, input first: ``len(sizes) - 1`` dense layers.
      rngs: the random streams of the initial weights.

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


def regression_batches(
    batch_size: int, *, seed: int = 0, features: int = 16
) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of a smooth regression, ``y = sin(x0) cos(x1)`` of Gaussian ``x``.

    ``{"x": float32 [batch_size, features], "y": [batch_size, 1]}``, deterministic for a seed:
    give each input pipeline its own (e.g. ``ctx.input_pipeline_id``).

    >>> batch = next(regression_batches(4, seed=0))
    >>> batch["x"].shape, batch["y"].shape
    ((4, 16), (4, 1))
    """
    rng = np.random.default_rng(seed)
    while True:
        x = rng.normal(size=(batch_size, features)).astype(np.float32)
        yield {"x": x, "y": np.sin(x[:, :1]) * np.cos(x[:, 1:2])}
