"""The compiled steps of a `Replicator`: one program per placement of the inputs, and dispatch.

``Replicator.run`` asks `StepCache.program` for the program of a step and its inputs' placement
(compiled by `lowering.build` on the first call, then cached), and runs it through
`StepCache.dispatch`, which keeps at most ``max_in_flight`` steps dispatched but not finished.
``Replicator.lower`` and ``Replicator.explain`` use the same programs, unrun.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator

import jax
from jax.sharding import Mesh, PartitionSpec

from replicator._src.core import compat, errors, leaf_specs
from replicator._src.core import lowering as lowering_lib
from replicator._src.core.typing import PyTree, StepFn


class StepCache:
    """The programs of one replicator's steps, keyed by step, structure and placement.

    Args:
      mesh: the replicator's mesh.
      lowering: ``"shard_map"``, ``"pmap"`` or ``"local"``.
      donate: donate the state's buffers to the step; `donation_suspended` turns it off for a
        block (programs that keep their inputs are cached apart).
      check_inside: compare replicated state across replicas inside every step
        (``check_replicas=True`` with more than one replica).
      max_in_flight: how many steps `dispatch` may leave running before it waits for the oldest.
    """

    def __init__(
        self, mesh: Mesh, lowering: str, *, donate: bool, check_inside: bool, max_in_flight: int
    ) -> None:
        self._mesh, self._lowering = mesh, lowering
        self.donate = donate
        self._check_inside = check_inside
        self._programs: dict = {}
        self._max_in_flight = max_in_flight
        self._in_flight: collections.deque[jax.Array] = collections.deque()

    @contextlib.contextmanager
    def donation_suspended(self) -> Iterator[None]:
        """Within the block, `program` gives programs that donate no buffers (cached apart from
        the donating ones), so that the inputs of ``run`` outlive it."""
        donate, self.donate = self.donate, False
        try:
            yield
        finally:
            self.donate = donate

    def program(
        self, step_fn: StepFn, state_leaves, state_def, arg_leaves, args_def, args
    ) -> tuple[lowering_lib.Program, tuple[PartitionSpec, ...]]:
        """The cached program for these inputs (compiled on a miss) and the state's specs."""
        # The cache key holds each leaf's sharding object and shape, which are cheap to read
        # and compare; equal placements give equal specs, computed only on a miss.
        key = (
            step_fn,
            self.donate,
            state_def,
            args_def,
            tuple(map(leaf_specs.placement_key, state_leaves)),
            tuple(map(leaf_specs.placement_key, arg_leaves)),
        )
        cached = self._programs.get(key)
        if cached is None:
            cached = self._programs[key] = self.compile(
                step_fn, state_def, args_def, state_leaves, arg_leaves, args
            )
        return cached

    def compile(
        self, step_fn: StepFn, state_def, args_def, state_leaves, arg_leaves, args
    ) -> tuple[lowering_lib.Program, tuple[PartitionSpec, ...]]:
        """A new program for these inputs, uncached (``explain`` traces ``step_fn`` again)."""
        state_specs = leaf_specs.state_specs(self._mesh, state_leaves, state_def)
        arg_specs = tuple(
            leaf_specs.arg_spec(self._mesh, x, i, args) for i, x in enumerate(arg_leaves)
        )
        program = lowering_lib.build(
            self._lowering,
            step_fn,
            mesh=self._mesh,
            state_def=state_def,
            args_def=args_def,
            state_specs=state_specs,
            arg_specs=arg_specs,
            donate=self.donate,
            check_replicas=self._check_inside,
        )
        return program, state_specs

    def dispatch(self, program: lowering_lib.Program, state_leaves: list, arg_leaves: list):
        """Runs ``program`` once the steps in flight are fewer than ``max_in_flight``.

        Returns:
          The program's ``(new_state_leaves, outputs, extras)``, possibly not yet computed.
        """
        while len(self._in_flight) >= self._max_in_flight:
            self._in_flight.popleft().block_until_ready()
        new_leaves, outputs, extras = program(state_leaves, arg_leaves)
        self._in_flight.append(extras["done"] if "done" in extras else jax.tree.leaves(outputs)[0])
        return new_leaves, outputs, extras


def default_max_in_flight(mesh: Mesh) -> int:
    """``max_in_flight``'s default: 2 on several CPU devices where queued collectives may hang.

    They may hang on one process with the jax releases `compat.CPU_COLLECTIVES_HANG_WHEN_QUEUED`
    names, and with several processes on any; elsewhere the default is unbounded.
    """
    on_cpu = mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1
    hangs = compat.CPU_COLLECTIVES_HANG_WHEN_QUEUED or jax.process_count() > 1
    return 2 if on_cpu and hangs else sys.maxsize


def raise_if_donated(state_leaves: list, state: PyTree) -> None:
    """Refuses a state with a leaf donated to an earlier run (or deleted).

    Raises:
      ValueError: naming the first deleted leaf, and the fix.
    """
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in state_leaves):
        return
    path = errors.deleted_leaf(state)
    if path is not None:
        raise ValueError(
            f"Replicator.run: state leaf {path} was "
            f"donated to an earlier run (or deleted), so its buffer is gone. Pass the state "
            f"that run returned (state, out = repl.run(step_fn, state, batch); rp.fit "
            f"returns it as result.state), or Replicator(donate=False) to keep inputs alive."
        )
