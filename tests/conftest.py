"""Test setup: 8 emulated CPU devices, set once before JAX starts its backend."""

import os
import re

# The suite's programs are small and compiled once each, so XLA:CPU's LLVM passes cost more than
# they save: at level 0 a pipeline oracle runs about a quarter faster. Only code generation
# changes, so the HLO the tests read and every value they compare are the same. In os.environ,
# so the processes the tests start (the CLI, the launcher's workers) inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# Scripts that the tests start as processes, not test modules (--doctest-modules would import them).
collect_ignore_glob = ["faults/worker_*.py"]


# An oracle test checks a parallel path against the same computation on one device (or against
# torch / transformers), and its name says so. To check a new jax quickly, run the fast lane and
# every oracle test function in its first case (the first of its parameters; the whole suite
# runs every case): python -m pytest -m "not slow or oracle_first".
ORACLE = re.compile(
    r"one_device|single_device|oracle|one_process|full_batch|one_big_batch"
    r"|equals?_(torch|transformers|the_sequential|the_model)|under_local_equals"
)


def pytest_collection_modifyitems(items):
    seen = set()
    for item in items:
        if ORACLE.search(getattr(item, "originalname", None) or item.name):
            item.add_marker(pytest.mark.oracle)
            function = item.nodeid.split("[")[0]
            if function not in seen:
                seen.add(function)
                item.add_marker(pytest.mark.oracle_first)
