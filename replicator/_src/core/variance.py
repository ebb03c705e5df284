"""Which mesh axes each value of a per-replica program differs across, and whole outputs from it.

``Replicator.run`` maps one replica's step over every device of the mesh. Besides the replica
(data) axes, a mesh may have a ``stage`` axis (pipelines), also mapped by hand: a step's value can
differ from one device to the next along it too (``model`` is left to XLA and never does), such as a pipeline's gradient of its
stage parameters. An output written with a spec that does not mention such an axis would keep
one device's block and silently drop the others. This module finds, at trace time, the non-replica
axes each output and each new state leaf varies over, so that the lowering can concatenate the
outputs over them and refuse what cannot come back whole.

The analysis (`varying_axes`) is a forward dataflow over the jaxpr of the per-replica body, traced
once with the per-device shapes inside the real ``shard_map``:

* an input varies over the axes its ``PartitionSpec`` names; constants vary over none;
* ``axis_index``, ``ppermute``, ``psum_scatter`` and ``all_to_all`` over an axis make their result
  vary over it; ``psum``, ``pmax``, ``pmin`` and ``all_gather`` over an axis make it equal across it;
* every other primitive varies over the union of its inputs; calls (``jit``, ``checkpoint``,
  ``custom_jvp``/``custom_vjp``) are analysed inside; ``cond`` takes the union over its branches and
  its predicate; ``scan`` and ``while_loop`` iterate their carries to a fixpoint (the predicate of a
  ``while_loop`` counts for every carry);
* anything unknown is taken to vary: host callbacks and stateful random numbers over every axis,
  an unknown primitive with sub-programs over every axis it names inside.

The step itself is traced once: the jaxpr the analysis reads is the one the compiled program runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun, jaxprs_in_params
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import compat
from replicator._src.core import mesh as mesh_lib

Axes = frozenset
"""A set of mesh axis names."""

NONE: Axes = frozenset()

# Collectives whose result is the same on every device of the axes they name.
_REDUCING = frozenset(
    {"psum", "pmax", "pmin", "psum_invariant", "all_gather", "all_gather_invariant", "pbroadcast"}
)
# Primitives whose result differs across the axes they name, whatever their inputs.
_SPREADING = frozenset(
    {
        "axis_index",
        "ppermute",
        "reduce_scatter",
        "all_to_all",
        "ragged_all_to_all",
        "psend",
        "precv",
    }
)
# Type casts between equal and varying values; the values do not change.
_CASTS = frozenset({"pvary"})
# Primitives whose result may differ on every device.
_NOISY = frozenset({"pure_callback", "io_callback", "rng_uniform"})
# Primitives that call one sub-program on their operands and return its results.
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
    }
)
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def varying_axes(jaxpr: ClosedJaxpr, in_axes: Sequence[Axes], tracked: Iterable[str]) -> list[Axes]:
    """For each output of ``jaxpr``, the axes of ``tracked`` across which it may differ.

    Args:
      jaxpr: a per-device program, as ``jax.make_jaxpr`` traces it inside ``shard_map``.
      in_axes: for each input, the axes across which it differs.
      tracked: the mesh axes to follow; the others are ignored.

    Returns:
      One frozenset per output. It may over-approximate (a value that happens to be equal is
      reported as varying when the analysis cannot tell), never under-approximate.

    >>> import jax, jax.numpy as jnp
    >>> from jax.lax import axis_index, psum
    >>> f = lambda x: (psum(x, "stage"), x + axis_index("stage"), x * 2)
    >>> j = jax.make_jaxpr(f, axis_env=[("stage", 4)])(jnp.float32(1))
    >>> [sorted(a) for a in varying_axes(j, [frozenset()], ["stage"])]
    [[], ['stage'], []]
    """
    return _Analysis(frozenset(tracked)).closed(jaxpr, list(in_axes))


class _Analysis:
    """One run of the dataflow analysis, with a memo of the sub-programs it has read."""

    def __init__(self, tracked: Axes) -> None:
        self.tracked = tracked
        self.memo: dict[tuple[int, tuple[Axes, ...]], list[Axes]] = {}
        self.keep: list[Any] = []  # the memo's keys use id(); keep the programs alive

    def closed(self, program: ClosedJaxpr | Jaxpr, ins: list[Axes]) -> list[Axes]:
        key = (id(program), tuple(ins))
        if key not in self.memo:
            self.keep.append(program)
            if isinstance(program, ClosedJaxpr):
                jaxpr, consts = program.jaxpr, [NONE] * len(program.jaxpr.constvars)
            else:  # an open program's constants are unknown here
                jaxpr, consts = program, [self.tracked] * len(program.constvars)
            self.memo[key] = self.run(jaxpr, consts, ins)
        return self.memo[key]

    def run(self, jaxpr: Jaxpr, consts: list[Axes], ins: list[Axes]) -> list[Axes]:
        env: dict[Any, Axes] = {}
        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, ins, strict=True))

        def read(atom) -> Axes:
            return NONE if isinstance(atom, Literal) else env.get(atom, self.tracked)

        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(a) for a in eqn.invars])
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(a) for a in jaxpr.outvars]

    def eqn(self, eqn, ins: list[Axes]) -> list[Axes]:
        name, params, n = eqn.primitive.name, eqn.params, len(eqn.outvars)
        union = NONE.union(*ins)
        named = self.named(params)
        if name in _REDUCING and params.get("axis_index_groups") is None:
            return [union - named] * n
        if name in _NOISY:
            return [self.tracked] * n
        if name in _CASTS:
            return [union] * n
        if name == "cond":
            return self.cond(params, ins)
        if name == "scan":
            return self.scan(params, ins)
        if name == "while":
            return self.while_loop(params, ins)
        if name in _CALLS:
            for key in _CALL_PARAMS:
                sub = params.get(key)
                if isinstance(sub, ClosedJaxpr | Jaxpr) and _arity(sub) == (len(ins), n):
                    return self.closed(sub, ins)
        subs = list(jaxprs_in_params(params))
        if subs:  # an unknown higher-order primitive: whatever its inside may depend on
            inside = NONE.union(*(self.mentioned(s) for s in subs))
            return [union | named | inside] * n
        return [union | named] * n  # element-wise and the like; _SPREADING adds its axes

    def cond(self, params, ins: list[Axes]) -> list[Axes]:
        index, ops = ins[0], ins[1:]
        outs = [self.closed(branch, ops) for branch in params["branches"]]
        return [index.union(*column) for column in zip(*outs, strict=True)]

    def scan(self, params, ins: list[Axes]) -> list[Axes]:
        nc, nk = compat.scan_counts(params)
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        while True:
            outs = self.closed(params["jaxpr"], consts + carry + xs)
            new = [c | o for c, o in zip(carry, outs[:nk], strict=True)]
            if new == carry:
                return carry + outs[nk:]
            carry = new

    def while_loop(self, params, ins: list[Axes]) -> list[Axes]:
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts, carry = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
        while True:
            (pred,) = self.closed(params["cond_jaxpr"], cond_consts + carry)
            outs = self.closed(params["body_jaxpr"], body_consts + carry)
            new = [c | o | pred for c, o in zip(carry, outs, strict=True)]
            if new == carry:
                return carry
            carry = new

    def named(self, params) -> Axes:
        """The tracked axes a primitive's parameters name (``axis_name=``, ``axes=``)."""
        found = set()
        for key, value in params.items():
            if key != "axes" and "axis" not in key:
                continue
            for v in value if isinstance(value, tuple | list | set | frozenset) else (value,):
                if isinstance(v, str) and v in self.tracked:
                    found.add(v)
        return frozenset(found)

    def mentioned(self, jaxpr: Jaxpr) -> Axes:
        """Every tracked axis a program's equations could make a value differ across."""
        found = set()
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _NOISY:
                return self.tracked
            found |= self.named(eqn.params)
            for sub in jaxprs_in_params(eqn.params):
                found |= self.mentioned(sub)
        return frozenset(found)


