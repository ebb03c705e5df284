"""Layers that know about replicas."""

from __future__ import annotations

from flax import nnx

from replicator._src.core.binding import replica_axis_name


class CrossReplicaBatchNorm(nnx.BatchNorm):
    """``nnx.BatchNorm`` whose batch statistics are taken over the global batch.

    The statistics are reduced over the replicas of whatever lowering runs the step (mean and
    mean of squares, with ``rp.replica_axis_name()``), so they equal those of the whole global
    batch on one device: the cross-replica BatchNorm of BigGAN. Under the local lowering, or
    outside any replicator, it is a plain ``nnx.BatchNorm``. It takes ``nnx.BatchNorm``'s
    arguments; any ``axis_name`` given is ignored.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> bn = CrossReplicaBatchNorm(3, rngs=nnx.Rngs(0))
    >>> bn(jnp.arange(6.0).reshape(2, 3)).shape
    (2, 3)
    """

    def __call__(self, x, *args, **kwargs):
        self.axis_name = replica_axis_name()
        return super().__call__(x, *args, **kwargs)
