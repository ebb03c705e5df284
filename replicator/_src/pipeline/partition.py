"""Building pipeline stages: stacking homogeneous layers, and balancing heterogeneous ones.

A pipeline's stages share one structure, so their parameters stack: `stack_stages` turns L
layers into K stages of L/K consecutive layers (or, for a circular schedule, K x V virtual
stages), laid out so that sharding one axis over the mesh's ``stage`` axis gives each device its
stages. `balance` answers the planning question for layers of unequal cost, in the style of
torchgpipe and PipeDream: which contiguous split into K stages has the cheapest slowest stage.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from replicator._src.core.errors import positive_int
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.typing import PyTree


def _as_stacked(layers) -> PyTree:
    """One pytree with a leading layer axis, from a list of layers or an already stacked tree."""
    api = "rp.pipeline.stack_stages"
    if isinstance(layers, list | tuple):
        if not layers:
            raise ValueError(f"{api}: layers is empty; pass at least one layer.")
        first_def = jax.tree.structure(layers[0])
        first = [(np.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(layers[0])]
        for i, layer in enumerate(layers[1:], 1):
            if jax.tree.structure(layer) != first_def:
                raise ValueError(
                    f"{api}: layer {i} has a different structure from layer 0 "
                    f"({jax.tree.structure(layer)} vs {first_def}); stages stack only layers "
                    f"of identical structure."
                )
            paths = jax.tree_util.tree_flatten_with_path(layer)[0]
            for (path, leaf), (shape, dtype) in zip(paths, first, strict=True):
                if (np.shape(leaf), jnp.result_type(leaf)) != (shape, dtype):
                    raise ValueError(
                        f"{api}: layer {i} leaf {jax.tree_util.keystr(path)} is "
                        f"{jnp.result_type(leaf)}{list(np.shape(leaf))}, but layer 0 has "
                        f"{dtype}{list(shape)}; stages stack only layers of identical shapes."
                    )
        return jax.tree.map(lambda *a: jnp.stack(a), *layers)
    leaves = jax.tree_util.tree_flatten_with_path(layers)[0]
    if not leaves:
        raise ValueError(f"{api}: layers has no arrays.")
    sizes = {jax.tree_util.keystr(p): (np.shape(a) or (None,))[0] for p, a in leaves}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(
            f"{api}: a stacked layers pytree needs the same leading layer axis on every leaf; "
            f"got {sizes}. Pass a list of per-layer pytrees instead."
        )
    return layers


def stack_stages(layers: Sequence[PyTree] | PyTree, num_stages: int, repeats: int = 1) -> PyTree:
    """Stacks L homogeneous layers into pipeline stages of consecutive layers.

    With S = ``num_stages * repeats`` logical stages of Lv = L / S layers each, logical stage j
    holds layers ``[j*Lv, (j+1)*Lv)``. Every leaf becomes ``[K, Lv, ...]`` (``repeats == 1``:
    row s is stage s) or ``[V, K, Lv, ...]`` (entry ``[r, s]`` is logical stage ``r*K + s``,
    which a circular schedule runs on device s as its r-th virtual stage). Shard the result with
    ``NamedSharding(mesh, stage_spec(repeats))``.

    Args:
      layers: a list of L per-layer pytrees of identical structure, shapes and dtypes, or one
        pytree whose leaves have a leading layer axis of size L.
      num_stages: K, the size of the mesh's ``stage`` axis.
      repeats: V, virtual stages per device (``Circular(repeats=V)``); 1 otherwise.

    Raises:
      ValueError: if L does not split into ``num_stages * repeats`` equal stages, or the layers
        differ in structure, shapes or dtypes.

    >>> import jax.numpy as jnp, replicator as rp
    >>> layers = [{"w": jnp.full((2, 2), i)} for i in range(8)]
    >>> rp.pipeline.stack_stages(layers, num_stages=4)["w"].shape
    (4, 2, 2, 2)
    >>> rp.pipeline.stack_stages(layers, num_stages=2, repeats=2)["w"][1, 0, :, 0, 0].tolist()
    [4, 5]
    """
    api = "rp.pipeline.stack_stages"
    positive_int(num_stages, api=api, name="num_stages")
    positive_int(repeats, api=api, name="repeats")
    stacked = _as_stacked(layers)
    n = jax.tree.leaves(stacked)[0].shape[0]
    s = num_stages * repeats
    if n % s:
        lo, hi = s * (n // s), s * math.ceil(n / s)
        near = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(
            f"{api}: {n} layers do not split into num_stages={num_stages} x repeats={repeats} "
            f"= {s} equal stages; use a multiple of {s} layers (e.g. {near}), another "
            f"num_stages, or see rp.pipeline.balance to plan a split of unequal layers."
        )
    lead = (num_stages,) if repeats == 1 else (repeats, num_stages)
    return jax.tree.map(lambda a: jnp.reshape(a, (*lead, n // s, *a.shape[1:])), stacked)


def unstack_stages(stacked: PyTree, repeats: int = 1) -> PyTree:
    """The inverse of `stack_stages`: one pytree with a leading layer axis, in model order.

    Args:
      stacked: `stack_stages`' output, ``[K, L/K, ...]`` (``[V, K, L/(V K), ...]`` with
        ``repeats``) leaves.
      repeats: the ``repeats`` it was stacked with.

    Returns:
      The tree with ``[L, ...]`` leaves.

    Raises:
      ValueError: if ``repeats`` is not an int >= 1.

    >>> import jax.numpy as jnp, replicator as rp
    >>> w = jnp.arange(8.0)
    >>> bool((rp.pipeline.unstack_stages(rp.pipeline.stack_stages(w, 2, repeats=2), 2) == w).all())
    True
    """
    positive_int(repeats, api="rp.pipeline.unstack_stages", name="repeats")
    lead = 2 if repeats == 1 else 3
    return jax.tree.map(lambda a: jnp.reshape(a, (-1, *jnp.shape(a)[lead:])), stacked)


def stage_spec(repeats: int = 1) -> PartitionSpec:
    """The ``PartitionSpec`` that shards `stack_stages` output over the ``stage`` mesh axis.

    On a mesh without a ``stage`` axis (``Replicator(lowering="local")``, ``{"data": 8}``),
    ``Replicator.place`` drops the axis and replicates the stages, and the pipeline runs them in
    order: the sequential model, so the same placement serves every mesh.

    Args:
      repeats: the ``repeats`` of `stack_stages` (virtual stages per device).

    Returns:
      ``P("stage")``, or ``P(None, "stage")`` with ``repeats > 1``.

    Raises:
      ValueError: if ``repeats`` is not an int >= 1.

    >>> import replicator as rp
    >>> rp.pipeline.stage_spec(), rp.pipeline.stage_spec(2)
    (P('stage',), P(None, 'stage'))
    """
    positive_int(repeats, api="rp.pipeline.stage_spec", name="repeats")
    return PartitionSpec(STAGE_AXIS) if repeats == 1 else PartitionSpec(None, STAGE_AXIS)


# -- balancing layers of unequal cost -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Partition:
    """A contiguous split of layers into stages, as `balance` makes it.

    Attributes:
      boundaries: ``K + 1`` layer indices: stage k holds ``[boundaries[k], boundaries[k+1])``.
      stage_costs: each stage's cost, the sum of its layers'.
      layer_costs: each layer's cost, as given.
    """

    boundaries: tuple[int, ...]
    stage_costs: tuple[float, ...]
    layer_costs: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        """K, the number of stages."""
        return len(self.stage_costs)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(int(b - a) for a, b in itertools.pairwise(self.boundaries))

    @property
    def max_cost(self) -> float:
        """The cost of the slowest stage, which sets the pipeline's pace."""
        return max(self.stage_costs)

    @property
    def imbalance(self) -> float:
        """``max_cost`` over the mean stage cost: 1.0 is perfectly balanced."""
        mean = sum(self.stage_costs) / self.num_stages
        return self.max_cost / mean if mean else 1.0

    def __str__(self) -> str:
        total = sum(self.stage_costs) or 1.0
        lines = [f"{'stage':>5}  {'layers':>9}  {'count':>5}  {'cost':>11}  share"]
        for k, (a, b) in enumerate(itertools.pairwise(self.boundaries)):
            cost = self.stage_costs[k]
            lines.append(
                f"{k:>5}  {f'{a}-{b - 1}':>9}  {b - a:>5}  {cost:>11.4g}  {cost / total:5.1%}"
            )
        lines.append(f"max stage cost {self.max_cost:.4g}, imbalance {self.imbalance:.3f}")
        return "\n".join(lines)


