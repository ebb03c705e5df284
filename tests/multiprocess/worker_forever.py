"""A process that trains until it is killed: for the launcher's fault test. Writes its pid to
``<dir>/rank<r>.pid`` once training runs. Arguments: the directory, and the heartbeat timeout in
seconds (rp.distributed.initialize's default when not given)."""

import os
import sys

import replicator as rp

info = rp.distributed.initialize(
    **({"heartbeat_timeout": int(sys.argv[2])} if sys.argv[2:] else {})
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

repl = rp.Replicator()
state = repl.replicate(jnp.zeros(()))
step = lambda s, x: (s + rp.all_reduce(jnp.sum(x), "mean"), {})
x = np.ones((8, 4), np.float32)
for i in range(1_000_000):
    state, _ = repl.run(step, state, x)
    if i == 5:
        with open(os.path.join(sys.argv[1], f"rank{info.process_index}.pid"), "w") as f:
            f.write(str(os.getpid()))
