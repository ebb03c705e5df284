"""A small convolutional classifier with cross-replica BatchNorm, and a procedurally generated
image dataset to train it on (no downloads)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replicator.models.layers import CrossReplicaBatchNorm


class CNN(nnx.Module):
    """Conv-BN-ReLU blocks, global average pooling and a linear head.

    BatchNorm statistics are global (over every replica's examples), so training on N replicas
    equals training on one device with the whole batch.

    >>> from flax import nnx
    >>> model = CNN(in_channels=1, num_classes=10, rngs=nnx.Rngs(0))
    >>> model(jnp.ones((2, 8, 8, 1))).shape
    (2, 10)
    """

    def __init__(
        self, *, in_channels: int, num_classes: int, width: int = 16, rngs: nnx.Rngs
    ) -> None:
        self.conv1 = nnx.Conv(in_channels, width, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = CrossReplicaBatchNorm(width, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), strides=(2, 2), use_bias=False, rngs=rngs)
        self.bn2 = CrossReplicaBatchNorm(2 * width, rngs=rngs)
        self.head = nnx.Linear(2 * width, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.bn1(self.conv1(x)))
        x = jax.nn.relu(self.bn2(self.conv2(x)))
        return self.head(jnp.mean(x, axis=(1, 2)))


SHAPES = ("horizontal bar", "vertical bar", "diagonal", "square", "disk", "cross")


def shape_images(rng: np.random.Generator, n: int, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy images of the `SHAPES`, at random positions and sizes, with their labels.

    Each image holds one shape (value 1 on a background of 0) plus Gaussian noise of standard
    deviation 0.3. Deterministic for the state of ``rng``: a generator seeded per input pipeline
    gives every pipeline its own, reproducible stream.

    Args:
      rng: the NumPy generator to draw from, e.g. ``np.random.default_rng(0)``.
      n: the number of images.
      size: the height and width of an image, at least 9.

    Returns:
      ``(images, labels)``: float32 ``[n, size, size, 1]`` and int32 ``[n]`` indices into
      `SHAPES`.

    >>> images, labels = shape_images(np.random.default_rng(0), 4)
    >>> images.shape, images.dtype, labels.shape, labels.dtype
    ((4, 16, 16, 1), dtype('float32'), (4,), dtype('int32'))
    >>> SHAPES[labels[0]] in SHAPES
    True
    """
    if size < 9:
        raise ValueError(f"shape_images: size={size} is too small for the shapes; use 9 or more.")
    labels = rng.integers(0, len(SHAPES), size=n)
    images = np.zeros((n, size, size, 1), np.float32)
    yy, xx = np.mgrid[:size, :size]
    for i, label in enumerate(labels):
        cy, cx = rng.integers(4, size - 4, size=2)
        r = rng.integers(2, 4)
        dy, dx = abs(yy - cy), abs(xx - cx)
        kind = SHAPES[label]
        if kind == "horizontal bar":
            mask = (dy <= 1) & (dx <= r + 2)
        elif kind == "vertical bar":
            mask = (dx <= 1) & (dy <= r + 2)
        elif kind == "diagonal":
            mask = (abs((yy - cy) - (xx - cx)) <= 1) & (dy <= r + 1)
        elif kind == "square":
            mask = (dy <= r) & (dx <= r) & ~((dy < r) & (dx < r))
        elif kind == "disk":
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r**2
        else:  # cross
            mask = ((dy == 0) & (dx <= r)) | ((dx == 0) & (dy <= r))
        images[i, ..., 0] = mask
    images += 0.3 * rng.normal(size=images.shape).astype(np.float32)
    return images, labels.astype(np.int32)
