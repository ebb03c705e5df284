"""The pipeline engine: one ``lax.scan`` over the ticks of a schedule, inside ``step_fn``.

Called inside a ``step_fn`` that ``Replicator.run`` traces over a mesh with a ``stage`` axis of
size K, each device runs one stage: it reads its row of the schedule's tables (`schedules.Plan`)
at every tick, runs ``stage_fn`` on a micro-batch, and passes the activation to the next stage
with ``lax.ppermute``. Gradients are per replica, like everything in ``step_fn``: they are not
reduced over the data axes (``wrap_optimizer`` does that), but they are complete over the
stages: the loss, the gradients of the head and of the inputs are summed over ``stage`` so that
every stage holds them, and each stage holds the gradient of its own stage parameters.

Without a ``stage`` axis (the local lowering, a mesh of data axes only, or outside any
``Replicator``) the same call runs every stage in order on each micro-batch: a scan over the
micro-batches of a scan over the layers. This is the single-device meaning of a pipeline call.

The scans step one *layer* per iteration: a stage built with `scan_layers` exposes its layers
(any other ``stage_fn`` counts as one layer), and a tick is Lv iterations. The compiled program is
then the same whatever the number of layers per stage, with no loop nested in another. Two
engines share the tick tables:

* GPipe and Circular run the forward in a scan and get the backward from ``jax.vjp`` of that
  scan (the forward replayed in reverse). Stages compute through the bubbles; with ``remat``
  only each layer's input is kept per iteration, never a copy of the parameters.
* 1F1B runs forward and backward in the same scan: a tick is Lv forward iterations, then Lv
  backward iterations in reverse layer order, each under ``lax.cond`` so that idle halves cost
  nothing. The backward recomputes each layer from its stashed input, and the stash is a ring of
  ``2K-1`` micro-batches' layer inputs, whatever the number of micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from replicator._src import tracing
from replicator._src.binding import current_binding
from replicator._src.errors import positive_int
from replicator._src.mesh import STAGE_AXIS
from replicator._src.pipeline import schedules as schedules_lib
from replicator._src.typing import PyTree

_PARAMS = "rp_pipeline_layer_params"

StageFn = Callable[[PyTree, PyTree], PyTree]
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]


# -- public entry points ------------------------------------------------------------------------


def value_and_grad(
    stage_fn: StageFn,
    loss_fn: LossFn,
    /,
    *,
    num_microbatches: int,
    schedule: Any = "gpipe",
    remat: bool = True,
    unroll: bool = False,
) -> Callable[..., tuple[jax.Array, tuple[PyTree, PyTree, PyTree]]]:
    """The loss of a pipelined model and its gradients, micro-batched over a schedule.

    The model is ``loss_fn(head_params, stage_S-1(... stage_0(inputs)), targets)``, where stage
    ``j`` is ``stage_fn(stage_params[j], x)`` and ``stage_fn`` keeps the shape of ``x``. The
    batch is split into ``num_microbatches`` equal micro-batches along its first axis, and the
    loss is the mean of ``loss_fn`` over them (the full-batch mean when ``loss_fn`` is a mean).

    Equivalent to (the sequential meaning, which is what runs without a ``stage`` axis)::

        losses = []
        for x, t in zip(split(inputs, M), split(targets, M)):
            for j in range(S):                      # S = num_stages * repeats, logical order
                x = stage_fn(stage_params[j], x)
            losses.append(loss_fn(head_params, x, t))
        loss = mean(losses)                         # and its gradients

    Args:
      stage_fn: ``stage_fn(one_stage_params, x) -> x``, one stage; ``x`` is a pytree of arrays
        with a leading micro-batch axis, and the output has the same structure and shapes.
      loss_fn: ``loss_fn(head_params, y, targets) -> scalar``, the mean loss of one micro-batch
        (``head_params`` is ``None`` when the call passes none).
      num_microbatches: M, the number of micro-batches per replica's batch.
      schedule: ``rp.pipeline.GPipe()``, ``Circular(repeats=V)``, ``OneFOneB()``, or their
        names ``"gpipe"``, ``"circular"``, ``"1f1b"``.
      remat: recompute each layer in the backward pass from its input instead of keeping its
        activations (for GPipe and Circular; 1F1B always recomputes from the stashed input).
      unroll: run the ticks as a Python loop instead of a ``lax.scan``, for debugging: the same
        tick body, one traced copy per tick (``jax.debug.print`` in ``stage_fn`` then shows every
        tick in order). Compile time grows with the number of ticks.

    Returns:
      ``f(stage_params, inputs, targets, head_params=None) -> (loss, (g_stages, g_inputs,
      g_head))``. ``stage_params`` are stacked as `stack_stages` builds them and, on a mesh with
      a ``stage`` axis, sharded over it with `stage_spec`; ``g_stages`` has their layout (each
      stage its own rows), while ``loss``, ``g_inputs`` and ``g_head`` are the same on every
      stage. All are per replica: reduce them over replicas as any gradient in ``step_fn``.

    Raises:
      ValueError: when the batch does not split into M micro-batches, the schedule needs more
        micro-batches, the stage parameters are not laid out for the mesh, or ``stage_fn``
        changes the activation's shape.

    Example (no ``stage`` axis: the sequential meaning):

    >>> import jax.numpy as jnp, replicator as rp
    >>> stage = lambda w, x: jnp.tanh(x @ w)
    >>> loss = lambda _, y, t: jnp.mean((y - t) ** 2)
    >>> f = rp.pipeline.value_and_grad(stage, loss, num_microbatches=2)
    >>> w = jnp.stack([jnp.eye(3)] * 4)          # 4 stages
    >>> l, (gw, gx, _) = f(w, jnp.ones((4, 3)), jnp.zeros((4, 3)))
    >>> gw.shape, gx.shape
    ((4, 3, 3), (4, 3))
    """
    sched = schedules_lib.get(schedule)
    _check_common(num_microbatches, remat, "value_and_grad", unroll)
    if sched.name == "1f1b" and not remat:
        raise ValueError(
            "rp.pipeline.value_and_grad: OneFOneB() always recomputes each layer from its "
            "stashed input in the backward pass; remat=False is not available for it. Use "
            "remat=True, or GPipe()/Circular() with remat=False to keep activations instead."
        )

    def f(stage_params, inputs, targets, head_params=None):
        call = _Call.make(
            "value_and_grad", sched, num_microbatches, stage_fn, stage_params, inputs, targets
        )
        call.unroll = unroll
        if call.num_stages == 1:
            return _sequential_value_and_grad(call, stage_fn, loss_fn, head_params, remat)
        if sched.name == "1f1b":
            loss, g_rows, g_xs, g_head = _one_f_one_b(call, stage_fn, loss_fn, head_params)
        else:
            loss, g_rows, g_xs, g_head = _scanned_vjp(call, stage_fn, loss_fn, head_params, remat)
        loss, g_xs, g_head = lax.psum((loss, g_xs, g_head), STAGE_AXIS)
        return loss, (call.from_rows(g_rows), call.merge_batch(g_xs), g_head)

    return f


def apply(
    stage_fn: StageFn,
    /,
    *,
    num_microbatches: int,
    schedule: Any = "gpipe",
    unroll: bool = False,
) -> Callable[[PyTree, PyTree], PyTree]:
    """The forward pass of a pipelined model, for evaluation: ``f(stage_params, inputs) -> y``.

    ``y`` is the output of the last stage for the whole batch, on every stage. Equivalent to
    running every stage in order on each micro-batch (see `value_and_grad`); a ``OneFOneB()``
    schedule runs its forward ticks, which are GPipe's.

    >>> import jax.numpy as jnp, replicator as rp
    >>> f = rp.pipeline.apply(lambda w, x: x @ w, num_microbatches=2)
    >>> f(jnp.stack([2 * jnp.eye(2)] * 3), jnp.ones((4, 2)))[0]
    Array([8., 8.], dtype=float32)
    """
    sched = schedules_lib.get(schedule)
    _check_common(num_microbatches, True, "apply", unroll)
    forward_sched = schedules_lib.GPipe() if sched.name == "1f1b" else sched

    def f(stage_params, inputs):
        call = _Call.make("apply", sched, num_microbatches, stage_fn, stage_params, inputs, None)
        call.unroll = unroll
        if call.num_stages == 1:
            ys = _sequential_outputs(call, stage_fn, call.rows, call.xs)
        else:
            plan = forward_sched.plan(call.num_stages, num_microbatches)
            _, ys = _forward_ticks(
                call, plan, stage_fn, None, None, call.rows, None, call.xs, remat=False
            )
            ys = lax.psum(ys, STAGE_AXIS)
        return call.merge_batch(ys)

    return f


def scan_layers(layer_fn: Callable[[PyTree, PyTree], PyTree], /) -> StageFn:
    """A ``stage_fn`` that applies ``layer_fn`` once per layer of its stage, as a ``lax.scan``.

    With stage parameters stacked as ``[layers_per_stage, ...]`` (what `stack_stages` gives each
    stage), compile time does not grow with the number of layers per stage. The pipeline engine
    also sees the layers: it steps through them one per iteration of its own scan, so that the
    compiled program is the same whatever the number of layers per stage, and 1F1B recomputes
    one layer at a time in the backward pass.

    Equivalent to: ``for p in stage_params: x = layer_fn(p, x)`` (``p``: one row of each leaf).

    Raises:
      ValueError: when the stage is called (or traced by the pipeline), if ``layer_fn`` returns
        an activation whose structure, shapes or dtypes differ from its input's, checked with
        ``jax.eval_shape`` on one layer before the scan.

    >>> import jax.numpy as jnp, replicator as rp
    >>> stage = rp.pipeline.scan_layers(lambda w, x: x @ w)
    >>> stage(jnp.stack([2 * jnp.eye(2)] * 3), jnp.ones((1, 2)))
    Array([[8., 8.]], dtype=float32)
    """
    return _ScanLayers(layer_fn)


_LAYER_CHANGES_SHAPE = (
    "rp.pipeline.scan_layers({name}): layer_fn maps an activation {want} to {got}. The layers "
    "of a stage run one after another in a lax.scan that carries the activation from layer to "
    "layer (and the pipeline passes it on from stage to stage), so every layer in a stack must "
    "map activations to the same shape and dtype. Put layers that change the width, such as an "
    "embedding or a head, outside the stages: the embedding on the inputs before the pipeline "
    "call, the head in loss_fn."
)


class _ScanLayers:
    """A stage made of layers of one structure; see `scan_layers`."""

    def __init__(self, layer_fn: Callable[[PyTree, PyTree], PyTree]) -> None:
        self.layer_fn = layer_fn

    def __call__(self, stage_params: PyTree, x: PyTree) -> PyTree:
        self.check_layer(stage_params, x)
        return lax.scan(lambda h, p: (self.layer_fn(p, h), None), x, stage_params)[0]

    def check_layer(self, stage_params: PyTree, x: PyTree) -> None:
        """Refuses a ``layer_fn`` whose output differs from its input in structure, shape or
        dtype, which ``lax.scan`` cannot carry; found with ``jax.eval_shape`` on one layer."""
        leaves = jax.tree.leaves(stage_params)
        if not leaves or any(not np.ndim(a) for a in leaves):
            return  # no layer axis to slice: lax.scan reports it
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stage_params)
        want = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)
        got = jax.eval_shape(self.layer_fn, layer, want)
        if not _same_shapes(got, want):
            name = getattr(self.layer_fn, "__name__", repr(self.layer_fn))
            raise ValueError(_LAYER_CHANGES_SHAPE.format(
                name=name, want=_describe(want), got=_describe(got)
            ))  # fmt: skip

    def __repr__(self) -> str:
        return f"scan_layers({getattr(self.layer_fn, '__name__', self.layer_fn)!r})"


def _as_layers(stage_fn: StageFn, rows: PyTree) -> tuple[Callable, PyTree, int]:
    """The stage rows as layers ``[V, Lv, ...]``, the function of one layer, and Lv.

    A `scan_layers` stage exposes its layers; any other ``stage_fn`` is one layer of its own.
    """
    if isinstance(stage_fn, _ScanLayers):
        return stage_fn.layer_fn, rows, jax.tree.leaves(rows)[0].shape[1]
    return stage_fn, jax.tree.map(lambda a: a[:, None], rows), 1


def _take2(tree: PyTree, r, li) -> PyTree:
    return jax.tree.map(lambda a: _take(_take(a, r), li), tree)


# -- the call: validated shapes, micro-batches and stage rows -----------------------------------


@dataclasses.dataclass
class _Call:
    """One traced call: the mesh facts, the micro-batched inputs and the stage rows."""

    api: str
    schedule: Any
    num_stages: int  # K: the size of the stage axis in this program (1 without one)
    num_microbatches: int  # M
    rows: PyTree  # stage params as [rows, ...]: [V, ...] per device, or [S, ...] in order
    xs: PyTree  # inputs as [M, b, ...]
    ts: PyTree  # targets as [M, b, ...], or None
    param_shapes: PyTree  # the stage params' shapes as passed, to undo `rows`
    batch: int  # the per-replica batch B
    unroll: bool = False  # ticks as a Python loop instead of lax.scan

    @classmethod
    def make(cls, api, schedule, m, stage_fn, stage_params, inputs, targets) -> _Call:
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
        plan = schedule.plan(k, m) if k > 1 else None
        rows = _stage_rows(name, stage_params, schedule.repeats, k)
        xs = _microbatch(inputs, m)
        if plan is not None:  # for Replicator.explain: one micro-batch's activation per tick
            sent = sum(a[0].size * a.dtype.itemsize for a in jax.tree.leaves(xs))
            _note(plan, sent, backward=api == "value_and_grad")
        call = cls(
            api, schedule, k, m, rows, xs, _microbatch(targets, m),
            jax.tree.map(jnp.shape, stage_params), batch,
        )  # fmt: skip
        _check_stage_fn(name, stage_fn, call)
        return call

    def from_rows(self, g_rows: PyTree) -> PyTree:
        return jax.tree.map(lambda g, shape: g.reshape(shape), g_rows, self.param_shapes)

    def merge_batch(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda a: a.reshape((self.batch, *a.shape[2:])), tree)


def _note(plan: schedules_lib.Plan, activation_bytes: int, *, backward: bool) -> None:
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


def _check_common(m, remat, api: str, unroll: bool = False) -> None:
    positive_int(m, api=f"rp.pipeline.{api}", name="num_microbatches")
    for name, value in (("remat", remat), ("unroll", unroll)):
        if not isinstance(value, bool):
            raise TypeError(f"rp.pipeline.{api}: {name} must be True or False; got {value!r}.")


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


def _check_stage_fn(name: str, stage_fn: StageFn, call: _Call) -> None:
    x = _take(call.xs, 0)
    row = _take(call.rows, 0)
    out = jax.eval_shape(stage_fn, row, x)
    want = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    if not _same_shapes(out, want):
        raise ValueError(
            f"{name}: stage_fn must return an activation with the structure, shapes and dtypes "
            f"of its input, so that every stage can pass it on; for a micro-batch "
            f"{_describe(want)} it returned {_describe(out)}. Move shape changes (embedding, "
            f"head) outside the stages: into the inputs and into loss_fn."
        )


def _same_shapes(got: PyTree, want: PyTree) -> bool:
    """Whether two trees of shaped values have one structure, and equal shapes and dtypes."""
    return jax.tree.structure(got) == jax.tree.structure(want) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def _describe(tree) -> str:
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


# -- small tree helpers -------------------------------------------------------------------------


def _take(tree: PyTree, i) -> PyTree:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(tree: PyTree, i, value: PyTree) -> PyTree:
    return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


def _where(pred, a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _zeros(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, tree)


def _add(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(jnp.add, a, b)


def _shift(tree: PyTree, k: int, step: int, *, ring: bool) -> PyTree:
    """Sends each stage's value to stage ``s + step`` (cyclically if ``ring``)."""
    perm = [(s, (s + step) % k) for s in range(k) if ring or 0 <= s + step < k]
    return lax.ppermute(tree, STAGE_AXIS, perm)


