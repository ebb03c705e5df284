"""Several processes, one program: JAX's distributed runtime, and a local launcher.

`initialize` wraps ``jax.distributed.initialize``. It finds its arguments in this order: the
arguments given; the variables `launch` sets (``REPLICATOR_*``); otherwise JAX's own cluster
detection (Cloud TPU pods, SLURM, ...). With one process and nothing to detect it does nothing,
so the same script runs alone or under a launcher.

`launch` is the local launcher (``replicator launch -n 2 -- python train.py``, like
``horovodrun``): it starts N processes with a coordinator on 127.0.0.1, prefixes their output with
their rank, and if one fails it stops the others and reports which rank failed first.

Under the launcher, `initialize` also makes each worker easy to end: SIGTERM ends it at once
(JAX's runtime would otherwise hold it), a worker that fails (an uncaught exception, or
``sys.exit`` with a non-zero code) exits at once instead of waiting up to ``shutdown_timeout``
for its peers in JAX's shutdown barrier, and `heartbeat` reports progress to the launcher's
watchdog.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import mmap
import os
import queue
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import jax

from replicator._src import compat, errors

ENV_COORDINATOR = "REPLICATOR_COORDINATOR"
ENV_NUM_PROCESSES = "REPLICATOR_NUM_PROCESSES"
ENV_PROCESS_ID = "REPLICATOR_PROCESS_ID"
ENV_CPU_DEVICES = "REPLICATOR_CPU_DEVICES"
ENV_HEARTBEAT = "REPLICATOR_HEARTBEAT_FILE"
WATCHDOG_EXIT_CODE = 124  # as timeout(1): the watchdog ended the job


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

    When the coordinator address is a loopback one (``127.0.0.1``, ``localhost``), as under
    ``replicator launch``, the coordinator binds to ``127.0.0.1`` only, not to every interface.
    Under the launcher, initialize also restores SIGTERM's default action (JAX's runtime
    catches it, which leaves a worker stuck in a collective unkillable but by SIGKILL), and
    makes a failing worker (an uncaught exception, or ``sys.exit`` with a non-zero code) exit
    at once with its code instead of waiting in JAX's shutdown barrier, so that the launcher
    sees the first failure first. ``rp.fit``'s own SIGTERM handling, while it runs, comes first.

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
    bind = None
    if coordinator_address is not None and _is_loopback(coordinator_address):
        bind = "127.0.0.1:" + coordinator_address.rsplit(":", 1)[1]
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
        shutdown_timeout_seconds=shutdown_timeout,
        coordinator_bind_address=bind,
    )
    if source == "launcher":
        _end_fast_under_launcher()
    return ProcessInfo(jax.process_index(), jax.process_count(), source)


def _cluster_detected(env) -> bool:
    """Whether JAX's own cluster detection has something to find (SLURM, Cloud TPU, MPI)."""
    slurm = int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env
    tpu = "TPU_WORKER_HOSTNAMES" in env or "MEGASCALE_COORDINATOR_ADDRESS" in env
    mpi = int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
    return slurm or tpu or mpi


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


# -- a worker under the launcher ----------------------------------------------------------------

_exit_code: list = []  # the code given to sys.exit, if any


