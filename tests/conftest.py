"""Test setup: 8 emulated CPU devices, set once before JAX starts its backend."""

import re

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# Scripts that the tests start as processes, not test modules (--doctest-modules would import them).
collect_ignore_glob = ["faults/worker_*.py"]


# An oracle test checks a parallel path against the same computation on one device (or against
# torch / transformers), and its name says so. CI's second lane, on the newest jax, runs the fast
# lane and every oracle test function in its first case (the first of its parameters; the whole
# suite runs every case in the first lane): python -m pytest -m "not slow or oracle_first".
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