def _mean_loss(loss_fn: LossFn, head_params, y, t, m: int) -> jax.Array:
    return jnp.asarray(loss_fn(head_params, y, t), jnp.float32) / m


def _run_ticks(tick: Callable, carry: PyTree, num_ticks: int, unroll: bool) -> PyTree:
    """Runs ``tick(carry, t)`` for every tick: one ``lax.scan``, or a Python loop to debug."""
    if unroll:
        for t in range(num_ticks):
            carry, _ = tick(carry, jnp.int32(t))
        return carry
    return lax.scan(tick, carry, jnp.arange(num_ticks, dtype=jnp.int32))[0]


# -- without a stage axis: every stage in order -------------------------------------------------


def _run_layers(layer_fn: Callable, layers: PyTree, x: PyTree) -> PyTree:
    """Every layer in order; ``layers`` has leaves ``[S, Lv, ...]``, flattened to one scan."""
    flat = jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), layers)
    return lax.scan(lambda h, p: (layer_fn(p, h), None), x, flat)[0]


def _sequential_outputs(call: _Call, stage_fn: StageFn, rows: PyTree, xs: PyTree) -> PyTree:
    layer_fn, layers, _ = _as_layers(stage_fn, rows)
    return lax.map(lambda x: _run_layers(layer_fn, layers, x), xs)


