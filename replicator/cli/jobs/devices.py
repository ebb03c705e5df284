"""The devices a job runs on in this process: as many emulated CPU devices as the config asks,
set before JAX starts (`emulate`)."""

from __future__ import annotations

import math

import jax

from replicator.cli.config import MAX_CPU_DEVICES, TrainConfig


def emulate(config: TrainConfig, *, cpu_only: bool) -> None:
    """Emulates ``config``'s CPU devices if JAX has not started yet.

    Emulated CPU devices only change the CPU platform: on a TPU or GPU host ``jax.devices()`` is
    still the accelerators, unless ``cpu_only`` (explain: plan any mesh on this machine's CPU,
    with as many emulated devices as the mesh has, or ``cpu_devices`` if a size is -1). Once JAX
    has started (a JAX computation ran in this process), its devices stay as they are.

    Raises:
      ValueError: with ``cpu_only``, for a mesh of more devices than one process emulates.
    """
    sizes = list(config.mesh.values())
    n = math.prod(sizes) if cpu_only and sizes and min(sizes) > 0 else config.cpu_devices
    if n > MAX_CPU_DEVICES:
        raise ValueError(
            f"mesh {config.mesh} has {n} devices, and explain emulates one CPU device for each "
            f"in this process, at most {MAX_CPU_DEVICES}; explain a mesh of at most "
            f"{MAX_CPU_DEVICES} devices."
        )
    if n:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # JAX has started: "should be updated before backends are ..."
            return
    if cpu_only:
        jax.config.update("jax_platforms", "cpu")
