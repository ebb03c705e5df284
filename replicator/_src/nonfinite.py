"""`fit`'s non-finite checks: `NonFiniteError` and the `FiniteGuard` that raises it.

The guard reads the scalar outputs of the steps `fit` logs or saves, and the whole state right
before each checkpoint, so that a run stops before anything non-finite is saved; every process
stops together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.checkpoint import Checkpoints
from replicator._src.typing import PyTree


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
        if anywhere(bool(bad)):
            name = bad[0] if bad else "(on another process)"
            value = metrics.get(name, float("nan"))
            raise NonFiniteError(self._message(f"the training output {name!r} is {value}", step))

    def check_state(self, step: int, state: PyTree) -> None:
        leaf = nonfinite_leaf(state)
        if leaf is not None:
            raise NonFiniteError(
                self._message(f"state leaf {leaf} is not finite (nan or inf)", step)
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


def anywhere(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (so that every process stops together)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


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
