"""One round of a launched job: its processes, from their start to the first failure or the end.

`Round` starts one process per slot (a slot stands for a host: it keeps its identity when the
job is restarted on fewer of them), with a coordinator on 127.0.0.1 and the ``REPLICATOR_*``
variables that `replicator._src.distributed.initialize.initialize` reads; prefixes their output with their
rank; and watches them through their heartbeat files (``beat.py``). `Round.watch` returns the
round's `Verdict`: the job ended well, a rank failed (an exit code, a signal, or no heartbeat for
``watchdog`` seconds), a slot never came up, the launcher got a signal, or the caller asked to
stop. The policy around rounds (restarts, resizing) is ``launcher.py``'s.

Every process dies with the launcher, even when the launcher is killed by SIGKILL: on Linux
each one is started through a tiny program that sets ``PR_SET_PDEATHSIG`` and execs the
command, and everywhere ``initialize`` watches a pipe whose other end only the launcher holds
(``distributed._die_with_launcher``).
"""

from __future__ import annotations

import dataclasses
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
from collections.abc import Callable, Sequence

from replicator._src.distributed import beat
from replicator._src.distributed.initialize import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_HEARTBEAT,
    ENV_LAUNCHER_FD,
    ENV_NUM_PROCESSES,
    ENV_PLANNED,
    ENV_PROBE,
    ENV_PROCESS_ID,
    ENV_SLOT,
)

