"""Test setup: 8 emulated CPU devices, set once before JAX starts its backend."""

import os
import re
import shutil
import tempfile

# The suite's programs are small and compiled once each, so XLA:CPU's LLVM passes cost more than
# they save: at level 0 a pipeline oracle runs about a quarter faster. Only code generation
# changes, so the HLO the tests read and every value they compare are the same. In os.environ,
# so the processes the tests start (the CLI, the launcher's workers) inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

# One persistent compilation cache for the whole run: pytest's workers and the processes the
# tests start (the CLI, the launcher's workers) read a program another one compiled instead of
# compiling it again. A run starts with an empty one (a directory of its own, removed at the
# end), so every program is still compiled once per run; compile-only TPU programs stay out of
# it (`compat.skip_persistent_cache_for_compile_only`). Set JAX_COMPILATION_CACHE_DIR to keep
# your own.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="replicator-tests-jax-")
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]  # this process made it: it removes it
else:
    _OWN_CACHE = None
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# No size bound: with one, every write lists and reads the whole directory under a file lock,
# which a run of some 10,000 programs turns into most of its time (the fast lane: 990 s, not 351).
# An entry read while another process writes it fails to decompress: JAX warns and compiles.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")

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


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
