"""Lowerings: turn a one-replica ``step_fn`` into a program over the mesh.

Three lowerings share one per-replica body (`_per_replica`): it binds the placeholder
collectives, calls ``step_fn``, checks what it returned and stacks the outputs. They differ only
in how that body is mapped over the devices:

* ``local``: called eagerly, once, on the whole batch; collectives are identities.
* ``shard_map``: ``jax.jit(jax.shard_map(body, check_vma=False))`` over the whole mesh.
* ``pmap``: ``jax.jit`` around ``jax.pmap(body)`` over the replica devices; on several
  processes, ``jax.pmap`` outside ``jax.jit`` on each process's part of the inputs.

``check_vma=False`` gives per-replica gradient semantics: ``jax.grad`` inside ``step_fn`` with
respect to a replicated parameter is the *local* gradient, exactly as on one device (with
``check_vma=True`` it would silently be summed over replicas, and a later ``pmean`` would be a
no-op). Reductions happen only where ``step_fn`` (or ``wrap_optimizer``) asks for them.

Outputs come back whole. Every output leaf is stacked along a leading axis of size
``num_replicas``. Under ``shard_map`` on a mesh with a ``stage`` axis of size > 1 (``model`` is
left to XLA: values are whole along it), a leaf that differs across it is also concatenated along its own first axis over those
axes, in mesh order (out spec ``P(replica_axes, ("stage",))``): a pipeline's ``g_stages`` of
``[1, 4, 8, 8]`` per device on ``{"data": 2, "stage": 4}`` comes back ``[2, 4, 4, 8, 8]``. A leaf
equal across them keeps ``[num_replicas, ...]``. Which leaves differ is decided when the step is
traced, by a dataflow analysis of its jaxpr (`variance`). What cannot come back whole is refused
before the step runs: a scalar output that differs across ``stage`` (no axis to concatenate
along) and a new state leaf that differs across an axis its ``PartitionSpec`` does not name (one
block would be kept). ``pmap`` and ``local`` have no such axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator._src.core import compat, errors, leaf_specs, placement, variance
from replicator._src.core import mesh as mesh_lib
from replicator._src.core.binding import LOCAL, Binding, bind
from replicator._src.core.collectives import max_over_axes, min_over_axes
from replicator._src.core.typing import PyTree

LOWERINGS = ("shard_map", "pmap", "local")

# A compiled step takes (state_leaves, arg_leaves) and returns (new_state_leaves,
# stacked_outputs, extras). extras holds replicated scalars: when there are no outputs, "done",
# which is ready when the step has run; with check_replicas, "diverged" and "spread", one entry
# per checked state leaf.
Program = Callable[[list, list], tuple[list, PyTree, Any]]


def build(
    lowering: str,
    step_fn: Callable,
    *,
    mesh: Mesh,
    state_def: Any,
    args_def: Any,
    state_specs: Sequence[PartitionSpec],
    arg_specs: Sequence[PartitionSpec],
    donate: bool,
    check_replicas: bool,
) -> Program:
    """Builds the program for one placement of the inputs (a cache entry of ``Replicator.run``)."""
    axes = mesh_lib.replica_axes(mesh)
    check = [check_replicas and not mesh_lib.spec_uses_replica_axes(s, mesh) for s in state_specs]
    if lowering == "local":
        body = _per_replica(step_fn, LOCAL, state_def, args_def, [False] * len(state_specs))
        return body
    if lowering == "shard_map":
        manual = tuple((a, mesh.shape[a]) for a in mesh_lib.manual_axes(mesh))
        binding = Binding(
            "shard_map", axes, mesh_lib.num_replicas(mesh), manual,
            platform=mesh.devices.flat[0].platform,
        )  # fmt: skip
        body = _per_replica(step_fn, binding, state_def, args_def, check, state_specs)
        # Outputs that differ across the stage axis are concatenated over it (or
        # refused), so that none comes back with one block only: see `variance.whole_outputs`.
        mapped = variance.whole_outputs(
            body,
            mesh=mesh,
            state_def=state_def,
            state_specs=state_specs,
            arg_specs=arg_specs,
            step=step_name(step_fn),
        )
        return jax.jit(mapped, donate_argnums=(0,) if donate else ())
    if lowering == "pmap":
        return _build_pmap(
            step_fn, mesh, state_def, args_def, state_specs, arg_specs, donate, check
        )
    raise ValueError(f"unknown lowering {lowering!r}")  # validated by Replicator


def _per_replica(
    step_fn, binding: Binding, state_def, args_def, check: Sequence[bool], state_specs=None
):
    """The body every lowering maps: one replica's step on flat leaves.

    Outputs get a leading axis of size 1 that the mapping concatenates into the replica axis
    (pmap, which stacks by itself, drops it again).
    """

    def body(state_leaves, arg_leaves):
        state = jax.tree.unflatten(state_def, state_leaves)
        args = jax.tree.unflatten(args_def, arg_leaves)
        if state_specs is not None:  # each state leaf's spec, and whether it is a stage block
            placed = {
                id(x): (
                    x,
                    tuple(a for a in binding.model_axes() if a in mesh_lib.spec_axes(spec)),
                    spec,
                )
                for x, spec in zip(state_leaves, state_specs, strict=True)
            }
            binding_now = dataclasses.replace(binding, state_axes=placed)
        else:
            binding_now = binding
        with bind(binding_now):
            result = step_fn(state, *args)
        new_state, outputs = _check_result(step_fn, result, state)
        outputs = jax.tree.map(lambda v: jnp.asarray(v)[None], outputs)
        new_leaves = jax.tree.leaves(new_state)
        # "done" marks the step finished when there is no output to wait on (the new state
        # cannot serve: the next step deletes it by donation).
        extras = {} if jax.tree.leaves(outputs) else {"done": jnp.zeros((), jnp.int32)}
        if any(check):
            flags, spreads = _divergence(new_leaves, check, binding.axes)
            # A leaf sharded over another axis (a pipeline's "stage") is checked block by
            # block; the step's verdict covers every block.
            others = tuple(a for a, _ in binding.axis_sizes if a not in binding.axes)
            if others:
                flags = max_over_axes(flags.astype(jnp.int32), others).astype(bool)
                spreads = max_over_axes(spreads, others)
            extras["diverged"], extras["spread"] = flags, spreads
        return new_leaves, outputs, extras

    return body


def _check_result(step_fn, result, state):
    if not (isinstance(result, tuple | list) and len(result) == 2):
        got = "a single array" if isinstance(result, jax.Array) else f"a {type(result).__name__}"
        if isinstance(result, tuple | list):
            got += f" of length {len(result)}"
        raise TypeError(errors.STEP_RESULT.format(got=got))
    new_state, outputs = result
    old = jax.tree_util.tree_flatten_with_path(state)[0]
    new, new_def = jax.tree_util.tree_flatten_with_path(new_state)
    if new_def != jax.tree.structure(state):
        raise ValueError(
            f"Replicator.run: {step_name(step_fn)} returned a state whose structure differs from "
            f"the state it was given.\n  given:    {jax.tree.structure(state)}\n  returned: "
            f"{new_def}\nReturn the same kind of state (e.g. state.replace(...) or "
            f"state.apply_gradients(...)), with the same leaves."
        )
    for (path, a), (_, b) in zip(old, new, strict=True):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                f"Replicator.run: {step_name(step_fn)} changed state leaf "
                f"{jax.tree_util.keystr(path)} from {jnp.result_type(a)}{list(jnp.shape(a))} to "
                f"{jnp.result_type(b)}{list(jnp.shape(b))}. The state must keep its shapes and "
                f"dtypes from step to step; cast back (e.g. .astype({jnp.result_type(a)}))."
            )
    for path, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | complex):
            raise TypeError(
                f"Replicator.run: output {jax.tree_util.keystr(path) or '(the outputs)'} of "
                f"{step_name(step_fn)} is a {type(leaf).__name__}, not an array or number. "
                f"Outputs come back stacked over replicas, so they must be arrays; return "
                f"strings and other Python objects outside step_fn.\n\n"
                + errors.STEP_RESULT.format(got=f"outputs containing a {type(leaf).__name__}")
            )
    return new_state, outputs


def step_name(fn) -> str:
    return f"step_fn {getattr(fn, '__qualname__', fn)!s}"


def _divergence(leaves, check, axes):
    """Per checked leaf: whether its bits differ across replicas, and the spread of its values."""
    flags, spreads = [], []
    for leaf, checked in zip(leaves, check, strict=True):
        if not checked:
            continue
        leaf = _comparable(jnp.asarray(leaf))
        bits = _as_bits(leaf)
        flags.append(jnp.any(max_over_axes(bits, axes) != min_over_axes(bits, axes)))
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            spread = max_over_axes(leaf, axes) - min_over_axes(leaf, axes)
            spread = jnp.max(jnp.abs(spread), initial=0)
            spreads.append(spread.astype(jnp.float32))
        else:
            spreads.append(jnp.zeros((), jnp.float32))
    return jnp.stack(flags), jnp.stack(spreads)


def _as_bits(x: jax.Array) -> jax.Array:
    """The array reinterpreted as integers, so that NaNs compare equal to themselves."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag])
    if jnp.issubdtype(x.dtype, jnp.floating):
        return lax.bitcast_convert_type(x, jnp.dtype(f"int{x.dtype.itemsize * 8}"))
    return x


