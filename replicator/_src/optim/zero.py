"""ZeRO: optimizer state (and with stage 3, parameters) sharded over the replicas.

Every parameter, gradient and optimizer-state leaf keeps its own shape; one of its axes is split
over the data axes on top of its split over ``stage`` and ``model`` (`zero_layout.split_dim`
says which). So on every mesh a leaf is the same logical array, only its sharding differs:

* ZeRO-1/2: a gradient is reduce-scattered along its leaf's split axis, the optimizer runs on
  this replica's part, and the update is all-gathered along the same axis: the bytes of an
  all-reduce, 1/N of the state per device.
* ZeRO-3: a parameter is stored split (`ShardedParam`) and gathered where it is used
  (`gather_params`), one layer at a time inside a layer scan; autodiff reduce-scatters its
  gradient; the optimizer updates the parts in place.
* ``model`` (XLA's) and ``stage`` (a pipeline's blocks) keep their splits: the gathers and
  reduce-scatters run over the data axes only, each device on its own ``model`` part, so a
  product split over ``model`` stays split (FSDP x TP computes each product once).

The inner optax transformation is written for whole arrays. `Zero.apply` runs its one-device
program on the parts (`replicator._src.optim.sharded_eval`), which knows each value's split axis:
element-wise operations, reductions over any axes (completed over the replicas when they include
the split axis: global norms, LAMB's trust ratio, Adafactor's factored statistics) and products
run on the parts; the few operations with no rule on parts (a sort along the split axis, a loop)
gather their operands for that operation only. `Zero.plan` tells which, before a step runs.

As optax transformations: `scatter_mean` takes local gradients to this replica's part of their
mean, and `sharded_update` runs an optax transformation on the parts, its state in this layout.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import collectives, placement, tracing
from replicator._src.core import mesh as mesh_lib
from replicator._src.core.binding import current_binding, only
from replicator._src.core.sharded_params import ShardedParam, is_sharded_param
from replicator._src.core.typing import PyTree
from replicator._src.optim import replica_mean, sharded_eval, shards, zero_layout, zero_plan
from replicator._src.optim.shards import WHOLE, Split
from replicator._src.optim.stages import transform as stagewise
from replicator._src.optim.stages import zero_parts


class _Leaf(NamedTuple):
    """One parameter (or its gradient) in ZeRO's layout."""

    shape: tuple[int, ...]  # the whole parameter's shape (as on one device)
    dtype: Any
    data: int | None  # the axis split over the replicas; None: whole on every replica
    stage: int | None  # the axis split over `stage` (a pipeline's stage blocks), or None
    auto: tuple  # PartitionSpec entries over `model` (trailing axes), for its gathers
    stored: bool  # a ShardedParam (ZeRO-3): the parameter itself is stored split


class _Program(NamedTuple):
    closed: jex.ClosedJaxpr  # (grads, state[, params]) -> (updates, state), one device's
    s_avals: list  # the one-device shape and dtype of each state leaf
    s_def: Any  # the state's tree structure


_NEEDS_PARAMS = """\
wrap_optimizer(zero_stage={stage}): on a mesh with a 'stage' axis, the update must know which \
gradients are a pipeline's stage blocks, which it reads from the parameters; pass them as \
step_fn received them in its state:

    updates, opt_state = opt.update(grads, state["opt"], state["params"])"""