def _end_fast_under_launcher() -> None:
    """SIGTERM ends this process at once; a failing exit skips JAX's shutdown barrier."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if getattr(sys.exit, "_replicator", False):
        return
    real_exit, real_hook = sys.exit, sys.excepthook

    def exit(status=None):  # sys.exit, recording its code
        _exit_code[:] = [status]
        # Run first at exit, before handlers registered since (such as XLA's collectives
        # finalizer, which would let the peers fail before this process is seen to).
        atexit.unregister(_exit_now_if_failed)
        atexit.register(_exit_now_if_failed)
        real_exit(status)

    def excepthook(kind, value, tb):  # an uncaught exception: print it, then exit 1 now
        real_hook(kind, value, tb)
        _exit_now(1, FAILED_IN_RUNTIME if _runtime_error(value) else FAILED)

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
        _exit_now(code, FAILED)


def _exit_now(code: int, how: float) -> None:
    _mark_exiting(how)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code & 0xFF)


# -- progress reports for the launcher's watchdog -----------------------------------------------

# The heartbeat file: the time.monotonic() of the last report, or of the start of the exit (0.0:
# none yet); how the process exits (RUNNING, EXITING, FAILED, FAILED_IN_RUNTIME); the number of
# reports. CLOCK_MONOTONIC is shared by every process of the machine, so the launcher compares it
# with its own clock, and the times at which processes failed with each other.
_BEAT = struct.Struct("<ddq")
_beat: list = []  # [mmap] once opened; [None] without a launcher watchdog
_beats = [0]  # reports so far
RUNNING, EXITING, FAILED, FAILED_IN_RUNTIME = 0.0, 1.0, 2.0, 3.0


def heartbeat() -> None:
    """Reports progress to ``replicator launch --watchdog``; a no-op without the launcher.

    Call it once per step, at the start of the step (``rp.fit`` does). It costs a clock read and
    a 24-byte store into a page shared with the launcher, with no system call. The launcher's
    watchdog ends the job when a process goes ``--watchdog`` seconds without a report, once the
    first report of any process has armed it. It names the process the others wait for: the one
    with the fewest reports, then the one whose last report is oldest.

    Example, in a training loop of one's own::

        for batch in batches:
            rp.distributed.heartbeat()
            state, outputs = repl.run(step_fn, state, batch)
    """
    page = _beat[0] if _beat else _open_beat()
    if page is not None:
        _beats[0] += 1
        _BEAT.pack_into(page, 0, time.monotonic(), RUNNING, _beats[0])


def _open_beat():
    path = os.environ.get(ENV_HEARTBEAT)
    page = None
    if path:
        try:
            with open(path, "r+b") as f:
                page = mmap.mmap(f.fileno(), _BEAT.size)
        except (OSError, ValueError):
            page = None
    _beat[:] = [page]
    if page is not None:
        atexit.register(_mark_exiting)  # a process at its end is not stuck: stop watching it
    return page


def _mark_exiting(how: float = EXITING) -> None:
    page = _beat[0] if _beat else _open_beat()
    if page is not None:
        _BEAT.pack_into(page, 0, time.monotonic(), how, _beats[0])


def _read_beat(path: str) -> tuple[float, float, int]:
    """(time of the last report or of the exit, or 0.0; how it exits; reports so far)."""
    try:
        with open(path, "rb") as f:
            return _BEAT.unpack(f.read(_BEAT.size))
    except (OSError, struct.error):
        return 0.0, RUNNING, 0


# -- the local launcher -------------------------------------------------------------------------

FAILURE_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when a rank has failed


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
    watchdog: float | None = None,
    out=None,
) -> int:
    """Runs ``command`` as ``num_processes`` local processes of one job; returns its exit code.

    Each process gets ``REPLICATOR_COORDINATOR=127.0.0.1:<port>``, its
    ``REPLICATOR_PROCESS_ID`` and ``REPLICATOR_NUM_PROCESSES`` (and ``REPLICATOR_CPU_DEVICES``),
    which `initialize` reads, and runs in a process group of its own. Every line they print comes
    out prefixed with ``[rank]``. The job ends at its first failure:

    * A process that exits non-zero or is killed: the launcher names the rank that failed first
      (later deaths are the teardown's doing), sends the others' process groups SIGTERM, then
      SIGKILL after ``min(grace, 2)`` seconds, and returns that rank's code (128 + signal if it
      was killed, as shells do).
    * ``watchdog``: when a process goes ``watchdog`` seconds without a `heartbeat` (``rp.fit``
      reports one per step), the launcher names it and ends the job with code 124. The watchdog
      is armed by the first report of any process; a process that is exiting is not watched.
    * SIGTERM or SIGINT to the launcher: passed on to every process group; after ``grace``
      seconds (time for ``rp.fit`` to save a checkpoint) the rest get SIGKILL, and the launcher
      returns 128 + the signal. No process outlives the launcher.

    Args:
      command: the program and its arguments.
      num_processes: how many processes (>= 1).
      devices_per_process: emulated CPU devices per process, or None for the platform's own.
      port: the coordinator's port on 127.0.0.1 (default: a free one).
      grace: seconds between the SIGTERM passed on from the launcher and SIGKILL.
      watchdog: seconds without progress after which a process counts as stuck (None: off).
      out: where the output goes (default: sys.stdout).

    Returns:
      0 if every process exited 0, else the code of the first failure as above.

    Raises:
      ValueError: for a bad argument, or a command that cannot be found.
    """
    _check_launch_args(command, num_processes, devices_per_process, port, grace, watchdog)
    out = out or sys.stdout
    port = port or free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps = []
    exits: queue.Queue = queue.Queue()  # (rank, returncode) in the order the processes ended
    beats_dir = tempfile.mkdtemp(prefix="replicator-launch-")
    beat_files = [os.path.join(beats_dir, f"rank{r}.beat") for r in range(num_processes)]
    signals: queue.Queue = queue.Queue()
    previous = _install_forwarding(signals)
    try:
        for rank in range(num_processes):
            with open(beat_files[rank], "wb") as f:
                f.write(_BEAT.pack(0.0, 0.0, 0))
            env = dict(os.environ)
            env |= {
                ENV_COORDINATOR: f"127.0.0.1:{port}",
                ENV_NUM_PROCESSES: str(num_processes),
                ENV_PROCESS_ID: str(rank),
                ENV_HEARTBEAT: beat_files[rank],
                "PYTHONUNBUFFERED": "1",
            }
            if devices_per_process:
                env[ENV_CPU_DEVICES] = str(devices_per_process)
            try:
                proc = subprocess.Popen(
                    list(command),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: we end its children too
                )
            except OSError as e:
                _stop(procs, 0.0)
                raise ValueError(f"replicator launch: cannot start {command[0]!r}: {e}") from e
            procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc, rank, out, lock), daemon=True)
            pump.start()
            pumps.append(pump)
            threading.Thread(target=_reap, args=(proc, rank, exits), daemon=True).start()
        verdict = _watch(procs, exits, signals, beat_files, watchdog)
        if verdict is not None:
            kind, rank, value = verdict
            _stop(procs, grace if kind == "signal" else min(grace, FAILURE_GRACE))
    finally:
        _restore_signals(previous)
        _stop(procs, 0.0)  # nothing outlives the launcher, whatever happened above
        shutil.rmtree(beats_dir, ignore_errors=True)
    for pump in pumps:
        pump.join(timeout=5)
    if verdict is None:
        return 0
    others = num_processes - 1
    if kind == "signal":
        message = f"got {signal.Signals(value).name}; passed it to the {num_processes} process(es)"
        message += " and waited for them to end."
        code = 128 + value
    elif kind == "watchdog":
        message = (
            f"rank {rank} made no progress for more than {watchdog:g} s (--watchdog {watchdog:g}: no "
            f"rp.distributed.heartbeat(), which rp.fit reports each step); stopped it and the "
            f"other {others} process(es)."
        )
        code = WATCHDOG_EXIT_CODE
    else:
        how = (
            f"was killed by {signal.Signals(-value).name}" if value < 0 else f"exited with {value}"
        )
        message = f"rank {rank} {how}; stopped the other {others} process(es)."
        code = 128 - value if value < 0 else value
    with lock:
        print(f"replicator launch: {message}", file=out, flush=True)
    return code


def _watch(procs, exits, signals, beat_files, watchdog):
    """Waits for the end of the job: None when every process exited 0, else
    ``("exit", rank, returncode)``, ``("watchdog", rank, None)`` or ``("signal", None, signum)``
    for the first failure."""
    live = set(range(len(procs)))
    armed_at = None
    while live:
        try:
            sig = signals.get_nowait()
            return "signal", None, sig
        except queue.Empty:
            pass
        try:
            rank, code, when = exits.get(timeout=0.05)
        except queue.Empty:
            pass
        else:
            live.discard(rank)
            if code != 0:
                rank, code = _first_failure({rank: (code, when)}, live, exits, beat_files)
                return "exit", rank, code
            continue
        if watchdog:
            now = time.monotonic()
            beats = {r: _read_beat(beat_files[r]) for r in live}
            if armed_at is None and any(t > 0 for t, _, _ in beats.values()):
                armed_at = now
            if armed_at is not None:
                last = {r: (t or armed_at, n) for r, (t, how, n) in beats.items() if how == RUNNING}
                if last and now - min(t for t, _ in last.values()) > watchdog:
                    # The stuck rank is the one the others wait for: fewest reports, then oldest.
                    stuck = min(last, key=lambda r: (last[r][1], last[r][0]))
                    return "watchdog", stuck, None
    return None


SETTLE = 0.5  # seconds to wait, after a failure, for the failures it causes at once


def _first_failure(failed: dict, live: set, exits: queue.Queue, beat_files) -> tuple[int, int]:
    """``(rank, returncode)`` of the failure that came first, among ``failed`` and those that
    follow within `SETTLE` seconds.

    The order in which the launcher sees processes end is not always the order in which they
    failed: a rank killed by SIGKILL is seen to end only once the kernel has torn it down, and by
    then a peer may have seen its connections close, failed in a collective and exited. So the
    failures are ranked: first a process's own failure (an exception that is not JAX's runtime
    error, or a non-zero ``sys.exit``), by the time it decided to exit; then a death by a signal
    or an exit that did not go through `initialize`'s handlers, by the time the launcher saw it;
    last a failure in JAX's runtime (the error a collective raises when its peer is gone), by time.
    """
    deadline = time.monotonic() + SETTLE
    while live and time.monotonic() < deadline:
        try:
            rank, code, when = exits.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        live.discard(rank)
        if code != 0:
            failed[rank] = (code, when)

    def order(rank):
        code, seen = failed[rank]
        t, how, _ = _read_beat(beat_files[rank])
        if how == FAILED and code > 0:
            return (0, t, rank)
        if how == FAILED_IN_RUNTIME and code > 0:
            return (2, t, rank)
        return (1, seen, rank)

    first = min(failed, key=order)
    return first, failed[first][0]


def _reap(proc: subprocess.Popen, rank: int, exits: queue.Queue) -> None:
    code = proc.wait()
    exits.put((rank, code, time.monotonic()))


def _install_forwarding(signals: queue.Queue) -> dict:
    """SIGTERM and SIGINT to the launcher go to ``signals`` (when this is the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda signum, frame: signals.put(signum))
    return previous