def _build_pmap(step_fn, mesh, state_def, args_def, state_specs, arg_specs, donate, check):
    """``jax.jit(jax.pmap(body))``: leaves split over replicas get a leading replica axis.

    On several processes, ``jax.pmap`` is called outside ``jax.jit``: `_pmap_across_processes`.
    """
    n = mesh_lib.num_replicas(mesh)
    # Tuples: pmap hashes its in_axes and out_axes, which must match the leaves' containers.
    state_axes = tuple(_pmap_axis(s, mesh, "state") for s in state_specs)
    arg_axes = tuple(_pmap_axis(s, mesh, "argument") for s in arg_specs)
    binding = Binding("pmap", ("data",), n, (("data", n),), platform=mesh.devices.flat[0].platform)
    body = _per_replica(step_fn, binding, state_def, args_def, check)
    mapped = jax.pmap(  # weak: which input leaves are weakly typed (several processes)
        lambda s, a, weak: _unstack_outputs(*body(*map(_weak_again, (s, a), weak))),
        axis_name="data",
        in_axes=(state_axes, arg_axes),
        out_axes=(state_axes, 0, None),
        static_broadcasted_argnums=(2,),
        devices=list(mesh.devices.flat),
    )
    if jax.process_count() > 1:
        return _pmap_across_processes(mapped, mesh, state_specs, arg_specs, state_axes, arg_axes)

    def program(state_leaves, arg_leaves):
        new, outputs, extras = mapped(
            _split(state_leaves, state_axes, n), _split(arg_leaves, arg_axes, n), ((), ())
        )
        return _merge(new, state_axes), outputs, extras

    out_shardings = (
        [NamedSharding(mesh, s) for s in state_specs],
        mesh_lib.batch_sharding(mesh),
        mesh_lib.replicated_sharding(mesh),
    )
    return jax.jit(program, donate_argnums=(0,) if donate else (), out_shardings=out_shardings)


