"""What ``replicator train`` and ``explain`` tell apart when the library raises: a refusal
before the first training step (`SetupError`, one line and exit code 2), or a failure during the
run, whose message says all of it (`RUN_ERRORS`, exit code 1)."""

from __future__ import annotations

import os

import replicator as rp

# What the library raises for a config, a mesh, a run directory or a checkpoint it refuses.
# NotImplementedError: jax's own refusal of a mesh it cannot lay out on a TPU torus
USER_ERRORS = (
    ValueError,
    TypeError,
    FileNotFoundError,
    NotImplementedError,
    rp.training.RunDirLockedError,
)
# What it raises during training that its message says all of (what failed, what to do).
RUN_ERRORS = (rp.CheckpointWriteError,)


class SetupError(Exception):
    """`run` refused the job before its first training step: the config, the mesh, the input's
    batch size, the run directory (locked by another run) or its checkpoint (another state).

    The message is the refusal's; ``__cause__`` is the library's error. The CLI prints it
    without a traceback. A failure after the first step is raised as it is. A checkpoint of
    another state (`rp.StateMismatchError`) is told in one line naming the keys that fix it
    (the API's message shows Python).
    """

    def __str__(self) -> str:
        cause = self.__cause__
        if isinstance(cause, rp.StateMismatchError) and cause.directory and not cause.layout:
            return checkpoint_of_another_state(cause)
        return super().__str__()


def checkpoint_of_another_state(e: rp.StateMismatchError) -> str:
    """``replicator train``'s one line for a run whose checkpoint holds another state."""
    run_dir = os.path.dirname(e.directory.rstrip(os.sep))
    name, out_dir = os.path.basename(run_dir), os.path.dirname(run_dir)
    return (
        f"checkpoint step {e.step} in {e.directory} holds another state than this config builds "
        f"(leaf {e.leaf} differs: the model or optimizer keys changed; the mesh, cpu_devices "
        f"and zero_stage may change); nothing was changed on disk. Resume run {name!r} with the "
        f"model and optimizer keys that saved it, or train this config as a new run: "
        f"name={name}-2 (or out_dir=another than {out_dir})."
    )
