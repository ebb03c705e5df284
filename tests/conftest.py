"""Test setup: 8 emulated CPU devices, set once before JAX starts its backend."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