def _split(leaves, leaf_axes, n):
    """Axis a of n parts becomes (n, part) at a, the axis pmap maps."""
    return tuple(
        x if a is None else x.reshape((*x.shape[:a], n, -1, *x.shape[a + 1 :]))
        for x, a in zip(leaves, leaf_axes, strict=True)
    )


def _merge(leaves, leaf_axes):
    """The inverse of `_split`: (n, part) at a becomes axis a again."""
    return [
        x if a is None else x.reshape((*x.shape[:a], -1, *x.shape[a + 2 :]))
        for x, a in zip(leaves, leaf_axes, strict=True)
    ]


def _pmap_across_processes(mapped, mesh, state_specs, arg_specs, state_axes, arg_axes):
    """The pmap program on several processes: pmap called outside ``jax.jit``.

    Traced inside ``jax.jit``, ``jax.pmap`` maps over this process's devices only, so it would
    split a global array over too few devices. Called outside, it maps over the devices of every
    process, with each process passing its host-local part of every input (leading axis: its
    own replicas) and getting back its part of every result. The program converts the global
    arrays to those parts and the results back to global arrays with the state's shardings.
    The state's buffers are not donated: the inputs stay alive until they are dropped.
    """
    n_local = mesh_lib.num_local_replicas(mesh)
    state_specs, arg_specs = list(state_specs), list(arg_specs)
    out_specs = (state_specs, mesh_lib.batch_spec(mesh), PartitionSpec())

    def placed(leaves, specs):
        # A leaf not on the mesh (NumPy, a scalar, an array of this process) is the global
        # value: placed first, as jax.jit would, it is not mistaken for a host-local part.
        return [
            x
            if leaf_specs.spec_of(mesh, x) is not None
            else jax.device_put(x, NamedSharding(mesh, s))
            for x, s in zip(leaves, specs, strict=True)
        ]

    def local_parts(state_leaves, arg_leaves):
        state_leaves, arg_leaves = placed(state_leaves, state_specs), placed(arg_leaves, arg_specs)
        local = multihost_utils.global_array_to_host_local_array
        return (
            _split(local(state_leaves, mesh, state_specs), state_axes, n_local),
            _split(local(arg_leaves, mesh, arg_specs), arg_axes, n_local),
            tuple(tuple(x.weak_type for x in leaves) for leaves in (state_leaves, arg_leaves)),
        )

    def program(state_leaves, arg_leaves):
        new, outputs, extras = mapped(*local_parts(state_leaves, arg_leaves))
        result = (_merge(new, state_axes), outputs, extras)
        return multihost_utils.host_local_array_to_global_array(result, mesh, out_specs)

    program.lower = lambda state_leaves, arg_leaves: mapped.lower(
        *local_parts(state_leaves, arg_leaves)
    )
    return program