WATCHDOG_EXIT_CODE = 124  # as timeout(1): the watchdog ended the job
# A process's exits that end it cleanly besides 0, not failures: `replicator train`'s "nothing to
# do, at steps already" (4) and "stopped by SIGINT/SIGTERM at a step boundary" (128 + signal, as
# rp.fit's agreed stop ends every process). Not restarted; the job ends with the largest.
CLEAN_EXIT_CODES = (0, 4, 128 + signal.SIGINT, 128 + signal.SIGTERM)
# Seconds between SIGTERM and SIGKILL when a rank has failed: a survivor cannot save anything
# with a peer gone, and one that is not killed by SIGTERM at once is inside rp.fit's stop,
# waiting for that peer.
FAILURE_GRACE = 0.5
SETTLE = 0.5  # seconds to wait, after a failure, for the failures it causes at once


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Job:
    """What every round of a launch shares."""

    command: tuple
    planned: int  # the processes asked for (-n)
    devices_per_process: int | None
    grace: float
    watchdog: float | None
    out: object
    lock: threading.Lock
    lifeline: int  # the read end of the pipe only the launcher writes to

    def say(self, message: str) -> None:
        with self.lock:
            print(f"replicator launch: {message}", file=self.out, flush=True)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How a round ended: ``kind`` is "done", "exit", "watchdog", "signal", "lost" or "stop"."""

    kind: str
    rank: int | None = None
    value: int | None = None  # the return code ("exit") or the signal ("signal")
    lost: tuple = ()  # the slots that did not come up ("lost")
    tied: tuple = ()  # the ranks the watchdog cannot tell from ``rank`` ("watchdog")


class Round:
    """The processes of one round, one per slot in ``slots`` (rank i runs on ``slots[i]``)."""

    def __init__(self, job: Job, slots: Sequence[int], port: int | None = None) -> None:
        self.job, self.slots = job, list(slots)
        self.port = port or free_port()
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.exits: queue.Queue = queue.Queue()  # (rank, returncode, time) as they end
        self.dir = tempfile.mkdtemp(prefix="replicator-launch-")
        self.beat_files = [os.path.join(self.dir, f"rank{r}.beat") for r in range(len(slots))]
        self.started = time.monotonic()

    def start(self) -> None:
        """Starts every process; a command that cannot start is a ValueError."""
        for rank, slot in enumerate(self.slots):
            env = self._env(rank, slot)
            try:
                proc = spawn(self.job, env)
            except OSError as e:
                self.stop(0.0)
                raise ValueError(
                    f"replicator launch: cannot start {self.job.command[0]!r}: {e}"
                ) from e
            self.procs.append(proc)
            pump = threading.Thread(
                target=_pump, args=(proc, rank, self.job.out, self.job.lock), daemon=True
            )
            pump.start()
            self.pumps.append(pump)
            threading.Thread(target=_reap, args=(proc, rank, self.exits), daemon=True).start()

    def _env(self, rank: int, slot: int) -> dict:
        beat.create(self.beat_files[rank])
        return worker_env(self.job, slot, self.beat_files[rank]) | {
            ENV_COORDINATOR: f"127.0.0.1:{self.port}",
            ENV_NUM_PROCESSES: str(len(self.slots)),
            ENV_PROCESS_ID: str(rank),
        }

    def beat(self, rank: int) -> beat.Beat:
        return beat.read_beat(self.beat_files[rank])

    def newest_checkpoint(self) -> int:
        return max((self.beat(r).checkpoint for r in range(len(self.slots))), default=0)

    def watch(
        self,
        signals: queue.Queue,
        *,
        join_timeout: float | None = None,
        stop_when: Callable[[Round], bool] | None = None,
    ) -> Verdict:
        """Waits for the end of the round, or its first failure.

        Args:
          signals: the signals the launcher got, as they come.
          join_timeout: when given, a process that exits before it reaches ``initialize``, or
            has not within this many seconds, is a slot that did not come up ("lost").
          stop_when: asked now and then; True ends the round ("stop") for the caller to stop.
        """
        live = set(range(len(self.procs)))
        clean = 0  # the largest of CLEAN_EXIT_CODES so far
        armed_at, joining = None, join_timeout is not None
        gone: set = set()  # while joining: the ranks that exited before they came up
        while live:
            try:
                return Verdict("signal", value=signals.get_nowait())
            except queue.Empty:
                pass
            try:
                rank, code, when = self.exits.get(timeout=0.05)
            except queue.Empty:
                pass
            else:
                live.discard(rank)
                if joining and not self.beat(rank).ready:
                    gone.add(rank)  # its host did not come up; the others may still
                    continue
                if code not in CLEAN_EXIT_CODES:
                    rank, code = self._first_failure({rank: (code, when)}, live)
                    return Verdict("exit", rank, code)
                clean = max(clean, code)
                continue
            now = time.monotonic()
            if joining:
                waiting = {r for r in live if not self.beat(r).ready}
                if not waiting and gone:
                    return self._lost(gone)
                if not waiting:
                    joining = False
                elif now - self.started > join_timeout:
                    return self._lost(gone | waiting)
            if stop_when is not None and stop_when(self):
                return Verdict("stop")
            if self.job.watchdog:
                armed_at, stuck = self._stuck(live, armed_at, now)
                if stuck is not None:
                    return Verdict("watchdog", stuck, tied=tuple(self.tied_with(stuck)))
        return Verdict("done", value=clean)

    def _lost(self, ranks: set) -> Verdict:
        """The slots of ``ranks``, whose processes did not come up."""
        return Verdict("lost", lost=tuple(sorted(self.slots[r] for r in ranks)))

    def _stuck(self, live: set, armed_at: float | None, now: float):
        """``(armed_at, rank)``: the rank the others wait for, once one is ``watchdog`` seconds
        late, else None. The watchdog is armed by the first report of any process."""
        beats = {r: self.beat(r) for r in live}
        if armed_at is None and any(b.time > 0 for b in beats.values()):
            armed_at = now
        if armed_at is None:
            return None, None
        last = {
            r: (b.time or armed_at, b.reports) for r, b in beats.items() if b.how == beat.RUNNING
        }
        if not last or now - min(t for t, _ in last.values()) <= self.job.watchdog:
            return armed_at, None
        # The stuck rank is the one the others wait for: fewest reports, then oldest.
        return armed_at, min(last, key=lambda r: (last[r][1], last[r][0]))

    def tied_with(self, rank: int) -> list[int]:
        """The other running ranks that made as many reports as ``rank``: while all of them
        wait in the same step, the watchdog cannot tell which one holds the others."""
        mine = self.beat(rank)
        return [
            r
            for r in range(len(self.procs))
            if r != rank
            and self.procs[r].poll() is None
            and (b := self.beat(r)).how == beat.RUNNING
            and b.reports == mine.reports
        ]

    def _first_failure(self, failed: dict, live: set) -> tuple[int, int]:
        """``(rank, returncode)`` of the failure that came first, among ``failed`` and those that
        follow within `SETTLE` seconds.

        The order in which the launcher sees processes end is not always the order in which
        they failed: a rank killed by SIGKILL is seen to end only once the kernel has torn it
        down, and by then a peer may have seen its connections close, failed in a collective
        and exited. So the failures are ranked: first a process's own failure (an exception
        that is not JAX's runtime error, or a non-zero exit), by the time it decided to exit;
        then a death by a signal or an exit that did not go through `initialize`'s handlers, by
        the time the launcher saw it; last a failure in JAX's runtime (the error a collective
        raises when its peer is gone), by time.
        """
        deadline = time.monotonic() + SETTLE
        while live and time.monotonic() < deadline:
            try:
                rank, code, when = self.exits.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            live.discard(rank)
            if code not in CLEAN_EXIT_CODES:
                failed[rank] = (code, when)

        def order(rank):
            code, seen = failed[rank]
            b = self.beat(rank)
            if b.how == beat.FAILED and code > 0:
                return (0, b.time, rank)
            if b.how == beat.FAILED_IN_RUNTIME and code > 0:
                return (2, b.time, rank)
            return (1, seen, rank)

        first = min(failed, key=order)
        return first, failed[first][0]

    def stop(self, grace: float) -> None:
        """SIGTERM to every live process group, SIGKILL to those still there after ``grace``."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            live = [p for p in self.procs if p.poll() is None]
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

    def close(self) -> None:
        """Ends every process that is left and waits for their output."""
        self.stop(0.0)
        for pump in self.pumps:
            pump.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)