def _arity(program: ClosedJaxpr | Jaxpr) -> tuple[int, int]:
    jaxpr = program.jaxpr if isinstance(program, ClosedJaxpr) else program
    return len(jaxpr.invars), len(jaxpr.outvars)


# -- the shard_map program whose outputs come back whole -----------------------------------------


def whole_outputs(
    body: Callable,
    *,
    mesh: Mesh,
    state_def: Any,
    state_specs: Sequence[PartitionSpec],
    arg_specs: Sequence[PartitionSpec],
    step: str,
) -> Callable[[list, list], tuple[list, Any, Any]]:
    """``body`` mapped with ``jax.shard_map`` over ``mesh``, its outputs whole; for ``jax.jit``.

    ``body(state_leaves, arg_leaves) -> (new_state_leaves, outputs, extras)`` is one device's
    step; each output leaf has a leading axis of size 1. New state leaves keep ``state_specs``,
    extras are replicated. An output leaf that varies over no non-replica axis is concatenated
    over the replicas (spec ``P(replica_axes)``); one that varies over non-replica axes of size
    > 1 (``stage``) is also concatenated along its own first axis over those, in mesh
    order (spec ``P(replica_axes, ("stage",))``).

    Raises:
      ValueError: when the returned function is traced, before anything runs: for a scalar
        output that varies over a non-replica axis, or a new state leaf that varies over a
        non-replica axis its spec does not name.
    """
    replica = mesh_lib.batch_spec(mesh)
    replica_axes = set(mesh_lib.replica_axes(mesh))
    manual = mesh_lib.manual_axes(mesh)
    tracked = tuple(a for a in manual if a not in replica_axes and mesh.shape[a] > 1)
    # `model` is left to XLA (GSPMD): shard_map hears only of the manual axes, and the arrays
    # keep their whole shardings, which `keep_shardings` holds the new state to.
    manual_state = [mesh_lib.manual_spec(s) for s in state_specs]
    in_specs = (manual_state, [mesh_lib.manual_spec(s) for s in arg_specs])

    def mapped(f: Callable, outputs_spec: Any) -> Callable:
        return keep_shardings(
            jax.shard_map(
                f,
                mesh=mesh,
                in_specs=in_specs,
                out_specs=(manual_state, outputs_spec, PartitionSpec()),
                axis_names=set(manual),
                check_vma=False,
            ),
            mesh,
            state_specs,
        )

    if not tracked:  # every device of a replica is the replica: nothing can differ
        return mapped(body, replica)

    def program(state_leaves: list, arg_leaves: list) -> tuple[list, Any, Any]:
        closed, shapes = _trace(mapped, replica, body, state_leaves, arg_leaves)
        in_axes = [mesh_lib.spec_axes(s) & set(tracked) for s in (*state_specs, *arg_specs)]
        tree = jax.tree.structure(shapes)
        new_axes, out_axes, _ = jax.tree.unflatten(tree, varying_axes(closed, in_axes, tracked))
        _check_state(new_axes, state_specs, state_def, mesh, step)
        specs = _output_specs(shapes[1], out_axes, replica, mesh, step)

        def replay(s: list, a: list) -> Any:
            return jax.tree.unflatten(tree, jaxpr_as_fun(closed)(*s, *a))

        return mapped(replay, specs)(state_leaves, arg_leaves)

    return program


