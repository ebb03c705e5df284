"""`ZeroPlan`: where ZeRO keeps each leaf, and whether the optimizer's update runs on shards.

Made by ``Zero.layout`` before a step runs (``opt.plan(params)``, and at ``opt.init``, which
warns when some of the update gathers): for each parameter and state leaf, its shape, its
``PartitionSpec``, the axis split over the replicas (or why it is whole) and its bytes on one
device; and each operation of the update that gathers its operands.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from replicator._src.core import tracing
from replicator._src.core.sharded_params import ShardedParam, is_sharded_param
from replicator._src.core.typing import PyTree
from replicator._src.optim import shards, zero_layout


@dataclasses.dataclass(frozen=True)
class PlanLeaf:
    """A leaf in ZeRO's layout, in `ZeroPlan`.

    Attributes:
      path: where it is (``params['w']``, ``opt[0].mu['w']``).
      shape: its shape (global, as on one device).
      dtype: its dtype.
      spec: its ``PartitionSpec`` on the mesh.
      split: the axis split over the replicas (for a parameter ZeRO-1/2 keep whole: the axis
        its gradient is reduce-scattered along), or None when it is whole on every replica.
      why_whole: for a whole leaf: ``"no axis divides"`` by the replicas, ``"reduced"``
        (computed whole by the update: a statistic reduced over a split axis, such as
        Adafactor's column means) or ``"scalar"``; empty for a split leaf.
      device_bytes: its bytes on one device.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec
    split: int | None
    why_whole: str
    device_bytes: int


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Where ZeRO keeps each leaf and how the optimizer's update runs, known before a step.

    Attributes:
      zero_stage: 1, 2 or 3.
      num_replicas: N.
      params: the parameters (their layout with ZeRO-3, else where their state is split).
      state: the optimizer state's leaves.
      gathered: each operation of the update that gathers a split value over the replicas to
        run on whole arrays (exact, and whole during that operation only); empty when the update
        runs on shards.
    """

    zero_stage: int
    num_replicas: int
    params: tuple[PlanLeaf, ...]
    state: tuple[PlanLeaf, ...]
    gathered: tuple[str, ...]

    @property
    def on_shards(self) -> bool:
        """The whole update runs on each replica's parts (nothing is gathered for it)."""
        return not self.gathered

    @property
    def whole_params(self) -> tuple[PlanLeaf, ...]:
        """Parameters with no axis that divides by the replicas, kept whole on every replica."""
        return tuple(p for p in self.params if p.why_whole == "no axis divides")

    def __str__(self) -> str:
        lines = [
            f"ZeRO-{self.zero_stage} over {self.num_replicas} replicas: the update runs "
            + ("on shards" if self.on_shards else f"on shards, but gathers for "
               f"{len(self.gathered)} operation(s)")
        ]  # fmt: skip
        for title, leaves in (("parameters", self.params), ("optimizer state", self.state)):
            lines.append(f"{title}:")
            for leaf in leaves:
                where = f"axis {leaf.split} over the replicas" if leaf.split is not None else (
                    f"whole ({leaf.why_whole})")  # fmt: skip
                if title == "parameters" and self.zero_stage < 3 and leaf.split is not None:
                    where = f"gradient: axis {leaf.split}"  # the parameter itself is whole
                lines.append(
                    f"  {leaf.path:<40} {leaf.dtype}{list(leaf.shape)!s:<18} {where:<34} "
                    f"{leaf.device_bytes} B/device"
                )
        for g in self.gathered:
            lines.append(f"gathered: {g}")
        return "\n".join(lines)


def make(
    zero, params: PyTree, leaves: list, s_paths: list, specs: list, s_splits: list, gathered
) -> ZeroPlan:
    """The `ZeroPlan` of ``zero`` (a `zero.Zero`) for global ``params`` and their layout
    ``leaves``, and the state leaves (``s_paths``: ``(path, aval)``) with their ``specs`` and
    split axes ``s_splits``; ``gathered`` as `sharded_eval.evaluate` notes them."""

    def device_bytes(shape, dtype, spec) -> int:
        sharding = NamedSharding(zero.mesh, spec)
        return zero_layout.leaf_bytes(sharding.shard_shape(tuple(shape)), dtype)

    p_rows = []
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded_param)[0]
    for (path, x), leaf in zip(flat, leaves, strict=True):
        value = x.value if isinstance(x, ShardedParam) else x
        shape = tuple(np.shape(value))
        spec = zero_layout.spec_of(value) or PartitionSpec()
        why = "" if leaf.data is not None else "scalar" if math.prod(shape) <= 1 else (
            "no axis divides")  # fmt: skip
        p_rows.append(
            PlanLeaf(
                f"params{jax.tree_util.keystr(path)}", shape, str(jnp.result_type(value)),
                spec, leaf.data, why, device_bytes(shape, jnp.result_type(value), spec),
            )
        )  # fmt: skip
    s_rows = []
    for (path, a), spec, split in zip(s_paths, specs, s_splits, strict=True):
        shape = tuple(a.shape)
        why = ""
        if split is None:  # whole: no axis to split, or computed by a reduction over one
            divides = zero_layout.split_dim(shape, spec, zero.n) is not None
            why = "scalar" if math.prod(shape) <= 1 else (
                "reduced" if divides else "no axis divides")  # fmt: skip
        s_rows.append(
            PlanLeaf(
                f"opt{jax.tree_util.keystr(path)}", shape, str(a.dtype), spec, split,
                why, device_bytes(shape, a.dtype, spec),
            )
        )  # fmt: skip
    return ZeroPlan(zero.stage, zero.n, tuple(p_rows), tuple(s_rows), tuple(gathered))


def warn_if_gathered(plan: ZeroPlan) -> None:
    """Warns, at ``init``, that some of the update runs on gathered arrays, and which.

    The warning points at the user's ``opt.init``: the caller of `DistributedOptimizer.init`,
    which calls the loss-scale wrapper's ``init``, which calls `zero_transforms.sharded_update`'s.
    """
    if plan.on_shards:
        return
    ops = "; ".join(plan.gathered[:3]) + ("; ..." if len(plan.gathered) > 3 else "")
    warnings.warn(
        f"wrap_optimizer(zero_stage={plan.zero_stage}): the optax transformation is not "
        f"computed on shards everywhere: {len(plan.gathered)} operation(s) gather their "
        f"operands over the replicas and run on whole arrays, gathered for each step: {ops}. "
        f"This is exact; the state stays sharded, and is whole on every device during those "
        f"operations only. Element-wise operations, reductions and products run on shards; "
        f"see opt.plan(params) and 'What is exact, and what is refused' in docs/design.md.",
        stacklevel=5,
    )


def note(zero, leaves: list, gathered: list[str]) -> tracing.ZeroNote:
    """The `tracing.ZeroNote` of one traced update of ``zero`` on parameters ``leaves``."""
    whole = [leaf for leaf in leaves if leaf.data is None and math.prod(leaf.shape) > 1]
    block = lambda leaf: shards.local_shape(leaf.shape, shards.Split(None, leaf.stage), zero.comm)
    return tracing.ZeroNote(
        zero_stage=zero.stage,
        num_replicas=zero.n,
        split_leaves=sum(leaf.data is not None for leaf in leaves),
        whole_leaves=len(whole),
        whole_bytes=sum(zero_layout.leaf_bytes(block(leaf), leaf.dtype) for leaf in whole),
        gathered=tuple(gathered),
    )