def _restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _check_launch_args(command, num_processes, devices_per_process, port, grace, watchdog):
    def seconds(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x != x + 1

    api = "replicator launch"
    errors.positive_int(num_processes, api=api, name="-n")
    errors.positive_int(
        devices_per_process, api=api, name="--devices-per-process",
        none=" (or left out for the platform's own devices)",
    )  # fmt: skip
    if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535):
        raise ValueError(
            f"replicator launch: --port must be an int in 1..65535 (or left out for a free "
            f"one); got {port!r}."
        )
    if not seconds(grace) or grace < 0:
        raise ValueError(
            f"replicator launch: --grace must be a number of seconds >= 0; got {grace!r}."
        )
    if watchdog is not None and (not seconds(watchdog) or watchdog <= 0):
        raise ValueError(
            f"replicator launch: --watchdog must be a number of seconds > 0 (or left out for "
            f"no watchdog); got {watchdog!r}."
        )
    if not command:
        raise ValueError(
            "replicator launch: give the command to run after --, e.g. "
            "replicator launch -n 2 -- python train.py"
        )
    if shutil.which(command[0]) is None:
        raise ValueError(
            f"replicator launch: command {command[0]!r} not found (not an executable file, "
            f"nor on PATH); check its name, or give its path."
        )


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


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with errors as one line on stderr and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"replicator launch: {message}\n")


