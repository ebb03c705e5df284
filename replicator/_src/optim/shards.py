"""Which axes of a value are split over the mesh, and the collectives that gather and cut them.

A `Split` says, for a value a device holds, which of its axes is split over the replicas (a
1/N part of it on this device) and which over ``stage`` (a pipeline's stage block, 1/K). ZeRO
keeps every optimizer-state leaf in its own shape with such a split; `Comm` gathers a split axis
(an all-gather, tiled) or cuts a whole one (this device's part, no communication), and completes
a reduction over a split axis (an all-reduce), over the replicas or over the stages.

>>> local_shape((16, 24), Split(data=1), Comm(n=8))
(16, 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from replicator._src.core import collectives

GROUPS = ("data", "stage")  # the mesh axes a value's axes can be split over


@dataclasses.dataclass(frozen=True)
class Split:
    """Which axes of a value are split, on the device that holds it.

    Attributes:
      data: the axis split over the replicas (this device holds a 1/N part of it), or None
        when every replica holds the whole value.
      stage: the axis split over ``stage`` (a 1/K part: a pipeline's stage block), or None.
    """

    data: int | None = None
    stage: int | None = None

    def of(self, group: str) -> int | None:
        return getattr(self, group)


WHOLE = Split()


@dataclasses.dataclass
class Comm:
    """The communication `evaluate` uses: collectives inside a step, or shapes only
    (``abstract``) to find the layouts before a step is traced.

    Attributes:
      n: the number of replicas.
      k: the number of stages (the size of ``stage_axes``).
      stage_axes: the mesh axes stage blocks are split over (``("stage",)``).
      abstract: no collective is issued: gathers and cuts only change shapes (`jax.eval_shape`).
    """

    n: int
    k: int = 1
    stage_axes: tuple[str, ...] = ()
    abstract: bool = False

    def size(self, group: str) -> int:
        return self.n if group == "data" else self.k

    def reduce(self, x: jax.Array, op: str, group: str) -> jax.Array:
        if self.abstract:
            return x
        if group == "data":
            return collectives.all_reduce(x, op)
        over = {
            "sum": collectives.sum_over_axes,
            "max": collectives.max_over_axes,
            "min": collectives.min_over_axes,
        }[op]
        return over(x, self.stage_axes)

    def gather(self, x: jax.Array, dim: int, group: str) -> jax.Array:
        if self.abstract:
            return jnp.concatenate([x] * self.size(group), axis=dim)
        if group == "data":
            return collectives.gather_replicas(x, dim)
        return collectives.gather_over_axes(x, self.stage_axes, dim)

    def part(self, x: jax.Array, dim: int, group: str) -> jax.Array:
        x = jnp.asarray(x)
        if self.abstract:
            return lax.slice_in_dim(x, 0, x.shape[dim] // self.size(group), axis=dim)
        if group == "data":
            return collectives.replica_part(x, dim)
        return collectives.part_over_axes(x, self.stage_axes, dim)


def local_shape(shape: Sequence[int], split: Split, comm: Comm) -> tuple[int, ...]:
    """The shape of a device's part of a value of real ``shape`` split as ``split``."""
    shape = list(shape)
    for group in GROUPS:
        dim = split.of(group)
        if dim is not None:
            shape[dim] //= comm.size(group)
    return tuple(shape)
