"""The pipeline engine: one ``lax.scan`` over the ticks of a schedule, inside ``step_fn``.

Called inside a ``step_fn`` that ``Replicator.run`` traces over a mesh with a ``stage`` axis of
size K, each device runs one stage: it reads its row of the schedule's tables (`schedules.Timetable`)
at every tick, runs ``stage_fn`` on a micro-batch, and passes the activation to the next stage
with ``lax.ppermute``. Gradients are per replica, like everything in ``step_fn``: they are not
reduced over the data axes (``wrap_optimizer`` does that), but they are complete over the
stages: the loss, the gradients of the head and of the inputs are summed over ``stage`` so that
every stage holds them, and each stage holds the gradient of its own stage parameters.

Without a ``stage`` axis (the local lowering, a mesh of data axes only, or outside any
``Replicator``) the same call runs every stage in order on each micro-batch (`sequential`): a
scan over the micro-batches of a scan over the layers. This is the single-device meaning of a
pipeline call.

This module holds the entry points. A call is checked, micro-batched and planned once
(`call.PipelineCall`), then run by the schedule's scan: `gpipe` for GPipe and Circular (the
forward ticks, differentiated by ``jax.vjp``), `one_f_one_b` for 1F1B (forward and backward in
one scan), `zero_bubble` for ZeroBubble and Interleaved1F1B (passes that wait in ring
buffers). The scans step one *layer* per iteration (`layers`): a tick is Lv iterations, so the
compiled program is the same whatever the number of layers per stage, with no loop nested in
another.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.core.collectives import divergent, sum_over_axes
from replicator._src.core.errors import positive_int
from replicator._src.core.mesh import STAGE_AXIS
from replicator._src.core.typing import PyTree
from replicator._src.pipeline import gpipe, one_f_one_b, sequential, whole_grads, zero_bubble
from replicator._src.pipeline import schedules as schedules_lib
from replicator._src.pipeline.call import PipelineCall
from replicator._src.pipeline.layer_stack import StageFn
from replicator._src.pipeline.residuals import as_remat
from replicator._src.pipeline.ticks import LossFn


def value_and_grad(
    stage_fn: StageFn,
    loss_fn: LossFn,
    /,
    *,
    num_microbatches: int,
    schedule: Any = "gpipe",
    remat: bool | str | Callable = True,
    unroll: bool = False,
    scatter_grads: str = "microbatch",
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
      schedule: ``rp.pipeline.GPipe()``, ``Circular(repeats=V)``, ``OneFOneB()``,
        ``Interleaved1F1B(repeats=V)``, ``ZeroBubble()``, or their names ``"gpipe"``,
        ``"circular"``, ``"1f1b"``, ``"interleaved"``, ``"zerobubble"``.
      remat: what each layer keeps for the backward pass, for every schedule: ``"none"``
        (``False``) keeps all its activations and recomputes nothing; ``"full"`` (``True``, the
        default) keeps its input and recomputes the layer; ``"dots"`` keeps the outputs of
        products without batch dimensions (Megatron-LM's selective recomputation: attention's
        scores are recomputed, the linear layers' outputs kept); or any ``jax.checkpoint``
        policy. 1F1B, Interleaved1F1B and ZeroBubble keep what the policy says for their
        micro-batches in flight only (a ring of about 2K per virtual stage), so their memory
        stays flat in M whatever the policy.
      unroll: run the ticks as a Python loop instead of a ``lax.scan``, for debugging: the same
        tick body, one traced copy per tick (``jax.debug.print`` in ``stage_fn`` then shows every
        tick in order). Compile time grows with the number of ticks.
      scatter_grads: for ZeRO-3 stage parameters (`rp.ShardedParam`, gathered by ``stage_fn``
        with `rp.gather_params`), when their gradients are reduce-scattered over the replicas:
        ``"microbatch"`` (the default) in each micro-batch's backward pass, one layer at a
        time, as autodiff of the gather does (M reduce-scatters of the stage a step, M + K - 1
        with GPipe); ``"step"`` once a step, after the gradients were summed whole over the
        micro-batches (FSDP2's ``set_requires_gradient_sync(False)``). ``"step"`` holds the
        stage's whole gradients on each device for the step (in fp32 for narrower
        parameters), and GPipe and Circular gather the stage's weights once and hold them too
        (their backward is ``jax.vjp`` of the forward scan); 1F1B, Interleaved1F1B and
        ZeroBubble still gather each layer where they run it. ``Replicator.explain`` shows
        what is held. The numbers are the same either way; other parameters, and a call
        without a ``stage`` axis (the sequential meaning), are unaffected.

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
    _check_options(num_microbatches, "value_and_grad", unroll)
    policy = as_remat(remat, "rp.pipeline.value_and_grad")
    if policy.offloaded:
        raise ValueError(
            f"rp.pipeline.value_and_grad: remat offloads {', '.join(policy.offloaded)} to host "
            f"memory, which a pipeline's schedules do not keep (they hold each micro-batch's "
            f"residuals on the device); save or recompute them (e.g. remat="
            f"'save_dot_except_mlpwi'), or offload without a pipeline (GPTConfig.remat)."
        )
    whole_grads.check(scatter_grads, "rp.pipeline.value_and_grad")

    def f(stage_params, inputs, targets, head_params=None):
        call = PipelineCall.from_arguments(
            "value_and_grad", sched, num_microbatches, stage_fn, stage_params, inputs, targets,
            unroll=unroll, remat=policy, scatter_grads=scatter_grads,
        )  # fmt: skip
        if call.num_stages == 1:
            loss, (g_rows, g_xs, g_head) = sequential.value_and_grad(
                call, loss_fn, head_params, policy
            )
            return loss, (g_rows, _no_int_grads(g_xs), g_head)
        if sched.name == "1f1b":
            run = one_f_one_b.value_and_grad
        elif sched.name in ("zerobubble", "interleaved"):
            run = zero_bubble.value_and_grad
        else:
            run = gpipe.value_and_grad
        gated = run is not gpipe.value_and_grad  # each stage's work under its own lax.cond
        with divergent(f"the {sched.name!r} pipeline schedule") if gated else nullcontext():
            loss, g_rows, g_xs, g_head = run(call, loss_fn, head_params, policy)
        loss, g_xs, g_head = sum_over_axes((loss, g_xs, g_head), (STAGE_AXIS,))
        g_xs = _no_int_grads(call.merge_batch(g_xs))
        return loss, (call.from_rows(g_rows), g_xs, g_head)

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

    Equivalent to running every stage in order on each micro-batch (see `value_and_grad`); a
    ``OneFOneB()`` schedule runs its forward ticks, which are GPipe's (and
    ``Replicator.explain`` notes that GPipe plan).

    Args:
      stage_fn: ``stage_fn(one_stage_params, x) -> x``, one stage, as for `value_and_grad`.
      num_microbatches: M, the number of micro-batches per replica's batch.
      schedule: a schedule or its name, as for `value_and_grad`.
      unroll: run the ticks as a Python loop instead of a ``lax.scan``, for debugging.

    Returns:
      ``f(stage_params, inputs) -> y``: ``y`` is the output of the last stage for the whole
      batch, on every stage.

    Raises:
      ValueError: as `value_and_grad` does, for the options and, when ``f`` is called, the
        batch and the stage parameters.

    >>> import jax.numpy as jnp, replicator as rp
    >>> f = rp.pipeline.apply(lambda w, x: x @ w, num_microbatches=2)
    >>> f(jnp.stack([2 * jnp.eye(2)] * 3), jnp.ones((4, 2)))[0]
    Array([8., 8.], dtype=float32)
    """
    sched = schedules_lib.get(schedule)
    _check_options(num_microbatches, "apply", unroll)
    # 1F1B's and ZeroBubble's forward ticks are GPipe's; Interleaved1F1B's, Circular's.
    runs = sched
    if sched.name in ("1f1b", "zerobubble"):
        runs = schedules_lib.GPipe()
    elif sched.name == "interleaved":
        runs = schedules_lib.Circular(repeats=sched.repeats)

    def f(stage_params, inputs):
        call = PipelineCall.from_arguments(
            "apply", runs, num_microbatches, stage_fn, stage_params, inputs, None,
            unroll=unroll, asked=sched,
        )  # fmt: skip
        if call.num_stages == 1:
            ys = sequential.outputs(call)
        else:
            ys = sum_over_axes(gpipe.outputs(call), (STAGE_AXIS,))
        return call.merge_batch(ys)

    return f


def _check_options(m: object, api: str, unroll: object) -> None:
    positive_int(m, api=f"rp.pipeline.{api}", name="num_microbatches")
    if not isinstance(unroll, bool):
        raise TypeError(f"rp.pipeline.{api}: unroll must be True or False; got {unroll!r}.")


def _no_int_grads(g_inputs: PyTree) -> PyTree:
    """Integer inputs (token ids) have no gradient: ``float0`` zeros, as ``jax.grad`` gives."""
    return jax.tree.map(
        lambda g: (
            g if jnp.issubdtype(g.dtype, jnp.inexact) else np.zeros(g.shape, jax.dtypes.float0)
        ),
        g_inputs,
    )
