"""One pipeline call as traced: its arguments checked and split, and the plan that runs.

`PipelineCall.from_arguments` builds what the schedules read from a call of ``value_and_grad``
or ``apply``, before any tick is traced: it refuses a batch that does not split into M
micro-batches, an M that the schedule cannot run on K stages, stage params that are not stacked
and sharded for the mesh, and a ``stage_fn`` that changes the activation's shape. It makes the
schedule's `Plan` once, for the schedules to run, and notes it for ``Replicator.explain``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src import tracing
from replicator._src.binding import current_binding
from replicator._src.mesh import STAGE_AXIS
from replicator._src.pipeline import schedules as schedules_lib
from replicator._src.pipeline.layers import StageFn, describe, same_shapes
from replicator._src.pipeline.ticks import take
from replicator._src.typing import PyTree


@dataclasses.dataclass(frozen=True)
class PipelineCall:
    """One traced pipeline call: the plan that runs, the micro-batched inputs and the stage rows."""

    plan: schedules_lib.Plan | None  # the tick tables that run; None without a stage axis
    num_stages: int  # K: the size of the stage axis in this program (1 without one)
    num_microbatches: int  # M
    rows: PyTree  # stage params as [rows, ...]: [V, ...] per device, or [S, ...] in order
    xs: PyTree  # inputs as [M, b, ...]
    ts: PyTree  # targets as [M, b, ...], or None
    param_shapes: PyTree  # the stage params' shapes as passed, to undo `rows`
    batch: int  # the per-replica batch B
    unroll: bool  # ticks as a Python loop instead of lax.scan

    @classmethod
    def from_arguments(
        cls, api: str, schedule: schedules_lib.Schedule, m: int, stage_fn: StageFn,
        stage_params: PyTree, inputs: PyTree, targets: PyTree, *, unroll: bool,
        asked: schedules_lib.Schedule | None = None,
    ) -> PipelineCall:  # fmt: skip
        """Checks a call's arguments and splits them for ``schedule``, the schedule that runs.

        Args:
          api: ``"value_and_grad"`` or ``"apply"``, for messages and the note.
          schedule: the schedule whose plan runs (and is noted for ``Replicator.explain``).
          m: the number of micro-batches M.
          stage_fn, stage_params, inputs, targets: the call's arguments (``targets`` is
            ``None`` for ``apply``).
          unroll: whether the ticks run as a Python loop.
          asked: the schedule the user passed, when another one runs (``apply`` runs the
            forward ticks of ``OneFOneB()``, which are GPipe's): the call refuses what it
            refuses, so that ``apply`` takes the arguments ``value_and_grad`` takes.

        Raises:
          ValueError: as `value_and_grad` says.
        """
        binding = current_binding()
        k = binding.axis_size(STAGE_AXIS) if binding.kind == "shard_map" else 1
        name = f"rp.pipeline.{api}"
        batch = _batch_size(name, inputs, targets)
        if batch % m:
            d = binding.num_replicas
            raise ValueError(
                f"{name}: the batch of {batch} examples per replica does not split into "
                f"num_microbatches={m} equal micro-batches. Use a global batch that is a "
                f"multiple of num_replicas x num_microbatches = {d} x {m} = {d * m} (e.g. "
                f"{d * m * max(1, round(batch * d / (d * m)))}), or another num_microbatches."
            )
        # Validates M against K, with the schedule's own message, before the other checks.
        if k > 1 and asked is not None and asked != schedule:
            asked.plan(k, m)
        plan = schedule.plan(k, m) if k > 1 else None
        rows = _stage_rows(name, stage_params, schedule.repeats, k)
        xs = _microbatch(inputs, m)
        if plan is not None:  # for Replicator.explain: one micro-batch's activation per tick
            sent = sum(a[0].size * a.dtype.itemsize for a in jax.tree.leaves(xs))
            note_plan(plan, sent, backward=api == "value_and_grad")
        call = cls(
            plan, k, m, rows, xs, _microbatch(targets, m),
            jax.tree.map(jnp.shape, stage_params), batch, unroll,
        )  # fmt: skip
        _check_stage_fn(name, stage_fn, call)
        return call

    def from_rows(self, g_rows: PyTree) -> PyTree:
        """Stage rows (or their gradients) in the layout of the stage params as passed."""
        return jax.tree.map(lambda g, shape: g.reshape(shape), g_rows, self.param_shapes)

    def merge_batch(self, tree: PyTree) -> PyTree:
        """Micro-batches ``[M, b, ...]`` back to the batch ``[B, ...]``."""
        return jax.tree.map(lambda a: a.reshape((self.batch, *a.shape[2:])), tree)


def note_plan(plan: schedules_lib.Plan, activation_bytes: int, *, backward: bool) -> None:
    """Notes ``plan`` for `Replicator.explain` (a no-op unless a report is being made)."""
    if not tracing.recording_pipelines():
        return
    tracing.note_pipeline(
        tracing.PipelineNote(
            schedule=plan.schedule,
            num_stages=plan.num_stages,
            num_microbatches=plan.num_microbatches,
            repeats=plan.repeats,
            ticks=plan.num_ticks,
            bubble_fraction=float(plan.bubble_fraction()),
            activation_bytes=int(activation_bytes),
            sends_per_step=(2 if backward else 1) * plan.num_ticks,
            picture=schedules_lib.render(plan, width=100),
        )
    )


def _batch_size(name: str, inputs, targets) -> int:
    sizes = {}
    for what, tree in (("inputs", inputs), ("targets", targets)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not hasattr(leaf, "shape") or not np.ndim(leaf):
                raise ValueError(
                    f"{name}: {what}{jax.tree_util.keystr(path)} must be an array with a leading "
                    f"batch axis; got {type(leaf).__name__} of shape {np.shape(leaf)}."
                )
            sizes[f"{what}{jax.tree_util.keystr(path)}"] = leaf.shape[0]
    if not sizes:
        raise ValueError(f"{name}: inputs has no arrays; pass the batch to pipeline.")
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{name}: every leaf of inputs and targets needs the same leading batch size; got "
            + ", ".join(f"{k}: {v}" for k, v in sizes.items())
            + "."
        )
    return next(iter(sizes.values()))


def _microbatch(tree: PyTree, m: int) -> PyTree:
    return jax.tree.map(lambda a: jnp.reshape(a, (m, a.shape[0] // m, *a.shape[1:])), tree)


def _stage_rows(name: str, stage_params: PyTree, repeats: int, k: int) -> PyTree:
    """The stage params as rows: ``[V, ...]`` on a stage device, ``[S, ...]`` in logical order
    without a stage axis."""
    want = "[K, ...]" if repeats == 1 else f"[{repeats}, K, ...]"
    spec = "P('stage')" if repeats == 1 else "P(None, 'stage')"
    leaves = jax.tree_util.tree_flatten_with_path(stage_params)[0]
    if not leaves:
        raise ValueError(f"{name}: stage_params has no arrays.")
    lead = 1 if repeats == 1 else 2
    for path, leaf in leaves:
        shape = np.shape(leaf)
        bad = len(shape) < lead or (repeats > 1 and shape[0] != repeats)
        if not bad and k > 1:
            bad = shape[lead - 1] != 1
        if bad:
            where = f"on each of the {k} stage devices" if k > 1 else "without a stage axis"
            raise ValueError(
                f"{name}: stage_params{jax.tree_util.keystr(path)} has shape {shape} {where}, "
                f"but the schedule (repeats={repeats}) needs stacked stage params {want}, "
                f"sharded over 'stage' so that each device holds one stage"
                f"{'' if repeats == 1 else ' per repeat'}. Build them with "
                f"rp.pipeline.stack_stages(layers, num_stages=K, repeats={repeats}) and place "
                f"them with NamedSharding(mesh, {spec}) (rp.pipeline.stage_spec({repeats}))."
            )
    if repeats == 1:
        return stage_params
    return jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), stage_params)


def _check_stage_fn(name: str, stage_fn: StageFn, call: PipelineCall) -> None:
    x = take(call.xs, 0)
    row = take(call.rows, 0)
    out = jax.eval_shape(stage_fn, row, x)
    want = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    if not same_shapes(out, want):
        raise ValueError(
            f"{name}: stage_fn must return an activation with the structure, shapes and dtypes "
            f"of its input, so that every stage can pass it on; for a micro-batch "
            f"{describe(want)} it returned {describe(out)}. Move shape changes (embedding, "
            f"head) outside the stages: into the inputs and into loss_fn."
        )
