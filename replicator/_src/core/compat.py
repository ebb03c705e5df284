"""The one place that deals with differences between JAX versions.

CI tests jax 0.10.2 on Python 3.11 and jax 0.12 on Python 3.12 and 3.13 (`TESTED_JAX`). The
differences this module hides, each named where it is handled:

- ``scan``'s parameters: ``num_consts``/``num_carry`` (0.10.2), a flat tree ``ft_in`` (0.12):
  `scan_counts`.
- XLA's ``replica_groups``: explicit or iota lists (0.10.2), also mesh axes such as
  ``mesh['data'=2,'model'=4] {'model'}`` (from 0.11): read in ``report/hlo.py``'s
  ``replica_groups``, which knows every form.
- Open MPI 5 jobs: not found by JAX (0.10.2), joined through mpi4py (0.12):
  `OPEN_MPI_5_THROUGH_MPI4PY` and `detect_cluster`.
- Many steps queued on emulated CPU devices: XLA:CPU's collectives hang (0.10.2), not (0.12):
  `CPU_COLLECTIVES_HANG_WHEN_QUEUED`, read by ``Replicator``'s default ``max_in_flight``.
- ``jax.device_put`` reuses a device buffer that already holds the value, even with
  ``may_alias=False`` (0.10.2): ``leaf_specs.place`` copies first, so a placed state owns its
  buffers.

- The persistent compilation cache (``jax_compilation_cache_dir``) writes a compile-only
  TPU target's executable, then cannot read it back ("PjRtCompiler must be constructed with a
  Client"; both): `skip_persistent_cache_for_compile_only` leaves those programs out of it.

The same on both:

- The private modules read here (``mesh_utils``, ``xla_bridge``, ``clusters``, ``distributed``,
  ``lax._convert_element_type``) have the same names and meaning.
- XLA:CPU has no ``ragged-all-to-all`` (``UNIMPLEMENTED``): ``sharded/dropless.py`` sends whole
  chunks there.
- Splash attention's private backward, ``_splash_attention_bwd``, which ``sharded/splash.py``
  calls, has the same signature.
- ``multihost_utils.process_allgather`` of small NumPy arrays over emulated CPU devices, and
  ``Lowered.as_text()``'s StableHLO without source locations: ``distributed/programs.py``
  compares the processes' step programs with them (the public API; no private key-value store).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import jax
from jax.sharding import AxisType, Mesh

# The jax releases CI tests, the bounds of pyproject.toml's dependencies.
TESTED_JAX = (0, 10, 2), (0, 13)


def untested_jax(version: tuple[int, ...] = jax.__version_info__) -> str | None:
    """A sentence naming the tested bounds when ``version`` is outside them, else None.

    >>> untested_jax((0, 12, 0)) is None, untested_jax((0, 13, 0))[:46]
    (True, 'replicator is tested with jax >=0.10.2,<0.13; ')
    """
    low, high = TESTED_JAX
    if low <= tuple(version) < high:
        return None
    bounds = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    found = ".".join(map(str, version))
    return (
        f"replicator is tested with jax {bounds}; jax {found} is installed. explain's HLO "
        f"reading and the private jax modules in compat.py may differ: install "
        f'"jax{bounds}", or run the test suite on this jax first.'
    )


if (_UNTESTED := untested_jax()) is not None:
    warnings.warn(_UNTESTED, stacklevel=2)


def make_mesh(shape: Sequence[int], names: Sequence[str], devices: Sequence[jax.Device]) -> Mesh:
    """A device mesh whose axes are all of type ``Auto``.

    Since JAX 0.9 ``jax.make_mesh`` makes ``Explicit`` axes by default, and ``shard_map`` then
    refuses inputs whose sharding differs from ``in_specs``. replicator lets ``jit`` reshard inputs
    (for example a NumPy batch) on the way in, which needs ``Auto`` axes.

    ``jax.make_mesh`` lays the axes on the slice's torus, each a product of whole physical axes;
    a shape it cannot lay out so (an axis of 2 on v5p-512's ``4 x 8 x 8``) is laid out with
    physical axes split (``allow_split_physical_axes``): the same program, its collectives
    over rings that are not whole torus axes.
    """
    types = (AxisType.Auto,) * len(shape)
    try:
        return jax.make_mesh(tuple(shape), tuple(names), axis_types=types, devices=devices)
    except NotImplementedError:  # no assignment of whole physical axes
        from jax.experimental import mesh_utils

        array = mesh_utils.create_device_mesh(
            tuple(shape), list(devices), allow_split_physical_axes=True
        )
        return Mesh(array, tuple(names), axis_types=types)


def make_hybrid_mesh(
    ici_shape: Sequence[int],
    dcn_shape: Sequence[int],
    names: Sequence[str],
    devices: Sequence[jax.Device],
) -> Mesh:
    """A mesh over several slices (devices with distinct ``slice_index``), all axes ``Auto``.

    ``jax.make_mesh`` refuses multi-slice devices; ``create_hybrid_device_mesh`` lays each slice
    out on its own (topology-aware, as ``jax.make_mesh`` would) with ``ici_shape``, then tiles the
    slices, in ``slice_index`` order, along ``dcn_shape``. Axis ``i`` of the mesh has size
    ``ici_shape[i] * dcn_shape[i]``.

    Args:
      ici_shape: the axis sizes inside one slice.
      dcn_shape: how many slices each axis spans; the product is the number of slices.
      names: the axis names.
      devices: every device of the mesh, whole slices of equal size.

    Returns:
      The ``Mesh``.
    """
    from jax._src import mesh_utils as jax_mesh_utils  # the device kinds jax.make_mesh splits
    from jax.experimental import mesh_utils

    # jax.make_mesh (jax 0.10.2) lets XLA split physical axes on these kinds only; on the others
    # a slice's shape that is no product of whole physical axes (a 4-way `model` axis on
    # v6e-256's 16 x 16) is laid out with them split, as `make_mesh` does within one slice
    split = devices[0].device_kind in (jax_mesh_utils._TPU_V5_LITE, jax_mesh_utils._TPU_V5E)
    try:
        array = mesh_utils.create_hybrid_device_mesh(
            tuple(ici_shape), tuple(dcn_shape), list(devices), allow_split_physical_axes=split
        )
    except (NotImplementedError, ValueError):  # no assignment of whole physical axes
        if split:
            raise
        array = mesh_utils.create_hybrid_device_mesh(
            tuple(ici_shape), tuple(dcn_shape), list(devices), allow_split_physical_axes=True
        )
    return Mesh(array, tuple(names), axis_types=(AxisType.Auto,) * len(names))


def backends_initialized() -> bool:
    """Whether JAX has started its backends (after which ``jax.distributed`` cannot join)."""
    from jax._src import xla_bridge  # no public API says this (jax 0.10.2)

    return bool(xla_bridge.backends_are_initialized())


class Cluster(NamedTuple):
    """A cluster environment JAX's detection found (`detect_cluster`)."""

    name: str  # JAX's ClusterEnv class, such as "SlurmCluster"
    method: str | None  # jax.distributed.initialize(cluster_detection_method=method) picks it
    process_count: int | None  # when environment variables say it (SLURM, Open MPI), else None


# The detectors whose process count JAX reads from environment variables only (jax 0.10.2).
_COUNT_IN_ENVIRONMENT = ("SlurmCluster", "OmpiCluster")


def detect_cluster() -> Cluster | None:
    """The first cluster environment JAX's own detection finds, asked without the network.

    JAX (``jax._src.clusters``) knows SLURM, Open MPI, Cloud TPU on GKE and on GCE, Kubernetes,
    and mpi4py, and asks them in that order, as ``jax.distributed.initialize`` does with no
    arguments: the first whose ``is_env_present()`` is true wins, and opt-in ones (mpi4py) are
    left out. Every ``is_env_present`` reads environment variables or local files, except
    ``GceTpuCluster``'s, which asks the GCE metadata server (HTTP, up to 6 tries). That one is
    asked only on a Cloud TPU VM: JAX found TPU chips on this machine's PCI bus when it was
    imported, and ``TPU_SKIP_MDS_QUERY`` is not set (JAX sets it on machines without TPU
    chips, so a laptop or a CPU/GPU cluster never queries it; set it to skip the query on a
    TPU VM too). Kubernetes is found only with the ``kubernetes`` package installed; without
    it, JAX warns and finds nothing.

    Returns:
      The `Cluster`, or None when no environment is present.

    Raises:
      RuntimeError: if a detector fails (Kubernetes', outside a pod, for example), naming it.
    """
    from jax._src import clusters  # no public API detects without initializing (jax 0.10.2)
    from jax._src.clusters import cloud_tpu_cluster

    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        if issubclass(env, cloud_tpu_cluster.GceTpuCluster) and (
            not cloud_tpu_cluster.running_in_cloud_tpu_vm or "TPU_SKIP_MDS_QUERY" in os.environ
        ):
            continue  # would ask the metadata server: only on a Cloud TPU VM
        try:
            present = env.is_env_present()
        except Exception as error:
            raise RuntimeError(
                f"rp.distributed.initialize: JAX's cluster detection {env.__name__} failed: "
                f"{type(error).__name__}: {error}. Fix the environment it reads, or skip "
                f"detection: pass coordinator_address, num_processes, process_id and "
                f"local_device_ids."
            ) from error
        if present and _needs_missing_mpi4py(env):
            return None  # JAX would fail inside; the caller refuses, naming the fixes
        if present:
            count = int(env.get_process_count()) if env.__name__ in _COUNT_IN_ENVIRONMENT else None
            named = [
                other for other in clusters.ClusterEnv._cluster_types if other.name == env.name
            ]
            # A name JAX can look up picks this environment alone; else JAX detects it again.
            return Cluster(env.__name__, env.name if named == [env] else None, count)
    return None


def _needs_missing_mpi4py(env) -> bool:
    """Whether JAX would join this Open MPI 5 job through mpi4py, which is not installed.

    jax 0.10.2 finds Open MPI jobs by ``OMPI_MCA_orte_hnp_uri`` alone, which Open MPI 5 no
    longer sets; jax 0.12 routes Open MPI 5 (``OmpiCluster._is_ompi_5``) through mpi4py.
    """
    import importlib.util

    is_ompi_5 = getattr(env, "_is_ompi_5", None)
    return bool(is_ompi_5 and is_ompi_5()) and importlib.util.find_spec("mpi4py") is None


# How JAX joins an Open MPI 5 job that sets no ORTE URI: through mpi4py from jax 0.11 on.
OPEN_MPI_5_THROUGH_MPI4PY = jax.__version_info__ >= (0, 11)


# XLA:CPU's collectives across emulated devices deadlock when many programs that contain them are
# queued: with jax 0.10.2, and not with jax 0.12 on one process (with several processes it is not
# measured, so there the bound stays on every jax). Replicator's default max_in_flight (2 where they
# may hang, step_cache.default_max_in_flight) reads it. The runs that show it: BENCHMARKS.md, "CPU
# collectives" and "Two JAX releases side by side".
CPU_COLLECTIVES_HANG_WHEN_QUEUED = jax.__version_info__ < (0, 12)


def coordination_client():
    """JAX's coordination-service client of this process (its key-value store), or None when
    ``jax.distributed.initialize`` has not started one."""
    from jax._src.distributed import global_state  # no public API gives it (jax 0.10.2)

    return global_state.client


def weakly_typed(x: jax.Array) -> jax.Array:
    """``x`` with its dtype, weakly typed, as a Python scalar would be inside ``jax.jit``.

    ``jax.pmap`` on several processes loses an input's weak type on its way in (its host-local to
    global conversion, jax 0.10.2); a weak scalar then promotes a ``bfloat16`` operand to
    ``float32``. No public API makes a traced value weak again.
    """
    from jax._src.lax.lax import _convert_element_type

    return _convert_element_type(x, x.dtype, weak_type=True)


def scan_counts(params) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's parameters.

    jax 0.10.2 keeps them as ``num_consts`` and ``num_carry``; jax 0.12 keeps the operands'
    structure instead, ``ft_in``: a flat tree of (consts, carry, xs), each part's length its count.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def skip_persistent_cache_for_compile_only() -> None:
    """Leaves the programs of compile-only devices (``rp.tpu_devices``) out of JAX's persistent
    compilation cache; every other program keeps it. Idempotent.

    JAX writes a compile-only executable to the cache and then fails to read it back, with a
    warning, on every later compile of the same program (jax 0.10.2 and 0.12).
    """
    from jax._src import compiler

    key = compiler._get_cache_key
    if getattr(key, "_replicator_skips_compile_only", False):
        return

    def cache_key(options, backend, *args, **kwargs):
        if getattr(backend, "runtime_type", None) == "compile_only_runtime":
            return None  # compiled every time, never written
        return key(options, backend, *args, **kwargs)

    cache_key._replicator_skips_compile_only = True
    compiler._get_cache_key = cache_key
