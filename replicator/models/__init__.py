"""Small reference models, written as Flax nnx modules, and the data they train on."""

from replicator._src.core.deprecation import moved_names as _moved_names
from replicator.models.cnn import CLASS_NAMES as CLASS_NAMES
from replicator.models.cnn import CNN as CNN
from replicator.models.cnn import shape_images as shape_images
from replicator.models.generation import generate as generate
from replicator.models.layers import CrossReplicaBatchNorm as CrossReplicaBatchNorm
from replicator.models.mlp import MLP as MLP

__getattr__ = _moved_names(
    "replicator.models", {"SHAPES": "replicator.models.CLASS_NAMES"}
)  # renamed: one release