class Zero:
    """The ZeRO layout of one mesh, and the update of an optax transformation on it."""

    def __init__(self, mesh: Mesh, *, stage: int, axes: tuple | None = None) -> None:
        self.mesh = mesh
        self.stage = stage  # 0: nothing over the replicas; the update on stage blocks only
        replicas = mesh_lib.replica_axes(mesh)
        # hybrid ZeRO: split over `axes` (inside each slice), whole over the `outer` others
        self.axes = replicas if axes is None else tuple(a for a in replicas if a in axes)
        self.outer = tuple(a for a in replicas if a not in self.axes)
        self.n = math.prod(mesh.shape[a] for a in self.axes) if stage else 1
        self.grad_dtype = None  # the gradients' dtype on the wire (`scatter_mean` sets it)
        self.k = dict(mesh.shape).get(mesh_lib.STAGE_AXIS, 1)  # pipeline stages
        stage_axes = (mesh_lib.STAGE_AXIS,) if self.k > 1 else ()
        self.comm = shards.Comm(self.n, self.k, stage_axes)

    # -- leaves ---------------------------------------------------------------------------------

    def _leaf(self, x, shape, spec, *, local: bool) -> _Leaf:
        """The layout of parameter ``x`` (a leaf or a `ShardedParam`) of ``shape`` (global, or
        this device's part inside a step: ``local``) placed with ``spec``."""
        stored = isinstance(x, ShardedParam)
        value = x.value if stored else x
        stage = zero_layout.stage_dim(spec) if self.k > 1 else None
        shape = list(shape)
        if local and stage is not None:
            shape[stage] *= self.k
        if stored:
            data = None if x.dim is None else x.dim % len(shape)
            if local and data is not None:
                shape[data] *= self.n
            auto = x.auto
        else:
            data = zero_layout.split_dim(shape, spec, self.n)
            auto = zero_layout.auto_entries(spec, len(shape))
        return _Leaf(tuple(shape), jnp.result_type(value), data, stage, auto, stored)

    def _global_leaves(self, params: PyTree) -> list[_Leaf]:
        """Each parameter of global ``params`` (as ``init`` gets them)."""
        out = []
        for x in jax.tree.leaves(params, is_leaf=is_sharded_param):
            value = x.value if isinstance(x, ShardedParam) else x
            out.append(self._leaf(x, np.shape(value), zero_layout.spec_of(value), local=False))
        return out

    def _step_leaves(self, params: PyTree, like: PyTree) -> list[_Leaf]:
        """Inside a step: each parameter, read from ``params`` as step_fn received them (their
        specs), or from the gradients ``like`` when ``params`` is None.

        Raises:
          ValueError: without ``params`` on a mesh with a ``stage`` axis.
        """
        binding = current_binding()
        if params is None and binding.model_axes():
            raise ValueError(_NEEDS_PARAMS.format(stage=self.stage))
        tree = like if params is None else params
        out = []
        for x in jax.tree.leaves(tree, is_leaf=is_sharded_param):
            value = x.value if isinstance(x, ShardedParam) else x
            spec = None if params is None else binding.spec_of(value)
            out.append(self._leaf(x, np.shape(value), spec, local=True))
        return out

    def _state_split(self, x, aval) -> Split:
        """Inside a step: how a state leaf ``x`` (this device's part) of one-device shape
        ``aval`` is split, from its spec as step_fn received it, or else from its shape."""
        spec = current_binding().spec_of(x)
        if spec is not None:
            data = set(mesh_lib.replica_axes(self.mesh))
            dims = [d for d, e in enumerate(spec) if data & set(mesh_lib.entry_axes(e))]
            return Split(
                dims[0] if dims else None, zero_layout.stage_dim(spec) if self.k > 1 else None
            )
        local = tuple(np.shape(x))
        diff = [d for d, (a, b) in enumerate(zip(local, aval.shape, strict=True)) if a != b]
        if self.k > 1:
            raise ValueError(
                f"wrap_optimizer(zero_stage={self.stage}): on a mesh with a 'stage' axis, update "
                f"takes the optimizer state as step_fn received it (state['opt']), whose "
                f"shardings say how each leaf is split; a leaf of shape {list(local)} was made "
                f"inside the step instead."
            )
        return Split(diff[0] if diff else None)

    # -- the program ----------------------------------------------------------------------------

    def _program(self, inner, tree: PyTree, leaves: list[_Leaf], with_params: bool, extra_args):
        """``inner.update`` traced on the whole parameters' shapes (``leaves``)."""
        treedef = jax.tree.structure(tree)  # ShardedParam nodes kept: optax sees the same tree
        avals = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        real = jax.tree.unflatten(treedef, avals)
        s_avals, s_def = jax.tree.flatten(jax.eval_shape(inner.init, real))

        def update(g, s, *p):
            updates, new_state = inner.update(
                jax.tree.unflatten(treedef, g),
                jax.tree.unflatten(s_def, s),
                jax.tree.unflatten(treedef, p[0]) if p else None,
                **extra_args,
            )
            return jax.tree.leaves(updates), jax.tree.leaves(new_state)

        args = (avals, s_avals, avals) if with_params else (avals, s_avals)
        return _Program(jax.make_jaxpr(update)(*args), s_avals, s_def)

    def _in_splits(self, leaves: list[_Leaf], with_params: bool):
        grads = [Split(leaf.data, leaf.stage) for leaf in leaves]
        params = [Split(leaf.data if leaf.stored else None, leaf.stage) for leaf in leaves]
        return grads, params if with_params else []

    # -- init -----------------------------------------------------------------------------------

    def check_params(self, params: PyTree) -> None:
        zero_layout.check_params(params, self.mesh, stage=self.stage)

    def layout(self, inner, params: PyTree) -> tuple[PyTree, zero_plan.ZeroPlan]:
        """The sharding of each leaf of ``inner.init(params)`` (global ``params``), and the
        `ZeroPlan`; nothing is allocated.

        The layout of the state is found from the update's own program: each state leaf is
        split as the update computes it from the split gradients (the moments of a parameter
        like the parameter; a statistic reduced over its split axis whole), iterated until
        the state the update returns is split as the state it takes.

        Raises:
          ValueError: for parameters ZeRO cannot lay out (`zero_layout.check_params`), or an
            update that would need a stage block whole.
        """
        self.check_params(params)
        leaves = self._global_leaves(params)
        prog = self._program(inner, params, leaves, True, {})
        g_splits, p_splits = self._in_splits(leaves, True)
        s_splits = [WHOLE] * len(prog.s_avals)
        n_g = len(g_splits)
        for _ in range(5):
            outs, gathered = sharded_eval.analyze(
                prog.closed, self.comm, [*g_splits, *s_splits, *p_splits]
            )
            new = [self._storable(s, a) for s, a in zip(outs[n_g:], prog.s_avals, strict=True)]
            if new == s_splits:
                break
            s_splits = new
        specs = self._state_specs(leaves, prog, s_splits)
        shardings = jax.tree.unflatten(prog.s_def, [NamedSharding(self.mesh, s) for s in specs])
        paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(prog.s_def, prog.s_avals))
        plan = zero_plan.make(
            self, params, leaves, paths[0], specs, [s.data for s in s_splits], gathered
        )
        return shardings, plan

    def init(self, inner, params: PyTree) -> tuple[PyTree, zero_plan.ZeroPlan]:
        """``inner.init`` of the global ``params``, each state leaf placed as `layout` says,
        and the `ZeroPlan`."""
        shardings, plan = self.layout(inner, params)
        state = jax.jit(inner.init, out_shardings=shardings)(params)
        state = placement.put(state, shardings)  # a no-op here; noted for Replicator.abstract
        return state, plan

    def _storable(self, split: Split, aval) -> Split:
        """A state leaf's split as it can be stored: whole along a group whose size does not
        divide the axis."""
        data, stage = split.data, split.stage
        if data is not None and aval.shape[data] % self.n:
            data = None
        if stage is not None and aval.shape[stage] % self.k:
            stage = None
        return Split(data, stage)

    def _state_specs(self, leaves: list[_Leaf], prog: _Program, s_splits) -> list[PartitionSpec]:
        """Each state leaf's spec: its stage axis over ``stage``, its split axis over the data
        axes, and, for a leaf shaped and split like a parameter, that parameter's ``model``
        entries."""
        specs = []
        for aval, split in zip(prog.s_avals, s_splits, strict=True):
            shape = tuple(aval.shape)
            entries: list = [None] * len(shape)
            model = next(
                (leaf.auto for leaf in leaves
                 if leaf.shape == shape and leaf.data == split.data and leaf.stage == split.stage),
                (),
            )  # fmt: skip
            for i, e in enumerate((None,) * (len(shape) - len(model)) + tuple(model)):
                entries[i] = e
            if split.stage is not None:
                entries[split.stage] = mesh_lib.STAGE_AXIS
            if split.data is not None:
                entries[split.data] = self.entry
            while entries and entries[-1] is None:
                entries.pop()
            specs.append(PartitionSpec(*entries))
        return specs

    @property
    def entry(self):
        """The ``PartitionSpec`` entry of the axes the parts are split over."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def scope(self):
        """The block inside which ZeRO's collectives run: over `axes` only (hybrid ZeRO), or
        over every replica axis."""
        return only(self.axes if self.outer else None)

    def across(self, x: jax.Array, dtype=None) -> jax.Array:
        """Hybrid ZeRO: the mean of a reduced part ``x`` over the `outer` axes (across the
        slices, where every replica holds the same parts), sent in ``dtype`` if given."""
        if not self.outer or current_binding().is_local:
            return x
        sent = x if dtype is None else x.astype(dtype)
        return collectives.mean_over_axes(sent, self.outer).astype(x.dtype)

    def across_tree(self, parts: PyTree) -> PyTree:
        """`across` of every reduced part of ``parts`` (ZeRO-2's accumulated slices, reduced
        inside the slice each micro-batch and across the slices once)."""
        dtype = getattr(self, "grad_dtype", None)
        return jax.tree.map(lambda x: self.across(x, dtype), parts)

    # -- inside a step ----------------------------------------------------------------------------

    def check_binding(self) -> None:
        binding = current_binding()
        if binding.num_replicas != self.n:
            raise ValueError(
                f"wrap_optimizer(zero_stage={self.stage}): the state is sharded over {self.n} "
                f"replicas, but this step runs on {binding.num_replicas}; call update inside "
                f"repl.run of the replicator that made the optimizer."
            )

    def reduce(self, grads: PyTree, params: PyTree, dtype, *, across: bool = True) -> PyTree:
        """Local gradients -> this replica's part of their mean over the replicas.

        A gradient of a parameter stored whole is reduce-scattered along its split axis (sent
        in ``dtype`` if given); that of a `ShardedParam` was summed over the replicas by the
        autodiff of `gather_params` already, and is divided by N. A leaf with no split axis
        is all-reduced.
        """
        replica_mean.refuse_narrow_on_xla_cpu(dtype)
        leaves = self._step_leaves(params, grads)
        nodes, treedef = jax.tree.flatten(grads, is_leaf=is_sharded_param)
        out = []
        for g, leaf in zip(nodes, leaves, strict=True):
            value = g.value if isinstance(g, ShardedParam) else g
            if leaf.stored and leaf.data is not None:
                reduced = value / self.n
            else:
                sent = value if dtype is None else value.astype(dtype)
                if leaf.data is None:
                    reduced = collectives.all_reduce(sent, "mean")
                else:
                    reduced = collectives.scatter_replicas(sent, leaf.data, leaf.auto) / self.n
                reduced = reduced.astype(value.dtype)
            reduced = self.across(reduced, dtype) if across else reduced  # hybrid: slices
            out.append(g.like(reduced) if isinstance(g, ShardedParam) else reduced)
        return jax.tree.unflatten(treedef, out)

    def split_flags(self, params: PyTree, like: PyTree) -> list[bool]:
        """For each reduced gradient leaf, whether it is this replica's part (its squares
        are then summed over the replicas for a global norm)."""
        return [leaf.data is not None for leaf in self._step_leaves(params, like)]

    def slice_zeros(self, params: PyTree) -> PyTree:
        """Zeros shaped as this replica's part of the mean gradients (what `reduce` gives),
        for ZeRO-2's accumulation."""
        leaves = self._step_leaves(params, None)
        nodes, treedef = jax.tree.flatten(params, is_leaf=is_sharded_param)
        out = []
        for p, leaf in zip(nodes, leaves, strict=True):
            if isinstance(p, ShardedParam):
                out.append(jax.tree.map(jnp.zeros_like, placement.to_device(p)))  # no copy made
                continue
            shape = shards.local_shape(leaf.shape, Split(leaf.data, leaf.stage), self.comm)
            out.append(jnp.zeros(shape, jnp.result_type(p)))
        return jax.tree.unflatten(treedef, out)

    def apply(self, inner, g_local: PyTree, state: PyTree, params: PyTree, extra_args, like):
        """``inner.update`` of the mean gradients, as on one device: ``(updates, state)``.

        ``g_local`` is this replica's part of each mean gradient (`reduce`), ``state`` its
        part of the stored state, ``params`` the parameters as ``step_fn`` holds them (or None),
        ``like`` the gradients as ``step_fn`` computed them (for their shapes when ``params``
        is None). An update of a parameter stored whole comes back whole (all-gathered along
        its split axis, each device its own ``model`` part); that of a `ShardedParam` in its
        layout.
        """
        leaves = self._step_leaves(params, like)
        tree = like if params is None else params
        prog = self._program(inner, tree, leaves, params is not None, extra_args)
        g_splits, p_splits = self._in_splits(leaves, params is not None)
        g_vals = jax.tree.leaves(g_local)
        s_vals, s_def = jax.tree.flatten(state)
        p_vals = [] if params is None else jax.tree.leaves(params)
        s_splits = [self._state_split(x, a) for x, a in zip(s_vals, prog.s_avals, strict=True)]
        args = [
            *zip(g_vals, g_splits, strict=True),
            *zip(s_vals, s_splits, strict=True),
            *zip(p_vals, p_splits, strict=True),
        ]
        outs, gathered = sharded_eval.evaluate(prog.closed, self.comm, args)
        if self.stage:
            tracing.note_zero(zero_plan.note(self, leaves, gathered))
        n_g = len(g_vals)
        updates = []
        for (u, split), leaf in zip(outs[:n_g], leaves, strict=True):
            if leaf.stored:
                updates.append(_to(u, split, Split(leaf.data, leaf.stage), self.comm))
                continue
            u = _to(u, split, Split(split.data, leaf.stage), self.comm)  # this stage's block
            if split.data is not None:  # whole over the replicas, each device its model part
                u = collectives.gather_replicas(u, split.data, leaf.auto)
            updates.append(u)
        new_state = [
            jnp.asarray(_to(x, split, want, self.comm)).astype(old.dtype)
            for (x, split), want, old in zip(outs[n_g:], s_splits, s_vals, strict=True)
        ]
        u_tree = jax.tree.unflatten(jax.tree.structure(g_local), updates)
        return u_tree, jax.tree.unflatten(s_def, new_state)

    # -- ZeRO-3 parameters ----------------------------------------------------------------------

    def shard_params(self, params: PyTree, stacked, split=None) -> PyTree:
        """``params`` stored as `ShardedParam` leaves (see `DistributedOptimizer.shard_params`);
        the packed stages of ``pipeline.sequential`` as `split_rows.SplitStages`."""
        if stagewise.only_packed(params, f"zero_stage={self.stage}"):
            return zero_parts.shard_packed(params, self.mesh, self.n)
        leads = zero_layout.stacked_leads(stacked, params)

        prefer = dict(split or {})

        def shard(x, lead: int, key=None):
            if isinstance(x, ShardedParam):
                raise ValueError(
                    "shard_params: a parameter is a ShardedParam already (stored by ZeRO-3); "
                    "call shard_params once, on the placed parameters."
                )
            spec = zero_layout.spec_of(x)
            stage = zero_layout.stage_dim(spec)
            if stage is not None:  # a stage block of layers: never split its stage or layers
                lead = max(lead, stage + 2)
            shape = tuple(np.shape(x))
            dim = zero_layout.split_dim(shape, spec, self.n, lead=lead, prefer=prefer.get(key))
            new_spec = zero_layout.with_data(spec, dim, len(shape), self.mesh, entry=self.entry)
            value = placement.put(jnp.asarray(x), NamedSharding(self.mesh, new_spec))
            auto = zero_layout.auto_entries(spec, len(shape), keep=len(shape) - lead)
            dim = None if dim is None else dim - len(shape)
            return ShardedParam(value, dim, auto, self.axes if self.outer else None)

        if not leads and not prefer:
            return jax.tree.map(lambda x: shard(x, 0), params, is_leaf=is_sharded_param)
        shard_key = lambda k, v: jax.tree.map(
            functools.partial(shard, lead=leads.get(k, 0), key=k), v, is_leaf=is_sharded_param
        )
        return {k: shard_key(k, v) for k, v in params.items()}


def _to(x, have: Split, want: Split, comm: shards.Comm):
    """``x``, split as ``have``, split as ``want`` instead (gathered, then cut)."""
    if have == want:
        return x
    return sharded_eval.convert(x, have, want, comm)


# -- as optax transformations -------------------------------------------------------------------

ScatterMeanState = optax.EmptyState