def worker_env(job: Job, slot: int, beat_file: str, *, probe: bool = False) -> dict:
    """This process's environment, plus what every worker of ``job`` on ``slot`` reads."""
    env = dict(os.environ) | {
        ENV_HEARTBEAT: beat_file,
        ENV_PLANNED: str(job.planned),
        ENV_SLOT: str(slot),
        ENV_LAUNCHER_FD: str(job.lifeline),
        "PYTHONUNBUFFERED": "1",
    }
    if job.devices_per_process:
        env[ENV_CPU_DEVICES] = str(job.devices_per_process)
    if probe:
        env[ENV_PROBE] = "1"
    return env


# Run first in each worker (Linux): PR_SET_PDEATHSIG, which survives the exec of the command,
# then the command. A separate tiny program rather than ``preexec_fn``, which would run Python
# in a child forked from a launcher that may have threads (JAX's).
_TRAMPOLINE = """import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 9)
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    print(f"replicator launch: cannot start {sys.argv[2]!r}: {e}", file=sys.stderr, flush=True)
    os._exit(127)
"""


def _dies_with_launcher(command: Sequence[str]) -> list[str]:
    """``command``, started so that the kernel ends it when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux") or os.environ.get("_REPLICATOR_NO_PDEATHSIG"):
        return list(command)
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *command]


def spawn(job: Job, env: dict, *, quiet: bool = False) -> subprocess.Popen:
    """Starts ``job.command`` in a process group of its own (so that its children end with it),
    dying with the launcher, its output piped (or dropped if ``quiet``)."""
    return subprocess.Popen(
        _dies_with_launcher(job.command),
        env=env,
        stdout=subprocess.DEVNULL if quiet else subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else subprocess.STDOUT,
        start_new_session=True,  # its own process group: we end its children too
        pass_fds=(job.lifeline,),
    )


def _reap(proc: subprocess.Popen, rank: int, exits: queue.Queue) -> None:
    code = proc.wait()
    exits.put((rank, code, time.monotonic()))


def _pump(proc: subprocess.Popen, rank: int, out, lock) -> None:
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            print(f"[{rank}] {line}", file=out, flush=True)
    proc.stdout.close()
