"""What ``replicator train`` and ``explain`` tell apart when the library raises: a refusal
before the first training step (`SetupError`, one line and exit code 2), or a failure during the
run, whose message says all of it (`RUN_ERRORS`, exit code 1)."""

from __future__ import annotations

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
    without a traceback. A failure after the first step is raised as it is.
    """