def launch_parser() -> argparse.ArgumentParser:
    """The options of ``replicator launch``."""
    parser = _OneLineParser(
        prog="replicator launch",
        description="Runs CMD as N local processes of one JAX distributed job, with a "
        "coordinator on 127.0.0.1. Each line of output is prefixed with its rank. The job ends "
        "at its first failure (an exit code, a signal, or --watchdog), naming the rank, with "
        "that rank's exit code (128 + signal if killed; 124 for the watchdog). SIGTERM or "
        "SIGINT to the launcher is passed on to every process. In the script, call "
        "rp.distributed.initialize() first.",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="emulated CPU devices per process (sets jax_num_cpu_devices through initialize)",
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between the SIGTERM passed on from the launcher and SIGKILL (default 10); "
        "after a failure, at most 2",
    )
    parser.add_argument(
        "--watchdog",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end the job when a process goes SECONDS without progress "
        "(rp.distributed.heartbeat(), which rp.fit reports each step); default: off",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    return parser


def launch_main(argv: Sequence[str]) -> int:
    """``replicator launch ARGS``: parses ``argv``, runs `launch`; user errors are one line on
    stderr and exit code 2."""
    args = launch_parser().parse_args(list(argv))
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        return launch(
            cmd,
            num_processes=args.num_processes,
            devices_per_process=args.devices_per_process,
            port=args.port,
            grace=args.grace,
            watchdog=args.watchdog,
        )
    except ValueError as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