def keep_shardings(program: Callable, mesh: Mesh, state_specs: Sequence[PartitionSpec]):
    """``program`` with its new state constrained to ``state_specs`` over the whole mesh, when
    the mesh has axes that `mesh_lib.manual_axes` leaves to XLA: the state keeps its sharding
    over ``model`` whatever XLA would choose."""
    if mesh_lib.manual_axes(mesh) == tuple(mesh.axis_names):
        return program

    def constrained(state_leaves: list, arg_leaves: list):
        new, outputs, extras = program(state_leaves, arg_leaves)
        new = [
            jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
            for x, spec in zip(new, state_specs, strict=True)
        ]
        return new, outputs, extras

    return constrained


def _trace(mapped: Callable, replica: PartitionSpec, body: Callable, state_leaves, arg_leaves):
    """The per-device jaxpr of ``body`` and its output shapes, traced once inside ``shard_map``.

    Tracing inside the real mapping gives the program exactly as it will run (the manual mesh
    axes, ``check_vma=False``); the caller runs the same jaxpr, so ``step_fn`` is traced once.
    """
    captured = []

    def capture(s: list, a: list) -> Any:
        closed, shapes = jax.make_jaxpr(body, return_shape=True)(s, a)
        captured.append((closed, shapes))
        return jax.tree.unflatten(jax.tree.structure(shapes), jaxpr_as_fun(closed)(*s, *a))

    jax.make_jaxpr(mapped(capture, replica))(state_leaves, arg_leaves)
    return captured[0]


