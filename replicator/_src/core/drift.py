"""The replica drift check of ``Replicator(check_replicas=...)``.

A replicated state leaf (one whose spec does not split it over the replicas) must hold the same
value on every replica after a step. `DriftCheck` compares them: inside every step
(``check_replicas=True``: the lowering adds the comparison to the program), or after each of
the first ``n`` runs of each compiled step with a separate small program
(`lowering.build_replica_check`), and raises `ReplicasDivergedError` naming the first leaf that
differs.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from replicator._src.core import errors
from replicator._src.core import lowering as lowering_lib
from replicator._src.core import mesh as mesh_lib
from replicator._src.core.typing import PyTree, StepFn


def checked_policy(check_replicas: bool | int | None) -> bool | int:
    """``check_replicas`` validated, with None (the default) as 2.

    Raises:
      TypeError, ValueError: if it is not True, False, None or an int >= 0.
    """
    if check_replicas is None:
        check_replicas = 2  # the default: the first two runs of each compiled step
    if not isinstance(check_replicas, bool) and (
        not isinstance(check_replicas, int | np.integer) or check_replicas < 0
    ):
        raise (ValueError if isinstance(check_replicas, int | np.integer) else TypeError)(
            f"Replicator: check_replicas must be True, False, None or an int >= 0; got "
            f"{check_replicas!r}. None (the default) checks that replicated state agrees "
            f"across replicas after the first 2 runs of each compiled step, n after the "
            f"first n, True after every run (inside the step), False never."
        )
    return check_replicas


class DriftCheck:
    """When and how a replicator compares its replicated state across replicas.

    Args:
      mesh: the replicator's mesh.
      lowering: its lowering; nothing is checked under ``"local"`` or with one replica.
      check_replicas: True, False or an int >= 0, as `checked_policy` returns it.
    """

    def __init__(self, mesh: Mesh, lowering: str, check_replicas: bool | int) -> None:
        self._mesh = mesh
        multi = mesh_lib.num_replicas(mesh) > 1 and lowering != "local"
        # True: a check inside the step, every run. An int n: a separate check program after
        # each of the first n runs of each compiled step (``_runs`` counts them per program),
        # cached per placement of the state in ``_checks``.
        self.inside = check_replicas is True and mesh_lib.num_replicas(mesh) > 1
        self._first_runs = int(check_replicas) if multi and check_replicas is not True else 0
        self._runs: dict[Any, int] = {}
        self._checks: dict[tuple, Any] = {}

    def after_run(
        self,
        program: Any,
        step_fn: StepFn,
        state: PyTree,
        state_leaves: list,
        outputs: PyTree,
        state_specs: tuple[PartitionSpec, ...],
        extras: dict,
    ) -> None:
        """Checks the ``state`` (of ``state_leaves``) that ``program`` returned, if this run is
        one to check.

        Raises:
          ReplicasDivergedError: if a replicated state leaf differs across replicas.
        """
        if "diverged" in extras:
            self._raise_if_diverged(step_fn, state, outputs, state_specs, extras)
        elif self._runs.get(program, 0) < self._first_runs:
            self._runs[program] = self._runs.get(program, 0) + 1
            if state_specs not in self._checks:
                self._checks[state_specs] = lowering_lib.build_replica_check(
                    self._mesh, state_specs
                )
            check = self._checks[state_specs]
            if check is not None:
                diverged, spread = check(state_leaves)
                extras = {"diverged": diverged, "spread": spread}
                self._raise_if_diverged(step_fn, state, outputs, state_specs, extras)

    def _raise_if_diverged(self, step_fn, state, outputs, state_specs, extras) -> None:
        flags, spreads = np.asarray(extras["diverged"]), np.asarray(extras["spread"])
        if not flags.any():
            return
        checked = [
            path
            for (path, _), spec in zip(
                jax.tree_util.tree_flatten_with_path(state)[0], state_specs, strict=True
            )
            if not mesh_lib.spec_uses_replica_axes(spec, self._mesh)
        ]
        first = int(np.argmax(flags))
        path = jax.tree_util.keystr(checked[first]) or "(the state)"
        raise errors.ReplicasDivergedError(
            errors.DIVERGED.format(
                step=lowering_lib.step_name(step_fn),
                path=path,
                spread=f"{spreads[first]:.3g}",
                count=int(flags.sum()),
            ),
            path=path,
            state=state,
            outputs=outputs,
        )
