"""The global batches of the preemption test, for its worker and for its one-process oracle."""

import numpy as np


def global_batch(step: int) -> dict:
    """The global batch of ``step`` (64 examples), the same in every process."""
    rng = np.random.default_rng(step)
    return {
        "x": rng.normal(size=(64, 16)).astype(np.float32),
        "y": rng.normal(size=(64, 4)).astype(np.float32),
    }
