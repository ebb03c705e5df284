"""Several processes, one program: JAX's distributed runtime, as a worker sees it.

`initialize` wraps ``jax.distributed.initialize``. It finds its arguments in this order: the
arguments given; the variables the local launcher (``launcher.py``, ``replicator launch``) sets
(``REPLICATOR_*``, named here once for both sides); otherwise JAX's own cluster detection (SLURM,
Open MPI, Cloud TPU on GKE and GCE, Kubernetes), asked through ``compat.detect_cluster`` so that
it never reaches the network except on a Cloud TPU VM. With one process and nothing to detect it
does nothing, so the same script runs alone or under a launcher.

Under the launcher, `initialize` also makes each worker easy to end: SIGTERM ends it at once
(JAX's runtime would otherwise hold it), a worker that fails (an uncaught exception, or
``sys.exit`` with a non-zero code) exits at once instead of waiting up to ``shutdown_timeout``
for its peers in JAX's shutdown barrier, and `heartbeat` reports progress to the launcher's
watchdog through a small file (``beat.py``). Every worker also dies with its launcher.
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence

import jax

from replicator._src.core import compat
from replicator._src.distributed import beat
from replicator._src.distributed.beat import ENV_HEARTBEAT as ENV_HEARTBEAT

ENV_COORDINATOR = "REPLICATOR_COORDINATOR"
ENV_NUM_PROCESSES = "REPLICATOR_NUM_PROCESSES"
ENV_PROCESS_ID = "REPLICATOR_PROCESS_ID"
ENV_CPU_DEVICES = "REPLICATOR_CPU_DEVICES"
ENV_PLANNED = "REPLICATOR_PLANNED_PROCESSES"  # the job's size before the launcher shrank it
ENV_SLOT = "REPLICATOR_SLOT"  # which of the launcher's hosts this process runs on
ENV_PROBE = "REPLICATOR_PROBE"  # set: the launcher only asks whether this host is up
ENV_LAUNCHER_FD = "REPLICATOR_LAUNCHER_FD"  # a pipe's read end: end of file when it is gone


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in its job, as `initialize` found it.

    Attributes:
      process_index: this process's index in ``[0, process_count)``.
      process_count: the processes of the job.
      source: how the arguments were found: ``"arguments"``, ``"launcher"``, ``"cluster"`` or
        ``"single"``.
      cluster: which of JAX's cluster environments found them when ``source == "cluster"``
        (its ``ClusterEnv`` class, e.g. ``"SlurmCluster"``), else None.
      planned_count: the processes the job was started with: more than ``process_count`` when
        ``replicator launch --min-processes`` has shrunk it after a host was lost (see
        `elastic_factor`).
    """

    process_index: int
    process_count: int
    source: str
    cluster: str | None = None
    planned_count: int | None = None

    def __post_init__(self) -> None:
        if self.planned_count is None:
            object.__setattr__(self, "planned_count", self.process_count)

    @property
    def elastic_factor(self) -> int:
        """``planned_count // process_count``: by how much the launcher shrank the job (1: not).

        A job that keeps its global batch on fewer processes accumulates this many times more
        micro-batches per step (``replicator train`` does, by its config's ``elastic_batch``)::

            info = rp.distributed.initialize()
            accumulate_steps = base_accumulate_steps * info.elastic_factor
        """
        return max(1, self.planned_count // self.process_count)


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

    Without arguments or the launcher's variables, JAX's own cluster detection is asked, in
    JAX's order: SLURM (under ``srun``), Open MPI (``mpirun``), Cloud TPU on GKE
    (``TPU_WORKER_HOSTNAMES``), Cloud TPU on GCE, Kubernetes indexed Jobs (with the
    ``kubernetes`` package). The first found joins the job through JAX, and ``ProcessInfo.cluster``
    names it. Detection reads environment variables and local files only, with one exception
    that never fires off a Cloud TPU VM: on a machine where JAX found TPU chips, and unless
    ``TPU_SKIP_MDS_QUERY`` is set, the GCE metadata server is asked, as JAX itself does. A
    SLURM or Open MPI job of one process counts as no cluster. Under the launcher, JAX's
    detection is turned off (the launcher gives every argument). As in JAX, SLURM and Open MPI
    give each process the one local device of its local rank unless ``local_device_ids`` says
    otherwise.

    When the coordinator address is a loopback one (``127.0.0.1``, ``localhost``), as under
    ``replicator launch``, the coordinator binds to ``127.0.0.1`` only, not to every interface.
    Under the launcher, initialize also restores SIGTERM's default action (JAX's runtime
    catches it, which leaves a worker stuck in a collective unkillable but by SIGKILL), and
    makes a failing worker (an uncaught exception, or ``sys.exit`` with a non-zero code) exit
    at once with its code instead of waiting in JAX's shutdown barrier, so that the launcher
    sees the first failure first. ``rp.fit``'s own SIGTERM handling, while it runs, comes first.

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
        device count to set. Alone with nothing to set, or once this process has joined its
        job, ``initialize`` is then a no-op, so a notebook can run it twice. Also if Open MPI
        started several processes but JAX cannot join them (Open MPI 5 sets no
        ``OMPI_MCA_orte_hnp_uri``), or if one of JAX's cluster detectors fails.

    Example, at the top of a training script that runs alone or under ``replicator launch``::

        import replicator as rp
        info = rp.distributed.initialize()   # before anything touches the devices
        repl = rp.Replicator()               # every device of every process
    """
    env = os.environ
    if env.get(ENV_PROBE):  # the launcher only asks whether this host is up: it is
        beat.mark_ready()
        os._exit(0)
    cluster = detection = None
    if coordinator_address is not None or num_processes is not None or process_id is not None:
        source = "arguments"
    elif ENV_COORDINATOR in env:
        source = "launcher"
        coordinator_address = env[ENV_COORDINATOR]
        num_processes = int(env[ENV_NUM_PROCESSES])
        process_id = int(env[ENV_PROCESS_ID])
        detection = "deactivate"  # every argument is given: nothing for JAX to detect
        _up_under_launcher(env)
    else:
        found = compat.detect_cluster()
        if found is not None and found.process_count != 1:
            source, cluster, detection = "cluster", found.name, found.method
        else:
            source = "single"
            if found is None:
                _refuse_undetected_mpi(env)
    if cpu_devices is None and env.get(ENV_CPU_DEVICES):
        cpu_devices = int(env[ENV_CPU_DEVICES])
    if compat.backends_initialized():
        if source == "single" and (not cpu_devices or cpu_devices == jax.local_device_count()):
            return ProcessInfo(jax.process_index(), jax.process_count(), source)  # nothing to do
        if source != "single" and jax.distributed.is_initialized():  # joined already
            planned = int(env.get(ENV_PLANNED) or 0) if source == "launcher" else 0
            n = jax.process_count()
            return ProcessInfo(jax.process_index(), n, source, cluster, planned or n)
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
    bind = None
    if coordinator_address is not None and _is_loopback(coordinator_address):
        bind = "127.0.0.1:" + coordinator_address.rsplit(":", 1)[1]
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids,
        cluster_detection_method=detection,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
        shutdown_timeout_seconds=shutdown_timeout,
        coordinator_bind_address=bind,
    )
    planned = None
    if source == "launcher":
        _end_fast_under_launcher()
        planned = int(env.get(ENV_PLANNED) or num_processes)
    return ProcessInfo(jax.process_index(), jax.process_count(), source, cluster, planned)


def _refuse_undetected_mpi(env) -> None:
    """Open MPI started several processes that JAX cannot join: refuse, rather than run each
    alone (Open MPI 5 no longer sets the ``OMPI_MCA_orte_hnp_uri`` JAX's detection reads)."""
    size = int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1)
    if size > 1:
        rank = env.get("OMPI_COMM_WORLD_RANK", "?")
        why = (
            "JAX joins an Open MPI 5 job through mpi4py, which is not installed; "
            "pip install mpi4py fixes that too"
            if compat.OPEN_MPI_5_THROUGH_MPI4PY
            else "it reads OMPI_MCA_orte_hnp_uri, which Open MPI 5 no longer sets"
        )
        raise RuntimeError(
            f"rp.distributed.initialize: Open MPI started this process as rank {rank} of {size} "
            f"(OMPI_COMM_WORLD_SIZE={size}), but JAX's cluster detection found no cluster it "
            f"can join ({why}). Pass "
            f"the job's coordinator (process 0's host and a free port) explicitly: "
            f"rp.distributed.initialize(coordinator_address='HOST:PORT', "
            f"num_processes={size}, process_id={rank})."
        )


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


