"""Errors of replicator, and the messages that need a paragraph."""

from __future__ import annotations

from typing import Any


class ReplicasDivergedError(RuntimeError):
    """A replicated state leaf differs across replicas after a step.

    Raised by ``repl.run`` when ``Replicator(check_replicas=True)``. The step's results are kept
    on the error, so nothing is lost: ``err.state`` is the new state as replica 0 holds it and
    ``err.outputs`` the step's outputs.
    """

    def __init__(self, message: str, *, path: str, state: Any, outputs: Any) -> None:
        super().__init__(message)
        self.path = path
        self.state = state
        self.outputs = outputs


DIVERGED = """\
Replicator(check_replicas=True): after {step}, the replicated state leaf {path} differs across \
replicas (largest spread between replicas: {spread}); {count} replicated leaves differ in all.

Each replica computes its own update. A replicated leaf stays equal on every replica only if its \
update is the same everywhere, i.e. if everything per-replica feeding it went through an \
all-reduce. The usual cause is gradients applied without one:

    tx = optax.adam(1e-3)                        # wrong: each replica applies its local gradient
    tx = repl.wrap_optimizer(optax.adam(1e-3))   # right: the cross-replica mean, then adam

or a value such as a BatchNorm statistic computed from the local batch only (reduce it with \
rp.all_reduce(x, "mean"), or pass axis_name=rp.replica_axis_name() to the layer). The new state \
and outputs are kept on this error as .state and .outputs."""


STEP_RESULT = """\
Replicator.run: step_fn must return a pair (state, outputs) of pytrees, but it returned {got}.

    def step_fn(state, batch):
        ...
        return state, {{"loss": rp.all_reduce(loss, "mean")}}

outputs may be any pytree of arrays or numbers (a dict is usual), or None."""
