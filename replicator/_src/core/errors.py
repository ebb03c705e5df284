"""Errors of replicator, and the messages that need a paragraph."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def positive_int(value: Any, *, api: str, name: str, none: str | None = None, fix: str = ""):
    """``value`` as an int if it is an int >= 1, else a ValueError naming ``api`` and ``name``.

    Args:
      value: what the caller passed (a Python or NumPy int; ``True`` is not a count).
      api: the API to name in the error, e.g. ``"rp.fit"``.
      name: the argument's name, e.g. ``"steps"``.
      none: if given, ``None`` is accepted (and returned), and the error says so with this text
        after ">= 1", e.g. ``" or None"``.
      fix: a sentence appended to the error.

    >>> positive_int(3, api="rp.fit", name="steps")
    3
    >>> positive_int(0, api="rp.fit", name="steps")
    Traceback (most recent call last):
    ValueError: rp.fit: steps must be an int >= 1; got 0.
    """
    if value is None and none is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        tail = f" {fix}" if fix else ""
        raise ValueError(f"{api}: {name} must be an int >= 1{none or ''}; got {value!r}.{tail}")
    return int(value)


class DoesNotFitError(ValueError):
    """A step compiled for a TPU target does not fit the chip's HBM.

    Raised by ``Replicator.explain`` on a TPU target's devices (``rp.tpu_devices``) when the
    TPU compiler refuses the program. A step that compiles but peaks over the HBM is reported
    instead, with ``report.target.fits`` False.

    Attributes:
      target: the target's accelerator type, e.g. ``"v5p-8"``.
      shortfall: the compiler's own words, e.g. ``"the total memory required for HLO
        temporaries (100.16G) exceeds available HBM (95.73G)"``.
    """

    def __init__(self, message: str, *, target: str, shortfall: str):
        super().__init__(message)
        self.target = target
        self.shortfall = shortfall

    def __reduce__(self):  # pickled whole: the CLI sends it from the process that compiled
        return _does_not_fit, (str(self), self.target, self.shortfall)


def _does_not_fit(message: str, target: str, shortfall: str) -> DoesNotFitError:
    return DoesNotFitError(message, target=target, shortfall=shortfall)


class ReplicasDivergedError(RuntimeError):
    """A replicated state leaf differs across replicas after a step.

    A replicated leaf is one not split over the replicas. One that differs is the sign of
    gradients applied without an all-reduce (a plain ``optax.adam`` instead of
    ``repl.wrap_optimizer(optax.adam(...))``), or of BatchNorm statistics taken over one
    replica's examples. ``repl.run`` checks after the runs ``Replicator(check_replicas=...)``
    names:

    * ``None`` (default): after each of the first 2 runs of each compiled step, then never
      again; the same as ``2``.
    * an int ``n >= 0``: after each of the first ``n`` runs of each compiled step. The check is
      a separate small program, compiled once per placement of the state; the step is not
      recompiled, and costs nothing once the ``n`` runs are done. A leaf that starts to differ
      later is not caught.
    * ``True``: after every run, inside the step. It costs a host sync per step: a debugging
      aid.
    * ``False`` (or ``0``): never, for state whose "replicated" leaves are meant to differ per
      replica (``np.asarray(leaf)`` then shows replica 0's value).

    Nothing is checked with one replica or under the local lowering. The step's results are
    kept on the error, so nothing is lost.

    Attributes:
      path: the path of the first leaf that differs.
      state: the new state, as replica 0 holds it.
      outputs: the step's outputs.
    """

    def __init__(self, message: str, *, path: str, state: Any, outputs: Any) -> None:
        super().__init__(message)
        self.path = path
        self.state = state
        self.outputs = outputs


DIVERGED = """\
Replicator.run: after {step}, the replicated state leaf {path} differs across replicas (largest \
spread between replicas: {spread}); {count} replicated leaves differ in all.

Each replica computes its own update. A replicated leaf stays equal on every replica only if its \
update is the same everywhere, i.e. if everything per-replica feeding it went through an \
all-reduce. The usual cause is gradients applied without one:

    tx = optax.adam(1e-3)                        # wrong: each replica applies its local gradient
    tx = repl.wrap_optimizer(optax.adam(1e-3))   # right: the cross-replica mean, then adam

or a value such as a BatchNorm statistic computed from the local batch only (reduce it with \
rp.all_reduce(x, "mean"), or pass axis_name=rp.replica_axis_name() to the layer, and build the \
model inside `with repl.context():` if the layer reads it in __init__). The new state and \
outputs are kept on this error as .state and .outputs.

Replicator checks this after each of the first 2 runs of each compiled step by default \
(check_replicas=n: the first n runs; check_replicas=True: every run). Only if a replicated leaf \
is meant to differ per replica, turn the check off with Replicator(check_replicas=False); \
np.asarray(leaf) then shows replica 0's value only."""


STEP_RESULT = """\
Replicator.run: step_fn must return a pair (state, outputs) of pytrees, but it returned {got}.

    def step_fn(state, batch):
        ...
        return state, {{"loss": rp.all_reduce(loss, "mean")}}

outputs may be any pytree of arrays or numbers (a dict is usual), or None."""


UNPLACED_SHAPE = """\
Replicator: state leaf {path} is a shape without a sharding on this mesh ({got}), so its \
placement would be a guess. Build the state's shapes with repl.abstract, which runs the same \
code that places the real state (repl.replicate, repl.place, opt.init, opt.shard_params) and \
keeps the shardings:

    state = repl.abstract(lambda: make_state())     # no allocation
    report = repl.explain(step_fn, state, batch_shapes)

or give the leaf its sharding: jax.ShapeDtypeStruct(shape, dtype, \
sharding=NamedSharding(repl.mesh, spec))."""


def deleted_leaf(tree: Any) -> str | None:
    """The path of the first leaf of ``tree`` whose buffer is gone (donated or deleted), or None."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            return jax.tree_util.keystr(path) or "(the state)"
    return None
