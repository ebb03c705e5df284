"""The local launcher: N processes of one job on this machine (``replicator launch``).

`launch` is like ``horovodrun``: it starts N processes with a coordinator on 127.0.0.1 and the
``REPLICATOR_*`` variables that `replicator._src.distributed.initialize` reads, prefixes their
output with their rank, and if one fails (an exit code, a signal, or no `heartbeat` for
``watchdog`` seconds) it stops the others and reports which rank failed first. SIGTERM and
SIGINT to the launcher are passed on to every process group. The command line around it
(``replicator launch -n 2 -- python train.py``) is ``replicator/cli/launch.py``.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from replicator._src import errors
from replicator._src.distributed import (
    BEAT,
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    FAILED,
    FAILED_IN_RUNTIME,
    RUNNING,
    read_beat,
)

WATCHDOG_EXIT_CODE = 124  # as timeout(1): the watchdog ended the job
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
    exits: queue.Queue = queue.Queue()  # (rank, returncode, time) in the order they ended
    beats_dir = tempfile.mkdtemp(prefix="replicator-launch-")
    beat_files = [os.path.join(beats_dir, f"rank{r}.beat") for r in range(num_processes)]
    signals: queue.Queue = queue.Queue()
    previous = _install_forwarding(signals)
    verdict = None
    try:
        for rank in range(num_processes):
            env = _worker_env(rank, num_processes, port, devices_per_process, beat_files[rank])
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
            _stop(procs, grace if verdict[0] == "signal" else min(grace, FAILURE_GRACE))
    finally:
        _restore_signals(previous)
        _stop(procs, 0.0)  # nothing outlives the launcher, whatever happened above
        shutil.rmtree(beats_dir, ignore_errors=True)
    for pump in pumps:
        pump.join(timeout=5)
    if verdict is None:
        return 0
    message, code = _outcome(*verdict, num_processes=num_processes, watchdog=watchdog)
    with lock:
        print(f"replicator launch: {message}", file=out, flush=True)
    return code


def _worker_env(rank, num_processes, port, devices_per_process, beat_file) -> dict:
    """The environment of process ``rank``: this one's, plus what `initialize` reads; creates
    its heartbeat file (no report yet)."""
    with open(beat_file, "wb") as f:
        f.write(BEAT.pack(0.0, RUNNING, 0))
    env = dict(os.environ)
    env |= {
        ENV_COORDINATOR: f"127.0.0.1:{port}",
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(rank),
        ENV_HEARTBEAT: beat_file,
        "PYTHONUNBUFFERED": "1",
    }
    if devices_per_process:
        env[ENV_CPU_DEVICES] = str(devices_per_process)
    return env


def _outcome(kind, rank, value, *, num_processes, watchdog) -> tuple[str, int]:
    """The launcher's last line and its exit code, for a verdict of `_watch`."""
    others = num_processes - 1
    if kind == "signal":
        message = f"got {signal.Signals(value).name}; passed it to the {num_processes} process(es)"
        return message + " and waited for them to end.", 128 + value
    if kind == "watchdog":
        message = (
            f"rank {rank} made no progress for more than {watchdog:g} s (--watchdog {watchdog:g}: no "
            f"rp.distributed.heartbeat(), which rp.fit reports each step); stopped it and the "
            f"other {others} process(es)."
        )
        return message, WATCHDOG_EXIT_CODE
    how = f"was killed by {signal.Signals(-value).name}" if value < 0 else f"exited with {value}"
    message = f"rank {rank} {how}; stopped the other {others} process(es)."
    return message, 128 - value if value < 0 else value


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
            beats = {r: read_beat(beat_files[r]) for r in live}
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
        t, how, _ = read_beat(beat_files[rank])
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
