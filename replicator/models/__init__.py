"""Small reference models, written as Flax nnx modules."""

from replicator.models.cnn import CNN as CNN
from replicator.models.layers import CrossReplicaBatchNorm as CrossReplicaBatchNorm
from replicator.models.mlp import MLP as MLP
