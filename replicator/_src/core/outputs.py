"""Reading the outputs of `Replicator.run`: one row of each stacked output, from this process."""

from __future__ import annotations

import jax
import numpy as np

from replicator._src.core.typing import PyTree


def local_row(outputs: PyTree) -> PyTree:
    """For each stacked output, the first row this process holds, as a NumPy value.

    ``run`` returns every output stacked over the replicas; where ``step_fn`` reduced it (a
    loss passed through ``rp.all_reduce``) all rows are equal, so any row is the value. This
    reads one from this process's own shards: no transfer between processes, no gather of the
    whole array, and it works the same on one process or many (log on process 0).

    Args:
      outputs: ``run``'s outputs, each leaf ``[num_replicas, ...]``.

    Returns:
      ``outputs`` with each leaf's first local row, a NumPy value.

    >>> import jax, jax.numpy as jnp, replicator as rp
    >>> repl = rp.Replicator(devices=jax.devices()[:2])
    >>> step = lambda s, x: (s, {"loss": rp.all_reduce(jnp.mean(x), "mean")})
    >>> _, out = repl.run(step, repl.replicate(jnp.zeros(())), jnp.arange(4.0))
    >>> float(rp.local_row(out)["loss"])
    1.5
    """

    def first(x):
        shards = getattr(x, "addressable_shards", None)
        if shards:
            first_shard = min(shards, key=lambda s: tuple(i.start or 0 for i in s.index))
            return np.asarray(first_shard.data)[0]
        return np.asarray(x)[0]

    return jax.tree.map(first, outputs)
