"""``Replicator``: the mesh, the lowering, and the entry points a user calls."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh, PartitionSpec

from replicator._src.core import binding as binding_lib
from replicator._src.core import data as data_lib
from replicator._src.core import (
    drift,
    errors,
    leaf_specs,
    placement,
    scoped,
    step_cache,
    targets,
    tracing,
)
from replicator._src.core import lowering as lowering_lib
from replicator._src.core import mesh as mesh_lib
from replicator._src.core.outputs import local_row as local_row
from replicator._src.core.typing import PyTree, StepFn
from replicator._src.optim import optimizer as optim
from replicator._src.report import step_report as report_lib


class Replicator:
    """Runs a one-replica ``step_fn`` on every device of a mesh, as one compiled program.

    Args:
      mesh_shape: mesh axis sizes, such as ``{"data": -1}`` (every device a replica) or
        ``{"data": 2, "stage": 4}``. Known axes: ``dcn_data``, ``data``, ``stage``,
        ``expert``, ``context``, ``model``; one size may be -1 to fill the remaining devices.
        Replicas are laid out over the data axes (``data`` and ``dcn_data``).
      lowering: ``"shard_map"`` (default): ``jax.jit(jax.shard_map(...))`` over the whole mesh;
        ``"pmap"``: ``jax.pmap`` over the replicas (data axes only); ``"local"``: one replica on
        one device, ``step_fn`` run eagerly on the whole batch, for debugging.
      devices: the devices to use; default ``jax.devices()`` (the first one for ``"local"``).
      check_replicas: after which runs of each compiled step to compare replicated state
        leaves across replicas (`ReplicasDivergedError` says what each setting catches and
        costs): ``None`` (default: 2) or ``n``, the first ``n``; ``True``: all; ``False``: none.
      donate: donate the state's buffers to the step (default), so that the new state reuses
        their memory. The state passed to ``run`` is then deleted: use the returned one.
      max_in_flight: how many steps ``run`` may have dispatched but not finished (it waits for
        the oldest first). Default: 2 on several CPU devices where queued collectives may hang
        (several processes, or a jax that ``_src/core/compat.py`` names); else unbounded.

    >>> import jax, jax.numpy as jnp, replicator as rp
    >>> repl = rp.Replicator(mesh_shape={"data": -1}, devices=jax.devices()[:2])
    >>> repl.num_replicas
    2
    >>> def step_fn(state, x):
    ...     return state + rp.all_reduce(x.sum(), "sum"), {"local": x.sum()}
    >>> state, out = repl.run(step_fn, repl.replicate(jnp.float32(0)), jnp.arange(4.0))
    >>> state, out["local"]
    (Array(6., dtype=float32), Array([1., 5.], dtype=float32))
    """

    def __init__(
        self,
        mesh_shape: Mapping[str, int] | None = None,
        *,
        lowering: str = "shard_map",
        devices: Sequence[jax.Device] | None = None,
        check_replicas: bool | int | None = None,
        donate: bool = True,
        max_in_flight: int | None = None,
    ) -> None:
        self._mesh = lowering_lib.mesh_for(lowering, mesh_shape, devices=devices)
        self._lowering = lowering
        self._target = targets.describe(list(self._mesh.devices.flat))
        self._compile_only = targets.compile_only(list(self._mesh.devices.flat))
        self._drift = drift.DriftCheck(self._mesh, lowering, drift.checked_policy(check_replicas))
        if max_in_flight is None:
            max_in_flight = step_cache.default_max_in_flight(self._mesh)
        errors.positive_int(
            max_in_flight, api="Replicator", name="max_in_flight", none=" (or None for the default)"
        )
        self._steps = step_cache.StepCache(
            self._mesh,
            lowering,
            donate=donate,
            check_inside=self._drift.inside,
            max_in_flight=max_in_flight,
        )

    # -- facts --------------------------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The device mesh, with named axes."""
        return self._mesh

    @property
    def lowering(self) -> str:
        """The lowering: ``"shard_map"``, ``"pmap"`` or ``"local"``."""
        return self._lowering

    @property
    def num_replicas(self) -> int:
        """The number of replicas: the product of the data axes' sizes."""
        return mesh_lib.num_replicas(self._mesh)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes replicas are laid out over; collectives reduce over these."""
        return mesh_lib.replica_axes(self._mesh)

    def __repr__(self) -> str:
        return (
            f"Replicator(mesh_shape={dict(self._mesh.shape)}, lowering={self._lowering!r}, "
            f"num_replicas={self.num_replicas})"
        )

    @contextlib.contextmanager
    def context(self) -> Iterator[Replicator]:
        """Makes this the replicator that ``rp.current()`` returns, within the block.

        Entering the context does not change what the collectives mean: they are bound only
        while ``run`` traces ``step_fn``. Within it, ``rp.replica_axis_name()`` outside a trace
        answers what ``run`` binds, for layers built here (a BatchNorm's ``axis_name``).

        Yields:
          This `Replicator`.
        """
        axes = lowering_lib.binding_axes(self._lowering, self._mesh)
        with _CURRENT.push(self), binding_lib.context_axes(axes):
            yield self

    @contextlib.contextmanager
    def _donation_suspended(self) -> Iterator[None]:
        """Within the block, ``run`` donates no buffers (its programs cached apart): `fit` calls
        ``eval_fn`` so, as ``eval_fn`` may pass the training state, still in use, to ``run``."""
        with self._steps.donation_suspended():
            yield

    # -- state and optimizer ------------------------------------------------------------------

    def replicate(self, tree: PyTree) -> PyTree:
        """Places a copy of every leaf of ``tree`` on every device of the mesh.

        The copies own their buffers (``run`` donates the state; the arrays passed in stay
        valid) and are not weakly typed (a step's new state has the same types and reuses the
        program). With several processes they hold process 0's values, broadcast first.

        Args:
          tree: a pytree of arrays (or scalars).

        Returns:
          ``tree`` with global ``jax.Array`` leaves of ``NamedSharding(mesh, P())``.
        """
        return self.place(tree, PartitionSpec())

    def place(self, tree: PyTree, spec: PartitionSpec | PyTree) -> PyTree:
        """Places every leaf of ``tree`` on the mesh with ``spec``, as `replicate` does with P().

        For state sharded over a mesh axis, such as pipeline stages:
        ``repl.place(stacked, rp.pipeline.stage_spec())``; the Megatron layout of an MLP on a
        ``model`` axis is ``repl.place(params, {"w1": P(None, "model"), "b1": P("model"), "w2":
        P("model", None), "b2": P()})``. With several processes, process 0's values are
        broadcast first and each process builds its own shards from them. A mesh axis
        replicator knows but this mesh lacks counts as an axis of size 1, so it is dropped from
        ``spec``: ``stage_spec()`` places a whole copy under the local lowering or on a
        ``{"data": N}`` mesh, where the pipeline runs every stage in order.

        Args:
          tree: a pytree of arrays.
          spec: one ``PartitionSpec`` for every leaf, or a tree of them with the structure of
            ``tree`` or of a prefix of it (one spec per leaf or subtree).

        Returns:
          ``tree`` with global ``jax.Array`` leaves that own their buffers.

        Raises:
          TypeError: if ``spec`` is not a ``PartitionSpec`` or a tree of them.
          ValueError: if ``spec`` names an axis that is not a mesh axis at all (e.g. ``"stag"``),
            if a tree of specs does not match ``tree``, or if a split does not divide a leaf's
            dimension.
        """
        if not placement.recording_active():  # under repl.abstract: shapes only, allowed
            self._refuse_compile_only("place" if spec != PartitionSpec() else "replicate")
        return leaf_specs.place(self._mesh, tree, spec)

    def _refuse_compile_only(self, api: str) -> None:
        if self._compile_only:
            targets.refuse_compile_only(self._target, api)

    def wrap_optimizer(
        self,
        tx: optax.GradientTransformation,
        /,
        *,
        zero_stage: int = 0,
        clip_global_norm: float | None = None,
        grad_dtype: Any = None,
        accumulate_steps: int = 1,
        loss_scale: float | str | None = None,
        loss_scale_period: int = 2000,
        local_steps: int | None = None,
        outer_optimizer: optax.GradientTransformation | None = None,
        zero_axes: tuple[str, ...] | None = None,
    ) -> optim.DistributedOptimizer:
        """An optax transformation that takes the cross-replica mean of the gradients, then ``tx``.

        Use it inside ``step_fn`` like any optax optimizer (Flax's ``TrainState.apply_gradients``).

        Args:
          tx: the inner optax transformation.
          zero_stage: 0: replicated optimizer state; 1 or 2 (ZeRO): the state is sharded over
            the replicas, gradients reduce-scattered and updates all-gathered (call ``init``
            outside ``step_fn``, pass ``params`` to ``update``); 3: parameters sharded too.
          clip_global_norm: clip the mean gradient to this global norm (over all its shards).
          grad_dtype: communicate the gradients in this dtype, e.g. ``jnp.bfloat16``.
          accumulate_steps: micro-batches per ``opt.step(loss_fn, params, state, batch)``.
          loss_scale: ``None``, a static scale, or ``"dynamic"`` (skip non-finite steps, halve
            the scale; double it after ``loss_scale_period`` finite steps).
          loss_scale_period: finite steps before a dynamic scale doubles.
          local_steps: local SGD / DiLoCo over ``dcn_data`` (`optim.local_sgd`): H steps inside
            each slice, then one mean of the moves across and ``outer_optimizer``'s step.
          outer_optimizer: DiLoCo's outer step (default: SGD 0.7, Nesterov momentum 0.9).
          zero_axes: hybrid ZeRO: the replica axes ZeRO splits over, e.g. ``("data",)``.

        Returns:
          A `DistributedOptimizer` (with ``local_steps``, a ``LocalSGD`` around one); the
          full account of each option is `replicator._src.optim.optimizer.wrap_optimizer`'s.
        """
        options = {k: v for k, v in locals().items() if k not in ("self", "tx")}  # as given
        return optim.wrap_optimizer(tx, mesh=self._mesh, **options)

    def abstract(self, init_fn: Callable[[], PyTree], /) -> PyTree:
        """The state ``init_fn()`` builds, as shapes with their shardings, allocating nothing.

        ``init_fn`` builds the state with the same calls as for training (``repl.replicate``,
        ``repl.place``, ``opt.init``, ``opt.shard_params``) and runs under ``jax.eval_shape``:
        nothing is allocated or computed, so a model too big for this machine can be planned
        with `explain`.

        Args:
          init_fn: a function of no arguments that returns the state.

        Returns:
          The state's pytree with ``jax.ShapeDtypeStruct`` leaves, each with the
          ``NamedSharding`` on this mesh that the real call would give it, for `explain`.

        Raises:
          ValueError: if a leaf was not placed on the mesh (by ``replicate``, ``place``,
            ``opt.init``, ``opt.shard_params`` or ``jax.device_put``): its sharding is unknown.

        >>> import jax, jax.numpy as jnp, optax, replicator as rp
        >>> repl = rp.Replicator(devices=jax.devices()[:2])
        >>> opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=1)
        >>> def init():
        ...     params = repl.replicate({"w": jnp.zeros((1024, 1024))})
        ...     return {"params": params, "opt": opt.init(params)}
        >>> state = repl.abstract(init)
        >>> state["opt"].inner[0].mu["w"].sharding.spec   # Adam's moment: ZeRO-1 over the replicas
        P('data',)
        """
        return leaf_specs.abstract(self._mesh, init_fn)

    # -- input ------------------------------------------------------------------------------

    def input_context(self) -> data_lib.InputContext:
        """The `InputContext` that ``distribute`` passes to ``input_fn`` in this process."""
        return data_lib.make_input_context(self.num_replicas)

    def distribute(
        self,
        input_fn: Callable[[data_lib.InputContext], Iterable[PyTree]],
        /,
        *,
        prefetch: int = 2,
        skip: int = 0,
        state: Any = None,
    ) -> data_lib.DistributedIterator:
        """Iterates ``input_fn(ctx)``'s batches as global arrays split over the replicas.

        ``input_fn`` runs once per process. Each batch is checked (its first axis must divide by
        this process's replica count; structure, shapes and dtypes must not change between
        batches) and becomes a ``jax.Array`` whose first axis is split over the data axes.

        Args:
          input_fn: ``input_fn(ctx: InputContext) -> iterable of batches``: this process's part
            of each global batch, a pytree of arrays whose first axis is the batch.
          prefetch: how many batches to prepare ahead in a background thread (0: none).
          skip: batches of ``input_fn`` to pass over first, unplaced: resuming a run at its
            checkpointed input position with a deterministic ``input_fn``.
          state: a position from ``DistributedIterator.get_state()`` to resume at, for an
            ``input_fn`` whose iterator has ``get_state``/``set_state`` (`rp.Batches`, grain's
            iterators); unlike ``skip`` it does not replay the batches before it.

        Returns:
          A `DistributedIterator` of global batches.

        Raises:
          ValueError: if ``prefetch`` or ``skip`` is not an int >= 0.
          TypeError, ValueError: from ``next()``, naming the batch and the leaf path.
        """
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(
                f"Replicator.distribute: prefetch must be an int >= 0; got {prefetch!r}."
            )
        if not isinstance(skip, int) or skip < 0:
            raise ValueError(f"Replicator.distribute: skip must be an int >= 0; got {skip!r}.")
        self._refuse_compile_only("distribute")
        source = data_lib.call_input_fn(input_fn, self.input_context())
        if state is not None:
            source = data_lib.resume(source, state)
        if skip:
            source = itertools.islice(source, skip, None)
        return data_lib.DistributedIterator(
            source,
            sharding=mesh_lib.batch_sharding(self._mesh),
            num_local_replicas=mesh_lib.num_local_replicas(self._mesh),
            prefetch=prefetch,
        )

    # -- running ----------------------------------------------------------------------------

    def run(self, step_fn: StepFn, state: PyTree, *args: PyTree) -> tuple[PyTree, PyTree]:
        """Runs ``step_fn(state, *args)`` on every replica; returns ``(state, outputs)``.

        ``step_fn`` is written for one replica: it sees each state leaf as laid out on its
        device (the whole leaf when replicated) and its own slice of each batch. Its gradients
        are local, as on one device; reduce them with ``wrap_optimizer`` or ``rp.all_reduce``.
        The program is compiled once per placement and shapes of the inputs, and cached.

        Args:
          step_fn: ``step_fn(state, *args) -> (state, outputs)``, one replica's step.
          state: leaves keep their sharding on this mesh (``replicate`` gives ``P()``), in the
            new state too; other arrays are replicated.
          *args: ``jax.Array``s already on this mesh keep their layout (a batch from
            ``distribute`` is split over replicas, a ``replicate``-d value is seen whole); any
            other array is a global batch, split along its first axis; scalars are seen whole.

        Returns:
          ``(state, outputs)``: every leaf of ``outputs`` stacked along a new leading axis of
          size ``num_replicas``, one row per replica; rows of a reduced output are equal.
          Outputs come back whole: on a mesh with ``stage`` or ``model`` axes, a leaf that
          differs across them (found when the step is traced: a pipeline's stage parameters or
          their gradient) is also concatenated along its own first axis over those axes, in
          mesh order: a ``[1, 4, 8, 8]`` block per stage on ``{"data": 2, "stage": 4}`` comes
          back ``[2, 4, 4, 8, 8]``. A leaf equal on every stage (a loss reduced by
          ``rp.pipeline``) keeps ``[num_replicas, ...]``.

        Raises:
          TypeError, ValueError: if ``step_fn`` does not return ``(state, outputs)`` with the
            state's structure, shapes and dtypes, or an argument does not split over replicas.
          ValueError: before the step runs, if an output that differs across a ``stage`` or
            ``model`` axis is a scalar (return ``x[None]``, or reduce it over the stages), or a
            state leaf whose sharding does not name such an axis differs across it (reduce it
            there, or place it with a spec over that axis).
          ReplicasDivergedError: if a replicated state leaf differs across replicas after a
            checked run (``check_replicas``).
        """
        self._refuse_compile_only("run")
        state_leaves, state_def = jax.tree.flatten(state)
        arg_leaves, args_def = jax.tree.flatten(args)
        step_cache.raise_if_donated(state_leaves, state)
        program, state_specs = self._steps.program(
            step_fn, state_leaves, state_def, arg_leaves, args_def, args
        )
        new_leaves, outputs, extras = self._steps.dispatch(program, state_leaves, arg_leaves)
        new_state = jax.tree.unflatten(state_def, new_leaves)
        self._drift.after_run(program, step_fn, new_state, new_leaves, outputs, state_specs, extras)
        return new_state, outputs

    def lower(self, step_fn: StepFn, state: PyTree, *args: PyTree) -> jax.stages.Lowered:
        """The program ``run(step_fn, state, *args)`` would run, lowered but not run.

        Nothing is executed and no buffer is donated. Call ``.compile()`` on the result for the
        compiled program: its ``memory_analysis()``, ``cost_analysis()`` and ``as_text()`` (the
        optimized HLO, with its collectives) describe one step on this mesh.

        Args:
          step_fn: one replica's step, as for `run`.
          state: the state, or its shapes; as for `run`.
          *args: the arguments, e.g. a global batch, or their shapes.

        Returns:
          A ``jax.stages.Lowered``.

        Raises:
          ValueError: under the local lowering, which has no program.

        >>> import jax, jax.numpy as jnp, replicator as rp
        >>> repl = rp.Replicator(devices=jax.devices()[:2])
        >>> step = lambda s, x: (s + rp.all_reduce(x.sum(), "sum"), {})
        >>> compiled = repl.lower(step, repl.replicate(jnp.float32(0)), jnp.ones(4)).compile()
        >>> "all-reduce" in compiled.as_text()
        True
        """
        if self._lowering == "local":
            raise ValueError(
                "Replicator.lower: lowering='local' runs step_fn eagerly, so there is no "
                "program to lower; use lowering='shard_map' (or 'pmap')."
            )
        state_leaves, state_def = jax.tree.flatten(state)
        arg_leaves, args_def = jax.tree.flatten(args)
        program, _ = self._steps.program(
            step_fn, state_leaves, state_def, arg_leaves, args_def, args
        )
        return program.lower(state_leaves, arg_leaves)

    def explain(
        self, step_fn: StepFn, state: PyTree, *args: PyTree, stage_costs: bool = True,
        model_flops: float | None = None,
    ) -> report_lib.StepReport:  # fmt: skip
        """What ``run(step_fn, state, *args)`` would cost per device, without running it.

        Compiles the step for this mesh and reads the compiled program: per-device memory
        (arguments, outputs, temporaries), FLOPs, every collective with its mesh axes, dtype and
        bytes per step (loops counted per trip), and each pipeline's schedule, bubble fraction
        and picture. Nothing is executed and nothing is donated. For a mesh bigger than this
        machine, emulate its devices (``jax.config.update("jax_num_cpu_devices", 64)`` before
        JAX starts) or run ``replicator explain CONFIG``. On a TPU target's devices
        (``Replicator(devices=rp.tpu_devices("v5p-16"))``, any machine with libtpu) the program
        is the TPU's, and the report's ``target`` (`TargetReport`) gives HBM and ``fits``, the
        roofline ``step_seconds``, XLA's own ``xla_seconds`` and the MFU.

        Args:
          step_fn: one replica's step, as for `run`.
          state: the state, or its shapes: ``jax.ShapeDtypeStruct`` leaves (from `abstract` or
            ``jax.eval_shape``, with ``sharding=`` where not replicated) allocate nothing.
          *args: the arguments, e.g. a global batch, or their shapes.
          stage_costs: model each pipeline with its stages' FLOPs, each stage's passes compiled
            alone; False: with equal stage costs (half the compile time; same for equal stages).
          model_flops: the model's own FLOPs per device per step (e.g. ``6 N T / devices``
            plus attention), for the report's MFU on a TPU target.

        Returns:
          A `StepReport`: print it for tables, ``to_json()`` for everything.

        Raises:
          ValueError: under the local lowering, which has no program.
          DoesNotFitError: on a TPU target, if its compiler refuses the program for its HBM.

        >>> import jax, jax.numpy as jnp, replicator as rp
        >>> repl = rp.Replicator(devices=jax.devices()[:2])
        >>> step = lambda s, x: (s + rp.all_reduce(x.T @ x, "mean"), {})
        >>> report = repl.explain(step, repl.replicate(jnp.ones((8, 8))), jnp.ones((4, 8)))
        >>> [(c.kind, c.axes, c.bytes) for c in report.collectives]  # the 8x8 f32 all-reduce
        [('all-reduce', ('data',), 256)]
        >>> report.matmul_flops  # [8, 2] @ [2, 8] on each device: 2 x 8 x 8 x 2
        256.0
        """
        if self._lowering == "local":
            raise ValueError(
                "Replicator.explain: lowering='local' runs step_fn eagerly, so there is no "
                "program to explain; use lowering='shard_map' (or 'pmap')."
            )
        start = time.perf_counter()
        state_leaves, state_def = jax.tree.flatten(state)
        arg_leaves, args_def = jax.tree.flatten(args)
        # a new program: step_fn is traced again
        with (
            tracing.recording(measure_stages=stage_costs) as pipelines,
            tracing.recording_zero() as zero,
        ):
            program, _ = self._steps.compile(
                step_fn, state_def, args_def, state_leaves, arg_leaves, args
            )
            compiled = targets.compile_for(self._target, program.lower(state_leaves, arg_leaves))
        return report_lib.report(
            compiled,
            step=getattr(step_fn, "__qualname__", None) or repr(step_fn),
            mesh_shape=dict(self._mesh.shape),
            lowering=self._lowering,
            platform=self._mesh.devices.flat[0].platform,
            compile_seconds=time.perf_counter() - start,
            pipelines=pipelines,
            zero=zero,
            target=self._target,
            model_flops=model_flops,
        )


_CURRENT: scoped.Stack[Replicator] = scoped.Stack()


def current() -> Replicator | None:
    """The innermost ``Replicator`` whose ``context()`` is entered in this thread, or None.

    >>> import replicator as rp
    >>> rp.current() is None
    True
    """
    return _CURRENT.top()