def _weak_again(leaves, weak):
    """The leaves flagged in ``weak`` (empty: none) weakly typed again: pmap's conversion of
    host-local inputs to global arrays drops the weak type a Python scalar has under jit."""
    return (
        tuple(compat.weakly_typed(x) if w else x for x, w in zip(leaves, weak)) if weak else leaves
    )


def _unstack_outputs(state_leaves, outputs, extras):
    return tuple(state_leaves), jax.tree.map(lambda v: v[0], outputs), extras


def _pmap_axis(spec: PartitionSpec, mesh: Mesh, what: str) -> int | None:
    """The axis of a leaf split over the replicas (ZeRO splits any one), or None if it is
    replicated."""
    split = [d for d, e in enumerate(spec) if e is not None]
    if not split:
        return None
    entry = spec[split[0]]
    names = entry if isinstance(entry, tuple) else (entry,)
    if len(split) == 1 and set(names) == set(mesh_lib.replica_axes(mesh)):
        return split[0]
    raise ValueError(
        f"Replicator(lowering='pmap'): a {what} leaf has sharding {spec}; pmap maps only leaves "
        f"that are replicated or split along one axis over the replicas. Use "
        f"lowering='shard_map' (the default), which takes any sharding."
    )


def mesh_for(
    lowering: str, mesh_shape: Mapping[str, int] | None, *, devices: Sequence[jax.Device] | None
) -> Mesh:
    """The mesh of ``Replicator(mesh_shape, lowering=lowering, devices=devices)``, validated.

    Raises:
      ValueError: if ``lowering`` is unknown, the mesh has no data axis, or it does not suit
        the lowering (``local``: one device; ``pmap``: no other axis of size > 1).
    """
    if lowering not in LOWERINGS:
        raise ValueError(
            f"Replicator: lowering={lowering!r} is not one of {', '.join(map(repr, LOWERINGS))}."
        )
    mesh_shape = {"data": -1} if mesh_shape is None else mesh_shape
    if lowering == "local":
        devices = list(jax.devices()[:1] if devices is None else devices)
    mesh = mesh_lib.build_mesh(mesh_shape, devices=devices)
    if not mesh_lib.replica_axes(mesh):
        raise ValueError(
            f"Replicator: mesh_shape={dict(mesh_shape)} has no data axis; add "
            f'"data": 1 (no data parallelism) or "data": -1.'
        )
    if lowering == "local" and mesh.devices.size != 1:
        raise ValueError(
            f"Replicator(lowering='local') runs one replica on one device, but "
            f"mesh_shape={dict(mesh_shape)} uses {mesh.devices.size}; pass "
            f"devices=jax.devices()[:1] or use lowering='shard_map'."
        )
    if lowering == "pmap":
        check_pmap_mesh(mesh)
    return mesh