def balance(costs: Sequence[float], num_stages: int) -> Partition:
    """The contiguous split of layers into ``num_stages`` stages with the cheapest slowest stage.

    Exact dynamic programming over split points (O(K L^2)). Among optimal splits it takes the
    one whose first stage ends earliest, then the second, and so on: a deterministic choice.

    Args:
      costs: one non-negative cost per layer, in model order: FLOPs or seconds from
        `layer_costs`, or any estimate.
      num_stages: K; every stage gets at least one layer.

    Returns:
      The `Partition`; ``print`` it for a table of the stages.

    Raises:
      ValueError: if ``costs`` is empty, negative or not finite, or there are fewer layers
        than stages.

    >>> import replicator as rp
    >>> p = rp.pipeline.balance([1, 1, 1, 1, 4, 4], num_stages=2)
    >>> p.boundaries, p.stage_costs
    ((0, 4, 6), (4.0, 8.0))
    >>> print(rp.pipeline.balance([3, 1, 1, 1, 2, 2], num_stages=3))
    stage     layers  count         cost  share
        0        0-0      1            3  30.0%
        1        1-3      3            3  30.0%
        2        4-5      2            4  40.0%
    max stage cost 4, imbalance 1.200
    """
    api = "rp.pipeline.balance"
    positive_int(num_stages, api=api, name="num_stages")
    c = np.asarray(list(costs), dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"{api}: costs must be a non-empty list of per-layer costs.")
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"{api}: costs must be finite and >= 0; got {c.tolist()}.")
    n = c.size
    if num_stages > n:
        raise ValueError(
            f"{api}: num_stages={num_stages} is more than the {n} layers; every stage needs "
            f"at least one layer."
        )
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    # best[k][i]: the smallest max stage cost splitting the last n-i layers into k stages, and
    # cut[k][i] the end of the first of them (the earliest, among ties).
    best = np.full((num_stages + 1, n + 1), np.inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0][n] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(n - k, -1, -1):
            for j in range(i + 1, n - k + 2):
                value = max(prefix[j] - prefix[i], best[k - 1][j])
                if value < best[k][i] and not np.isclose(value, best[k][i], rtol=1e-12):
                    best[k][i], cut[k][i] = value, j
    bounds, i = [0], 0
    for k in range(num_stages, 0, -1):
        i = int(cut[k][i])
        bounds.append(i)
    stage = tuple(float(prefix[b] - prefix[a]) for a, b in itertools.pairwise(bounds))
    return Partition(tuple(bounds), stage, tuple(float(x) for x in c))
