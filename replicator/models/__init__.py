"""Small reference models, written as Flax nnx modules, and the data they train on."""

from replicator.models.cnn import CNN as CNN
from replicator.models.cnn import SHAPES as SHAPES
from replicator.models.cnn import shape_images as shape_images
from replicator.models.layers import CrossReplicaBatchNorm as CrossReplicaBatchNorm
from replicator.models.mlp import MLP as MLP
