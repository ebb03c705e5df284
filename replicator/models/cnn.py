"""A small convolutional classifier with cross-replica BatchNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