def _sequential_value_and_grad(call: _Call, stage_fn, loss_fn, head_params, remat: bool):
    """A scan over the micro-batches of a scan over every layer, remat per layer as in the
    pipeline."""
    layer_fn, _, _ = _as_layers(stage_fn, call.rows)
    fn = jax.checkpoint(layer_fn, prevent_cse=False) if remat else layer_fn
    m = call.num_microbatches

    def total(rows, xs, head):
        layers = _as_layers(stage_fn, rows)[1]

        def one(acc, xt):
            x, t = xt
            return acc + _mean_loss(loss_fn, head, _run_layers(fn, layers, x), t, m), None

        return lax.scan(one, jnp.zeros((), jnp.float32), (xs, call.ts))[0]

    loss, (g_rows, g_xs, g_head) = jax.value_and_grad(total, argnums=(0, 1, 2))(
        call.rows, call.xs, head_params
    )
    return loss, (call.from_rows(g_rows), call.merge_batch(g_xs), g_head)


# -- GPipe and Circular: the forward ticks, differentiated by jax.vjp ---------------------------


def _forward_ticks(call, plan, stage_fn, loss_fn, head_params, rows, ts, xs, *, remat: bool):
    """Runs the forward ticks of ``plan`` on this stage, one layer per scan iteration.

    Iteration ``u`` runs layer ``u % Lv`` of tick ``u // Lv``; the activation moves to the
    next stage after a tick's last layer. Returns ``(loss, ys)``: this stage's share of the mean
    loss (nonzero on the last stage) when ``loss_fn`` is given, else the last stage's outputs
    ``[M, b, ...]`` (zeros elsewhere).
    """
    k, v, m = call.num_stages, plan.repeats, call.num_microbatches
    s = lax.axis_index(STAGE_AXIS)
    fwd, rep = jnp.asarray(plan.fwd), jnp.asarray(plan.fwd_repeat)
    layer_fn, layers, lv = _as_layers(stage_fn, rows)
    run_layer = _layer_on(layer_fn, remat)
    x0 = _zeros(_take(xs, 0))

    def step(carry, u):
        recv, h, acc = carry
        t, li = u // lv, u % lv
        i, r = fwd[t, s], rep[t, s]
        ic = jnp.maximum(i, 0)
        x = _where(li == 0, _where((s == 0) & (r == 0), _take(xs, ic), recv), h)
        h = run_layer(layers, r, li, x)
        last_layer = li == lv - 1
        done = last_layer & (i >= 0) & (s == k - 1) & (r == v - 1)  # leaves the pipeline
        if loss_fn is None:
            acc = _where(done, _put(acc, ic, h), acc)
        else:
            with tracing.runs(m, plan.num_ticks * lv):  # on the last stage, once per micro-batch
                acc = acc + lax.cond(
                    done,
                    lambda: _mean_loss(loss_fn, head_params, h, _take(ts, ic), m),
                    lambda: jnp.zeros((), jnp.float32),
                )
        with tracing.runs(1, lv):  # after the tick's last layer
            recv = lax.cond(last_layer, lambda: _shift(h, k, 1, ring=v > 1), lambda: recv)
        return (recv, h, acc), None

    init = (x0, x0, jnp.zeros((), jnp.float32) if loss_fn is not None else _zeros(xs))
    _, _, acc = _run_ticks(step, init, plan.num_ticks * lv, call.unroll)
    return (acc, None) if loss_fn is not None else (None, acc)


