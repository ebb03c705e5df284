"""Test setup: 8 emulated CPU devices, set once before JAX starts its backend."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# Scripts that the tests start as processes, not test modules (--doctest-modules would import them).
collect_ignore_glob = ["faults/worker_*.py"]