# -- a worker under the launcher ----------------------------------------------------------------

_exit_code: list = []  # the code given to sys.exit or SystemExit, if any


def _up_under_launcher(env) -> None:
    """This process reached ``initialize``: it tells the launcher it is up, and from now on dies
    with the launcher."""
    beat.mark_ready()
    fd = env.get(ENV_LAUNCHER_FD)
    if fd and not _watching:
        _watching.append(int(fd))
        threading.Thread(target=_die_with_launcher, args=(int(fd),), daemon=True).start()


_watching: list = []


def _die_with_launcher(fd: int) -> None:
    """Waits on the pipe whose other end only the launcher holds: at its end of file (the
    launcher is gone, even by SIGKILL) ends this process's group, children included. On Linux the
    launcher's ``PR_SET_PDEATHSIG`` ends its own child already; this covers the rest (another
    OS, or a worker started through a shell)."""
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            return
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(128 + signal.SIGKILL)


class _SystemExit(SystemExit):
    """``SystemExit``, recording its code: ``raise SystemExit(3)`` at the top of a script never
    reaches a handler that could see it (not ``sys.excepthook``, not ``atexit``)."""

    def __init__(self, *args):
        super().__init__(*args)
        _record_exit(self.code)


def _record_exit(status) -> None:
    _exit_code[:] = [status]
    # Run first at exit, before handlers registered since (such as XLA's collectives
    # finalizer, which would let the peers fail before this process is seen to).
    atexit.unregister(_exit_now_if_failed)
    atexit.register(_exit_now_if_failed)