def _check_state(new_axes, state_specs, state_def, mesh: Mesh, step: str) -> None:
    """Refuses a new state leaf that varies over an axis its spec keeps one copy for."""
    for i, (axes, spec) in enumerate(zip(new_axes, state_specs, strict=True)):
        extra = axes - mesh_lib.spec_axes(spec)
        if not extra:
            continue
        path = _state_path(state_def, i)
        names = _ordered(extra, mesh)
        copies = math.prod(mesh.shape[a] for a in names)
        raise ValueError(
            f"Replicator.run: {step} returned state leaf {path} that differs across the mesh "
            f"{_axes_words(names)}, but its sharding {spec} keeps one copy for all of "
            f"{_quoted(names)}: one of its {copies} versions would be kept and the others "
            f"silently dropped. Make it the same on every device of {_quoted(names)} by "
            f"reducing it in step_fn (e.g. pmean(x, {_entry_repr(names)}) from jax.lax), or "
            f"keep one copy per {_quoted(names, ' and ', quote=False)}: give the leaf a leading axis of "
            f"size {copies} and place it with P({_entry_repr(names)}) "
            f"(repl.place(x, P({_entry_repr(names)})))."
        )


def _output_specs(outputs, out_axes, replica: PartitionSpec, mesh: Mesh, step: str) -> Any:
    """Each output leaf's out spec; refuses a varying scalar, which cannot be concatenated."""
    paths = jax.tree_util.tree_flatten_with_path(outputs)[0]
    specs = []
    for (path, shape), axes in zip(paths, jax.tree.leaves(out_axes), strict=True):
        if not axes:
            specs.append(replica)
            continue
        names = _ordered(axes, mesh)
        if len(shape.shape) == 1:  # a scalar, with the replica axis added
            rows = math.prod(mesh.shape[a] for a in names)
            raise ValueError(
                f"Replicator.run: output {jax.tree_util.keystr(path) or '(the outputs)'} of "
                f"{step} is a scalar that differs across the mesh {_axes_words(names)}. "
                f"Outputs come back whole: one that differs across {_quoted(names)} is "
                f"concatenated over {'it' if len(names) == 1 else 'them'} along its first axis, "
                f"and a scalar has none. Return "
                f"x[None] to get one row per {_quoted(names, ' and ', quote=False)} (shape "
                f"[num_replicas, {rows}]), or reduce it across {_quoted(names)} in step_fn "
                f"first (e.g. psum(x, {_entry_repr(names)}) or pmean from jax.lax)."
            )
        specs.append(PartitionSpec(replica[0], names[0] if len(names) == 1 else names))
    return jax.tree.unflatten(jax.tree.structure(outputs), specs)


def _ordered(axes: Axes, mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a in axes)


def _axes_words(names: tuple[str, ...]) -> str:
    return ("axis " if len(names) == 1 else "axes ") + _quoted(names)


def _quoted(names: tuple[str, ...], sep: str = " and ", *, quote: bool = True) -> str:
    return sep.join(repr(a) if quote else a for a in names)


def _entry_repr(names: tuple[str, ...]) -> str:
    return repr(names[0]) if len(names) == 1 else repr(names)


def _state_path(state_def: Any, index: int) -> str:
    leaves = jax.tree.unflatten(state_def, range(state_def.num_leaves))
    path = jax.tree_util.tree_flatten_with_path(leaves)[0][index][0]
    return jax.tree_util.keystr(path) or "(the state)"
