"""Several processes, one program: JAX's distributed runtime, and a local launcher.

`initialize` wraps ``jax.distributed.initialize``. It finds its arguments in this order: the
arguments given; the variables `launch` sets (``REPLICATOR_*``); otherwise JAX's own cluster
detection (Cloud TPU pods, SLURM, ...). With one process and nothing to detect it does nothing,
so the same script runs alone or under a launcher.

`launch` is the local launcher (``replicator launch -n 2 -- python train.py``, like
``horovodrun``): it starts N processes with a coordinator on 127.0.0.1, prefixes their output with
their rank, and if one fails it stops the others and reports which rank failed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import jax

from replicator._src import compat

ENV_COORDINATOR = "REPLICATOR_COORDINATOR"
ENV_NUM_PROCESSES = "REPLICATOR_NUM_PROCESSES"
ENV_PROCESS_ID = "REPLICATOR_PROCESS_ID"
ENV_CPU_DEVICES = "REPLICATOR_CPU_DEVICES"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands: ``source`` says how the arguments were found."""

    process_index: int
    process_count: int
    source: str  # "arguments", "launcher", "cluster" or "single"


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_devices: int | None = None,
    initialization_timeout: int = 120,
    heartbeat_timeout: int = 30,
    shutdown_timeout: int = 30,
) -> ProcessInfo:
    """Joins this process to the others of the job; call it first, before any JAX work.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator.
      num_processes: how many processes the job has.
      process_id: this process's index.
      local_device_ids: the local devices this process uses (default: all).
      cpu_devices: emulate this many CPU devices in this process (``jax_num_cpu_devices``);
        the launcher passes its ``--devices-per-process``.
      initialization_timeout: seconds to wait for every process to join.
      heartbeat_timeout: seconds after which a silent peer counts as dead, so that a stuck or
        killed process ends the job with an error instead of a hang.
      shutdown_timeout: seconds a process waits for the others at exit.

    Returns:
      A `ProcessInfo`.

    Raises:
      RuntimeError: if JAX's backend is already initialised (some JAX computation, or a call
        such as ``jax.devices()``, ran before ``initialize``) and there is a job to join or a
        device count to set. Alone with nothing to set, ``initialize`` is then a no-op, so a
        notebook can run it twice.

    Example, at the top of a training script that runs alone or under ``replicator launch``::

        import replicator as rp
        info = rp.distributed.initialize()   # before anything touches the devices
        repl = rp.Replicator()               # every device of every process
    """
    env = os.environ
    if coordinator_address is not None or num_processes is not None or process_id is not None:
        source = "arguments"
    elif ENV_COORDINATOR in env:
        source = "launcher"
        coordinator_address = env[ENV_COORDINATOR]
        num_processes = int(env[ENV_NUM_PROCESSES])
        process_id = int(env[ENV_PROCESS_ID])
    elif _cluster_detected(env):
        source = "cluster"
    else:
        source = "single"
    if cpu_devices is None and env.get(ENV_CPU_DEVICES):
        cpu_devices = int(env[ENV_CPU_DEVICES])
    if compat.backends_initialized():
        if source == "single" and (not cpu_devices or cpu_devices == jax.local_device_count()):
            return ProcessInfo(jax.process_index(), jax.process_count(), source)  # nothing to do
        raise RuntimeError(
            "rp.distributed.initialize: JAX's backend is already initialised, so this process "
            "can no longer join a multi-process job. Call rp.distributed.initialize() at the top "
            "of the script, before anything that touches devices (jax.devices(), "
            "rp.Replicator(...), jnp arrays, jax.config.update('jax_num_cpu_devices', ...))."
        )
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if source == "single":
        return ProcessInfo(0, 1, source)
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
        shutdown_timeout_seconds=shutdown_timeout,
    )
    return ProcessInfo(jax.process_index(), jax.process_count(), source)


def _cluster_detected(env) -> bool:
    """Whether JAX's own cluster detection has something to find (SLURM, Cloud TPU, MPI)."""
    slurm = int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env
    tpu = "TPU_WORKER_HOSTNAMES" in env or "MEGASCALE_COORDINATOR_ADDRESS" in env
    mpi = int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
    return slurm or tpu or mpi


# -- the local launcher -------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace: float = 10.0,
    out=None,
) -> int:
    """Runs ``command`` as ``num_processes`` local processes of one job; returns its exit code.

    Each process gets ``REPLICATOR_COORDINATOR=127.0.0.1:<port>``, its
    ``REPLICATOR_PROCESS_ID`` and ``REPLICATOR_NUM_PROCESSES`` (and ``REPLICATOR_CPU_DEVICES``),
    which `initialize` reads. Every line they print comes out prefixed with ``[rank]``. When a
    process exits with an error or is killed, the others get SIGTERM, then SIGKILL after
    ``grace`` seconds, and the launcher returns that process's code (128 + signal if killed)
    after printing which rank failed.
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"replicator launch: -n must be an int >= 1; got {num_processes!r}.")
    if not command:
        raise ValueError("replicator launch: give the command to run after --.")
    out = out or sys.stdout
    port = port or free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps = []
    for rank in range(num_processes):
        env = dict(os.environ)
        env |= {
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(rank),
            "PYTHONUNBUFFERED": "1",
        }
        if devices_per_process:
            env[ENV_CPU_DEVICES] = str(devices_per_process)
        proc = subprocess.Popen(
            list(command),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so we can end its children too
        )
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc, rank, out, lock), daemon=True)
        pump.start()
        pumps.append(pump)
    failed = None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    failed = rank
                    break
            time.sleep(0.05)
        if failed is None:
            failed = next((r for r, p in enumerate(procs) if p.returncode), None)
    except KeyboardInterrupt:
        _stop(procs, grace)
        raise
    if failed is not None:
        _stop(procs, grace)
    for pump in pumps:
        pump.join(timeout=5)
    if failed is None:
        return 0
    code = procs[failed].returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    with lock:
        print(
            f"replicator launch: rank {failed} {how}; stopped the other "
            f"{num_processes - 1} process(es).",
            file=out,
            flush=True,
        )
    return 128 - code if code < 0 else code


def _pump(proc: subprocess.Popen, rank: int, out, lock) -> None:
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            print(f"[{rank}] {line}", file=out, flush=True)
    proc.stdout.close()


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every live process group, SIGKILL to those still there after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