def _end_fast_under_launcher() -> None:
    """SIGTERM ends this process at once; a failing exit skips JAX's shutdown barrier."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if getattr(sys.exit, "_replicator", False):
        return
    real_exit, real_hook = sys.exit, sys.excepthook

    def exit(status=None):  # sys.exit, recording its code
        _record_exit(status)
        real_exit(status)

    builtins.SystemExit = _SystemExit  # `raise SystemExit(3)` records its code too

    def excepthook(kind, value, tb):  # an uncaught exception: print it, then exit 1 now
        real_hook(kind, value, tb)
        _exit_now(1, beat.FAILED_IN_RUNTIME if _runtime_error(value) else beat.FAILED)

    exit._replicator = True
    sys.exit, sys.excepthook = exit, excepthook
    atexit.register(_exit_now_if_failed)  # after jax's own handler, so before it (LIFO)


# How XLA's runtime errors begin (an absl status), such as a collective whose peer is gone:
# "UNKNOWN: Gloo all-reduce failed: ... Connection reset by peer" (raised as a ValueError).
_RUNTIME_STATUS = re.compile(
    r"^(UNKNOWN|INTERNAL|UNAVAILABLE|ABORTED|CANCELLED|DEADLINE_EXCEEDED|FAILED_PRECONDITION|"
    r"DATA_LOSS): "
)


def _runtime_error(error: BaseException) -> bool:
    """Whether ``error`` comes from JAX's runtime (perhaps caused by a peer), not the script."""
    return isinstance(error, jax.errors.JaxRuntimeError) or bool(_RUNTIME_STATUS.match(str(error)))


def _exit_now_if_failed() -> None:
    """At exit: if this process fails, leave now with its code, without JAX's shutdown."""
    code = 0
    if _exit_code:
        status = _exit_code[0]
        code = status if isinstance(status, int) else (0 if status is None else 1)
    if code != 0:
        _exit_now(code, beat.FAILED)


def _exit_now(code: int, how: float) -> None:
    beat.mark_exiting(how)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code & 0xFF)


# -- progress reports for the launcher's watchdog -----------------------------------------------


def heartbeat(step: int | None = None) -> None:
    """Reports progress to ``replicator launch``; a no-op without the launcher.

    Call it once per step, at the start of the step (``rp.fit`` does). It costs a clock read and
    a 48-byte store into a page shared with the launcher, with no system call. The launcher's
    watchdog (``--watchdog``) ends the job when a process goes that many seconds without a
    report, once the first report of any process has armed it.

    Args:
      step: the number of the step it starts, if there is one. With ``--max-restarts``, it is
        how the launcher says where a rank failed, and tells a failure that repeats at the
        same step (which it does not restart again) from one that does not.

    Example, in a training loop of one's own::

        for step, batch in enumerate(batches, start=1):
            rp.distributed.heartbeat(step)
            state, outputs = repl.run(step_fn, state, batch)
    """
    if beat.report(step):
        _exit_code.clear()  # a sys.exit or SystemExit caught by the script: it goes on
