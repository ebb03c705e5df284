"""`fit`'s non-finite checks: `NonFiniteError` and the `FiniteGuard` that raises it.

The guard reads the scalar outputs of the steps `fit` logs or saves, and the whole state right
before each checkpoint, so that a run stops before anything non-finite is saved. Every process
stops together, at the same step, with the same message: what each process found is gathered
(`first_anywhere`), since a process sees only its own rows of the outputs, and its own copies of
the state (which may differ across processes if replicas drifted apart).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.core.typing import PyTree
from replicator._src.training.checkpoint import Checkpoints


class NonFiniteError(FloatingPointError):
    """`fit` stopped because a training output or the state is not finite (nan or inf).

    Raised before anything non-finite is saved: every checkpoint of the run is kept, and the
    run resumes from the newest (for example with a lower learning rate) when started again.
    """


NONFINITE = """\
rp.fit: {what} at step {step}. Stopped before saving anything non-finite: {kept}
Lower the learning rate, check the data (or pass loss_scale="dynamic" to wrap_optimizer, which \
skips steps whose gradients are not finite), then run again{resume}."""


class FiniteGuard:
    """Stops `fit` with `NonFiniteError` when a checked output or the state is not finite."""

    def __init__(self, ckpt: Checkpoints | None) -> None:
        self._ckpt = ckpt
        self._skipped: float | None = None  # the last ``skipped`` count of loss scaling seen

    def check_outputs(self, step: int, metrics: dict) -> None:
        skipped = [v for k, v in metrics.items() if k.split(".")[-1] == "skipped"]
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not np.isfinite(v)]
        if skipped:
            handled = self._skipped is None or skipped[0] > self._skipped
            self._skipped = skipped[0]
            if handled:  # the optimizer skipped this step: its state did not change
                bad = []
        names = list(metrics)  # the same on every process: the outputs' structure
        mine = (names.index(bad[0]), metrics[bad[0]]) if bad else (None, 0.0)
        found = first_anywhere(*mine)
        if found is not None:
            process, index, value = found
            what = f"the training output {names[index]!r} is {value}{_on(process)}"
            raise NonFiniteError(self._message(what, step))

    def check_state(self, step: int, state: PyTree) -> None:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        leaf = nonfinite_leaf(state)
        found = first_anywhere(paths.index(leaf) if leaf is not None else None)
        if found is not None:
            process, index, _ = found
            raise NonFiniteError(
                self._message(
                    f"state leaf {paths[index]} is not finite (nan or inf){_on(process)}", step
                )
            )

    def _message(self, what: str, step: int) -> str:
        ckpt = self._ckpt
        newest = ckpt.latest_step() if ckpt is not None else None
        if ckpt is None:
            kept, resume = "there is no checkpoint_dir, so nothing was saved.", ""
        elif newest is None:
            kept = f"no checkpoint in {ckpt.directory} yet."
            resume = " (it starts from step 0)"
        else:
            kept = f"the checkpoints in {ckpt.directory} are kept (newest: step {newest})."
            resume = f" to resume from step {newest}"
        return NONFINITE.format(what=what, step=step, kept=kept, resume=resume)


def first_anywhere(index: int | None, value: float = 0.0) -> tuple[int, int, float] | None:
    """``(process, index, value)`` of the first process whose ``index`` is not None, or None if
    every process's is: the same answer on every process."""
    if jax.process_count() == 1:
        return None if index is None else (0, index, value)
    from jax.experimental import multihost_utils

    mine = np.array([-1 if index is None else index, value], np.float32)
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    for process, (i, v) in enumerate(rows):
        if i >= 0:
            return process, int(i), float(v)
    return None


def _on(process: int) -> str:
    """`` on process N`` with several processes (each sees its own rows), else nothing."""
    return f" on process {process}" if jax.process_count() > 1 else ""


@jax.jit
def _finite_flags(leaves: list) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_leaf(state: PyTree) -> str | None:
    """The path of the first floating leaf of ``state`` holding a nan or inf, or None."""
    flat = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not flat:
        return None
    flags = np.asarray(_finite_flags([x for _, x in flat]))
    if flags.all():
        return None
    return jax.tree_util.keystr(flat[int(np.argmin(flags))][0])
