"""One pipeline call as traced: its arguments checked and split, and the plan that runs.

`PipelineCall.from_arguments` builds what the schedules read from a call of ``value_and_grad``
or ``apply``, before any tick is traced: it refuses a batch that does not split into M
micro-batches, an M that the schedule cannot run on K stages, stage params that are not stacked
and sharded for the mesh, and a ``stage_fn`` that changes the activation's shape. It makes the
schedule's `Timetable` once, for the schedules to run, and notes it for ``Replicator.explain`` with
the step time it would take on K parallel devices, modelled from each stage's measured FLOPs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.core import tracing
from replicator._src.core.binding import current_binding
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.packing import Packing
from replicator._src.core.typing import PyTree
from replicator._src.pipeline import costs as costs_lib
from replicator._src.pipeline import pictures, timing, whole_grads
from replicator._src.pipeline import schedules as schedules_lib
from replicator._src.pipeline.layer_stack import (
    Program,
    StageFn,
    as_layers,
    describe,
    layers_as_rows,
    same_shapes,
)
from replicator._src.pipeline.residuals import Remat
from replicator._src.pipeline.stages import SequentialStages
from replicator._src.pipeline.ticks import take


@dataclasses.dataclass(frozen=True)
class PipelineCall:
    """One traced pipeline call: the plan that runs, the micro-batched inputs and the stage rows."""

    plan: schedules_lib.Timetable | None  # the tick tables that run; None without a stage axis
    num_stages: int  # K: the size of the stage axis in this program (1 without one)
    num_microbatches: int  # M
    rows: PyTree  # stage params as [rows, ...]: [V, ...] per device, or [S, ...] in order
    xs: PyTree  # inputs as [M, b, ...]
    ts: PyTree  # targets as [M, b, ...], or None
    param_shapes: PyTree  # the stage params as passed (ShapeDtypeStructs), to undo `rows`
    batch: int  # the per-replica batch B
    unroll: bool  # ticks as a Python loop instead of lax.scan
    stage_fn: StageFn  # the call's stage_fn, or a `SequentialStages` model
    wire: Packing | None = None  # a SequentialStages's activations at its stage boundaries
    scatter_grads: str = "microbatch"  # ZeRO-3's stage gradients: "microbatch" or "step"

    def program(self, rows: PyTree) -> Program:
        """What the schedules run on this stage, for stage rows ``rows`` (``call.rows`` or a
        traced stand-in for them)."""
        if isinstance(self.stage_fn, SequentialStages):
            return self.stage_fn.program(rows, self.wire)
        return as_layers(self.stage_fn, rows)

    def layers_as_rows(self, layers: PyTree, shared: PyTree) -> PyTree:
        """The inverse of `program`'s layout: gradients of the layers ``[V, Lv, ...]`` and of
        the shared parameters ``[V, ...]`` as gradients of the rows."""
        if isinstance(self.stage_fn, SequentialStages):
            return self.stage_fn.params_layout.as_rows(layers, shared)
        return layers_as_rows(self.stage_fn, layers)

    @classmethod
    def from_arguments(
        cls, api: str, schedule: schedules_lib.Schedule, m: int, stage_fn: StageFn,
        stage_params: PyTree, inputs: PyTree, targets: PyTree, *, unroll: bool,
        asked: schedules_lib.Schedule | None = None, remat: Remat | None = None,
        scatter_grads: str = "microbatch",
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
          remat: the call's remat policy, for the measured costs of the note.
          scatter_grads: ``"step"`` to hold ZeRO-3's stage gradients whole over the ticks and
            reduce-scatter them once (`whole_grads`); noted with what it holds.

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
            asked.timetable(k, m)
        plan = schedule.timetable(k, m) if k > 1 else None
        xs = _microbatch(inputs, m)
        wire = None
        if isinstance(stage_fn, SequentialStages):
            wire = _check_model(name, stage_fn, schedule.repeats, k, stage_params, xs, api)
        rows = _stage_rows(name, stage_params, schedule.repeats, k)
        call = cls(
            plan, k, m, rows, xs, _microbatch(targets, m),
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), stage_params),
            batch, unroll, stage_fn, wire, scatter_grads,
        )  # fmt: skip
        if wire is None:
            _check_stage_fn(name, stage_fn, call)
        if plan is not None:  # for Replicator.explain: one micro-batch's activation per tick
            sent = sum(a[0].size * a.dtype.itemsize for a in jax.tree.leaves(xs))
            if wire is not None:
                sent = wire.buffer_bytes()
            note_plan(plan, sent, backward=api == "value_and_grad",
                      padding=_padding(stage_fn, wire), stage_fn=stage_fn,
                      stage_params=stage_params, example_input=take(xs, 0),
                      remat=remat, held=_held(call, schedule))  # fmt: skip
        return call

    def from_rows(self, g_rows: PyTree) -> PyTree:
        """Stage rows (or their gradients) in the layout of the stage params as passed."""
        shapes, treedef = jax.tree.flatten(self.param_shapes)
        rows = jax.tree.leaves(g_rows)
        return jax.tree.unflatten(
            treedef, [g.reshape(a.shape) for a, g in zip(shapes, rows, strict=True)]
        )

    def merge_batch(self, tree: PyTree) -> PyTree:
        """Micro-batches ``[M, b, ...]`` back to the batch ``[B, ...]``."""
        return jax.tree.map(lambda a: a.reshape((self.batch, *a.shape[2:])), tree)


def note_plan(
    plan: schedules_lib.Timetable,
    activation_bytes: int,
    *,
    backward: bool,
    padding: str = "",
    stage_fn: StageFn | None = None,
    stage_params: PyTree = None,
    example_input: PyTree = None,
    remat: Remat | None = None,
    held: tuple = ((), ()),
) -> None:
    """Notes ``plan`` for `Replicator.explain` (a no-op unless a report is being made).

    With ``stage_fn`` (a ``stage_fn`` of identical stages or a `SequentialStages`), its stage params
    as passed (one device's, inside the mesh) and one micro-batch's input, the note also holds
    the step time modelled on K parallel devices (`timing.step_time`) from each stage's FLOPs
    (`costs.stage_costs`, under the call's ``remat`` policy), and with equal costs. A
    forward-only call (``backward=False``) is modelled with backward passes that cost nothing.
    A stage whose FLOPs cannot be measured (e.g. one that compiles to a loop) leaves the
    equal-cost model and the reason in the note. ``held``: the ``(dtype, shape)`` of each
    whole stage gradient and gathered stage weight a device holds for the step (`_held`).
    """
    if not tracing.recording_pipelines():
        return
    n = plan.num_stages * plan.repeats
    equal = _forward_only(timing.StageCosts.equal(n), backward)
    measured, why = None, "no stage function given"
    if stage_fn is not None and not tracing.measuring_stages():
        why = "not measured (explain(..., stage_costs=False))"
    elif stage_fn is not None:
        measured, why = _measured_costs(
            plan, stage_fn, stage_params, example_input, backward, remat
        )
    at_equal = timing.step_time(plan, equal)
    shown = at_equal if measured is None else timing.step_time(plan, measured)
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
            picture=pictures.render(plan, width=100),
            padding=padding,
            modelled_time=shown.time,
            modelled_bubble=shown.bubble_fraction,
            dataflow_time=shown.dataflow_time,
            cost_unit=shown.unit,
            stage_costs=measured,
            equal_time=at_equal.time,
            equal_bubble=at_equal.bubble_fraction,
            cost_note="" if measured is not None else why,
            held_grads=held[0],
            held_weights=held[1],
        )
    )


def _measured_costs(
    plan: schedules_lib.Timetable, stage_fn: StageFn, stage_params: PyTree, x: PyTree, backward: bool,
    remat: Remat | None,
) -> tuple[timing.StageCosts | None, str]:  # fmt: skip
    """Each logical stage's FLOPs on one micro-batch ``x`` (backward passes at 0 unless
    ``backward``), or None and the reason they could not be measured. ``stage_params`` are one
    device's (``[1, ...]`` or ``[V, 1, ...]``) inside the mesh: the stack of K stages is rebuilt
    from their shapes. Each pass compiles on its own, outside the mesh being traced."""
    v, k = plan.repeats, plan.num_stages
    try:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            if isinstance(stage_fn, SequentialStages):
                layout = stage_fn.params_layout
                params = [layout.abstract(j) for j in range(len(stage_fn))]
                measured = costs_lib.stage_costs(
                    list(stage_fn.fns), params, x, method="flops", remat=remat or "full"
                )
            else:
                lead = (k,) if v == 1 else (v, k)
                stacked = jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(
                        (*lead, *np.shape(a)[len(lead) :]), jnp.result_type(a)
                    ),
                    stage_params,
                )
                measured = costs_lib.stage_costs_stacked(
                    stage_fn, stacked, x, virtual_stages=v, method="flops", remat=remat or "full"
                )
        measured = _forward_only(measured, backward)
        timing.step_time(plan, measured)  # refuses costs that make the step take no time
    except Exception as e:  # a report never fails on a stage it cannot measure
        first = (str(e).strip().splitlines() or [""])[0]
        if isinstance(e, ValueError) and first.startswith(("rp.pipeline.", "step_time:")):
            return None, first  # the library's own refusal says why and what to do
        return None, (
            f"the stages could not be compiled on their own, outside the mesh "
            f"({type(e).__name__}{': ' + first if first else ''}); a stage that calls "
            f"collectives (such as rp.gather_params for ZeRO-3) cannot be measured alone"
        )
    return measured, ""


def _held(call: PipelineCall, schedule: schedules_lib.Schedule) -> tuple[tuple, tuple]:
    """What ``scatter_grads="step"`` holds for the step on each device: the whole stage's
    gradients, and with GPipe and Circular (gathered once a step) its weights; ``((), ())``
    otherwise."""
    if call.scatter_grads != "step" or not whole_grads.has_split(call.rows):
        return (), ()
    grads = whole_grads.device_shapes(call.rows)
    return grads, grads if schedule.name in ("gpipe", "circular") else ()


def _forward_only(costs: timing.StageCosts, backward: bool) -> timing.StageCosts:
    """``costs`` with backward passes that cost nothing, for a forward-only call."""
    if backward:
        return costs
    zero = (0.0,) * costs.num_stages
    return dataclasses.replace(costs, backward_input=zero, backward_weight=zero, backward=zero)


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


def _check_model(
    name: str,
    model: SequentialStages,
    repeats: int,
    k: int,
    stage_params: PyTree,
    xs: PyTree,
    api: str,
) -> Packing:
    """Refuses a `SequentialStages` that does not fit the mesh or the schedule; its activations' layout."""
    if model.repeats != repeats:
        raise ValueError(
            f"{name}: the model was built with repeats={model.repeats} but the schedule runs "
            f"{repeats} virtual stage(s) per device; build it with "
            f"rp.pipeline.sequential(..., repeats={repeats}) or use a matching schedule."
        )
    if k > 1 and model.num_stages != k:
        raise ValueError(
            f"{name}: the model has {len(model)} stages = {model.num_stages} per repeat, but the "
            f"mesh's 'stage' axis has {k} devices; use a mesh with 'stage': {model.num_stages}, "
            f"or split the model into {k * repeats} stages."
        )
    keys = sorted(model.params_layout.sizes)
    if not isinstance(stage_params, dict) or sorted(stage_params) != keys:
        raise ValueError(
            f"{name}: with a SequentialStages model, stage_params must be its packed parameters, "
            f"a dict with keys {keys} as model.pack(params) returns; got "
            f"{describe(stage_params) if hasattr(stage_params, 'keys') else type(stage_params).__name__}."
        )
    for key, n in model.params_layout.sizes.items():
        if np.shape(stage_params[key])[-1] != n:
            raise ValueError(
                f"{name}: stage_params[{key!r}] has shape {np.shape(stage_params[key])}, but "
                f"this model packs each stage into rows of {n}; pass model.pack(params) of the "
                f"same model."
            )
    if api == "value_and_grad":
        _check_packed_by(name, model, stage_params)
    shapes = model.boundaries(take(xs, 0))
    b = jax.tree.leaves(xs)[0].shape[1]
    # The batch axis must follow the micro-batch: shapes at b, and at b + 1 when they trace.
    grown = jax.tree.map(lambda a: jax.ShapeDtypeStruct((b + 1, *a.shape[2:]), a.dtype), xs)
    try:
        at_b1 = model.boundaries(grown)
    except ValueError:
        at_b1 = None
    for k, tree in enumerate(shapes[1:], 1):
        leads = [(leaf.shape or (None,))[0] for leaf in jax.tree.leaves(tree)]
        if at_b1 is not None:
            leads += [(a.shape or (None,))[0] - 1 for a in jax.tree.leaves(at_b1[k])]
        for lead in leads:
            if lead != b:
                raise ValueError(
                    f"{name}: stage {k - 1} returns {describe(tree)}, but every stage must map "
                    f"one micro-batch of {b} examples to outputs with that leading axis: a "
                    f"stage that pools or reshapes over the batch would see micro-batches, not "
                    f"the batch, and give another result than the model on one device. Keep "
                    f"the batch axis first and leave batch reductions to loss_fn."
                )
    return model.wire(take(xs, 0))


def _check_packed_by(name: str, model: SequentialStages, stage_params: dict) -> None:
    """Refuses rows that do not carry ``model`` (or a model of the same stages): the
    optimizer reads each stage's tree from the model the rows carry."""
    packer = getattr(stage_params, "model", None)
    if packer is None:
        raise ValueError(
            f"{name}: stage_params is a plain dict of packed rows; pass model.pack(params) as "
            f"it returns it (a PackedStages, which jax.tree.map, repl.place and checkpoints "
            f"keep), so that the gradients carry the model and the optimizer updates each "
            f"stage's own tree (a plain dict would show it one buffer per stage)."
        )
    same = packer is model or (
        len(packer) == len(model)
        and all(
            jax.tree.structure(packer.abstract_stage(j))
            == jax.tree.structure(model.abstract_stage(j))
            and jax.tree.leaves(packer.abstract_stage(j))
            == jax.tree.leaves(model.abstract_stage(j))
            for j in range(len(model))
        )
    )
    if not same:
        raise ValueError(
            f"{name}: stage_params were packed by another pipeline.sequential model, whose "
            f"stages have other parameters; pass model.pack(params) of this model."
        )


def _padding(stage_fn: StageFn, wire: Packing | None) -> str:
    """For ``Replicator.explain``: what a `SequentialStages` model's packing costs in padding."""
    if wire is None:
        return ""
    params = stage_fn.params_layout
    used = [wire.used_bytes(j) for j in range(len(wire))]
    return (
        f"stages packed: parameters {params.buffer_bytes():,} bytes per stage row, of which "
        f"{params.padding_bytes():,} bytes padding over all {len(params)} stages; activations "
        f"{wire.buffer_bytes():,} bytes per micro-batch (boundaries use {min(used):,}-"
        f"{max(used):,})"
    )