def _layer_on(layer_fn: Callable, remat: bool) -> Callable:
    """``g(layers, r, li, x)``: ``layer_fn`` on layer ``li`` of row ``r``, for a differentiated scan.

    What the scan keeps per iteration for the backward pass must never be a copy of the layer's
    parameters: they are sliced inside a checkpoint, so with ``remat`` the residuals are the
    layer's input and indices, and without it every intermediate activation but the parameters.
    """

    def run(layers, r, li, x):
        return layer_fn(checkpoint_name(_take2(layers, r, li), _PARAMS), x)

    if remat:
        return jax.checkpoint(run, prevent_cse=False)
    policy = jax.checkpoint_policies.save_anything_except_these_names(_PARAMS)
    return jax.checkpoint(run, prevent_cse=False, policy=policy)


def _scanned_vjp(call, stage_fn, loss_fn, head_params, remat: bool):
    plan = call.schedule.plan(call.num_stages, call.num_microbatches)

    def local_loss(rows, xs, head):
        return _forward_ticks(call, plan, stage_fn, loss_fn, head, rows, call.ts, xs, remat=remat)[
            0
        ]

    loss, vjp = jax.vjp(local_loss, call.rows, call.xs, head_params)
    g_rows, g_xs, g_head = vjp(jnp.ones((), jnp.float32))
    return loss, g_rows, g_xs, g_head


