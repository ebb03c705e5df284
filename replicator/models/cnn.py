"""A small convolutional classifier with cross-replica BatchNorm, and a procedurally generated
image dataset to train it on (no downloads).

The training pieces take the model split by ``nnx.split(model, nnx.Param, nnx.BatchStat)``:
the parameters and the BatchNorm statistics travel in the training state as plain pytrees.

>>> import numpy as np
>>> from flax import nnx
>>> from replicator.models import cnn
>>> model = cnn.CNN(in_channels=1, num_classes=len(cnn.CLASS_NAMES), width=4, rngs=nnx.Rngs(0))
>>> graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
>>> batch = next(cnn.shape_batches(8, seed=0))
>>> (loss, (stats, accuracy)), grads = cnn.value_and_grad(graphdef, params, stats, batch)
>>> loss.shape, jax.tree.structure(grads) == jax.tree.structure(params)
((), True)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from replicator.models.layers import CrossReplicaBatchNorm


class CNN(nnx.Module):
    """Conv-BN-ReLU blocks, global average pooling and a linear head.

    BatchNorm statistics are global (over every replica's examples), so training on N replicas
    equals training on one device with the whole batch.

    Args:
      in_channels: the images' channels (NHWC images).
      num_classes: the head's outputs.
      width: the first block's channels (the second has twice as many).
      rngs: the random streams of the initial weights.

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


CLASS_NAMES = ("horizontal bar", "vertical bar", "diagonal", "square", "disk", "cross")


def shape_images(rng: np.random.Generator, n: int, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy images of the `CLASS_NAMES`, at random positions and sizes, with their labels.

    Each image holds one shape (value 1 on a background of 0) plus Gaussian noise of standard
    deviation 0.3. Deterministic for the state of ``rng``: a generator seeded per input pipeline
    gives every pipeline its own, reproducible stream.

    Args:
      rng: the NumPy generator to draw from, e.g. ``np.random.default_rng(0)``.
      n: the number of images.
      size: the height and width of an image, at least 9.

    Returns:
      ``(images, labels)``: float32 ``[n, size, size, 1]`` and int32 ``[n]`` indices into
      `CLASS_NAMES`.

    >>> images, labels = shape_images(np.random.default_rng(0), 4)
    >>> images.shape, images.dtype, labels.shape, labels.dtype
    ((4, 16, 16, 1), dtype('float32'), (4,), dtype('int32'))
    >>> CLASS_NAMES[labels[0]] in CLASS_NAMES
    True
    """
    if size < 9:
        raise ValueError(f"shape_images: size={size} is too small for the shapes; use 9 or more.")
    labels = rng.integers(0, len(CLASS_NAMES), size=n)
    images = np.zeros((n, size, size, 1), np.float32)
    yy, xx = np.mgrid[:size, :size]
    for i, label in enumerate(labels):
        cy, cx = rng.integers(4, size - 4, size=2)
        r = rng.integers(2, 4)
        dy, dx = abs(yy - cy), abs(xx - cx)
        kind = CLASS_NAMES[label]
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


def shape_batches(batch_size: int, *, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of `shape_images`: ``{"x": [batch_size, 16, 16, 1], "y": [batch_size]}``.

    Deterministic for a seed: give each input pipeline its own (e.g. ``1000 +
    ctx.input_pipeline_id``).
    """
    rng = np.random.default_rng(seed)
    while True:
        x, y = shape_images(rng, batch_size)
        yield {"x": x, "y": y}


def loss(
    graphdef: nnx.GraphDef, params: Any, stats: Any, batch: dict
) -> tuple[jax.Array, tuple[Any, jax.Array]]:
    """The CNN's mean cross-entropy on ``batch``, in training mode.

    Args:
      graphdef: the model's structure, from ``nnx.split(model, nnx.Param, nnx.BatchStat)``.
      params: its ``nnx.Param`` state.
      stats: its ``nnx.BatchStat`` state (the BatchNorm running statistics).
      batch: ``{"x": images, "y": integer labels}``, as `shape_batches` yields.

    Returns:
      ``(loss, (stats, accuracy))``: the new BatchNorm statistics (taken over every replica's
      examples inside a step) and the fraction of correct labels.
    """
    model = nnx.merge(graphdef, params, stats, copy=True)
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return loss, (nnx.state(model, nnx.BatchStat), accuracy)


def value_and_grad(
    graphdef: nnx.GraphDef, params: Any, stats: Any, batch: dict
) -> tuple[tuple[jax.Array, tuple[Any, jax.Array]], Any]:
    """`loss` and its gradient with respect to ``params``: ``((loss, (stats, accuracy)), grads)``.

    The gradients are this replica's own, as on one device; an optimizer from
    ``repl.wrap_optimizer`` takes their mean over the replicas.
    """
    return jax.value_and_grad(loss, argnums=1, has_aux=True)(graphdef, params, stats, batch)