def check_pmap_mesh(mesh: Mesh) -> None:
    """pmap has one axis: every non-replica axis of the mesh must have size 1."""
    others = {k: v for k, v in mesh.shape.items() if k not in mesh_lib.DATA_AXES and v > 1}
    if others:
        raise ValueError(
            f"Replicator(lowering='pmap'): pmap maps over replicas only, but mesh_shape has "
            f"{others}. Use lowering='shard_map' (the default) for meshes with stage, "
            f"expert, context or model axes."
        )


def binding_axes(lowering: str, mesh: Mesh) -> tuple[str, ...]:
    """The replica axes the placeholder collectives bind to while ``lowering`` traces a step.

    The same axes as the `Binding` that `build` pushes: none for ``local``, the pmap axis
    ``"data"`` for ``pmap``, the mesh's data axes for ``shard_map``.
    """
    if lowering == "local":
        return ()
    if lowering == "pmap":
        return ("data",)
    return mesh_lib.replica_axes(mesh)


ReplicaCheck = Callable[[list], tuple[jax.Array, jax.Array]]


def build_replica_check(mesh: Mesh, state_specs: Sequence[PartitionSpec]) -> ReplicaCheck | None:
    """A program that compares a step's replicated state leaves across replicas, apart from it.

    ``check(state_leaves)`` takes the leaves of the state a step returned (placed with
    ``state_specs``) and returns ``(diverged, spread)``: per leaf whose spec does not use the
    replica axes, in order, whether its bits differ across replicas and the largest spread of
    its values, the same verdict as ``check_replicas=True`` computes inside the step. Each
    device reads its own buffer of a "replicated" leaf (``shard_map`` with the leaves' own
    specs, ``check_vma=False``); a leaf split over another axis (``stage``, ``model``) is
    compared block by block and its verdict covers every block. The step itself is not
    recompiled: this is a separate, small program, run by ``Replicator.run`` after a step's
    first runs.

    Returns:
      The check, or ``None`` when no leaf is replicated over the replicas (nothing to compare).
    """
    checked = [not mesh_lib.spec_uses_replica_axes(s, mesh) for s in state_specs]
    if not any(checked):
        return None
    specs = [s for s, c in zip(state_specs, checked, strict=True) if c]
    axes = mesh_lib.replica_axes(mesh)
    others = tuple(a for a in mesh.axis_names if a not in axes)

    def body(leaves):
        flags, spreads = _divergence(leaves, [True] * len(leaves), axes)
        if others:
            flags = max_over_axes(flags.astype(jnp.int32), others).astype(bool)
            spreads = max_over_axes(spreads, others)
        return flags, spreads

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs,),
        out_specs=(PartitionSpec(), PartitionSpec()),
        check_vma=False,
    )
    # Explicit input shardings: a leaf placed otherwise is refused rather than resharded (a
    # reshard of a "replicated" leaf could copy one replica's buffer to all and hide a drift).
    program = jax.jit(mapped, in_shardings=([NamedSharding(mesh, s) for s in specs],))

    def check(state_leaves: list) -> tuple[jax.Array, jax.Array]:
        leaves = [x for x, c in zip(state_leaves, checked, strict=True) if c]
        return program(placement.to_device(leaves))  # compared on the device (`rp.to_host`)

    return check


def _comparable(x: jax.Array) -> jax.Array:
    """``x`` as an array that `max_over_axes`/`min_over_axes` accept: key data for PRNG keys,
    the real and imaginary parts of complex numbers."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.stack([x.real, x.imag])
    return x