# -- 1F1B: forward and backward interleaved in one scan -----------------------------------------


def _one_f_one_b(call: _Call, stage_fn, loss_fn, head_params):
    """1F1B with one layer per scan iteration: a tick is Lv forward iterations (under
    ``lax.cond``, idle when the tick has no forward), then Lv backward iterations in reverse
    layer order, each recomputing its layer from the stashed layer input."""
    k, m = call.num_stages, call.num_microbatches
    plan = call.schedule.plan(k, m)
    slots = plan.stash_slots
    s = lax.axis_index(STAGE_AXIS)
    fwd, bwd = jnp.asarray(plan.fwd), jnp.asarray(plan.bwd)
    layer_fn, layers, lv = _as_layers(stage_fn, call.rows)
    params = _take(layers, 0)  # this stage's layers, [Lv, ...]
    x0 = _zeros(_take(call.xs, 0))
    is_first, is_last = s == 0, s == k - 1
    grad_loss = jax.value_and_grad(lambda h, y, t: _mean_loss(loss_fn, h, y, t, m), argnums=(0, 1))

    def step(c, u):
        t, q = u // (2 * lv), u % (2 * lv)
        # Forward phase (q < Lv): layer q of micro-batch i, stashing the layer's input.
        i = fwd[t, s]
        ic, lf = jnp.maximum(i, 0), jnp.minimum(q, lv - 1)
        f_on = (i >= 0) & (q < lv)
        x = _where(q == 0, _where(is_first, _take(call.xs, ic), c["act"]), c["h"])
        # Each stage is busy in M of the T ticks' forward halves, and in M backward halves.
        with tracing.runs(m, 2 * plan.num_ticks):
            h = lax.cond(f_on, lambda: layer_fn(_take(params, lf), x), lambda: c["h"])
        slot = jnp.where(f_on, ic % slots, slots)  # idle: the spare slot
        stash = jax.tree.map(lambda a, v: a.at[slot, lf].set(v), c["stash"], x)
        # The last stage turns its output into the loss and the cotangent at once.
        with tracing.runs(m, 2 * lv * plan.num_ticks):  # on the last stage, once per micro-batch
            loss, (g_head, dy) = lax.cond(
                f_on & (q == lv - 1) & is_last,
                lambda: grad_loss(head_params, h, _take(call.ts, ic)),
                lambda: (jnp.zeros((), jnp.float32), (_zeros(head_params), c["dy"])),
            )
        # Backward phase (q >= Lv): layer 2Lv-1-q of micro-batch j, from its stashed input.
        j = bwd[t, s]
        jc, lb = jnp.maximum(j, 0), jnp.maximum(2 * lv - 1 - q, 0)
        b_on = (j >= 0) & (q >= lv)
        cot = _where(q == lv, _where(is_last, dy, c["cot"]), c["g"])
        saved = jax.tree.map(lambda a: a[jc % slots, lb], stash)
        with tracing.runs(m, 2 * plan.num_ticks):
            g_layer, g = lax.cond(
                b_on,
                lambda: jax.vjp(layer_fn, _take(params, lb), saved)[1](cot),
                lambda: (_zeros(_take(params, 0)), c["g"]),
            )
        end = q == 2 * lv - 1
        g_xs = _put(c["g_xs"], jnp.where(end & b_on & is_first, jc, m), g)  # else: spare row
        with tracing.runs(1, 2 * lv):  # after the tick's last backward layer
            act, cot_next = lax.cond(
                end,
                lambda: (_shift(h, k, 1, ring=False), _shift(g, k, -1, ring=False)),
                lambda: (c["act"], c["cot"]),
            )
        new = {
            "act": act,
            "cot": cot_next,
            "h": h,
            "g": g,
            "dy": dy,
            "stash": stash,
            "g_params": jax.tree.map(
                lambda a, d: a.at[lb].add(jnp.where(b_on, d, 0)), c["g_params"], g_layer
            ),
            "g_head": _add(c["g_head"], g_head),
            "g_xs": g_xs,
            "loss": c["loss"] + loss,
        }
        return new, None

    spare = jax.tree.map(lambda a: jnp.zeros((a.shape[0] + 1, *a.shape[1:]), a.dtype), call.xs)
    init = {
        "act": x0,
        "cot": x0,
        "h": x0,
        "g": x0,
        "dy": x0,
        "stash": jax.tree.map(lambda a: jnp.zeros((slots + 1, lv, *a.shape), a.dtype), x0),
        "g_params": _zeros(params),
        "g_head": _zeros(head_params),
        "g_xs": spare,
        "loss": jnp.zeros((), jnp.float32),
    }
    c = _run_ticks(step, init, plan.num_ticks * 2 * lv, call.unroll)
    g_layers = jax.tree.map(lambda g: g[None], c["g_params"])  # [1, Lv, ...]
    if not isinstance(stage_fn, _ScanLayers):
        g_layers = jax.tree.map(lambda g: g[:, 0], g_layers)  # back to [1, ...]
    g_xs = jax.tree.map(lambda g: g[:m], c["g_xs"])
    return c["loss"], g_layers, g_xs, c["g_head"]
