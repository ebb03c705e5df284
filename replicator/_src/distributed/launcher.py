"""The local launcher: N processes of one job on this machine (``replicator launch``), restarted
when one fails, resized when a host is gone.

`launch` is like ``horovodrun`` and ``torchrun``: it runs the job in rounds (``rounds.py``: the
processes, their output prefixed with their rank, their heartbeats). A round ends at its first
failure (an exit code, a signal, or no `heartbeat` for ``watchdog`` seconds): the launcher stops
the others and names the rank that failed first. With ``max_restarts``, it then starts the job
again, which resumes from its newest checkpoint through ``rp.fit``; a failure that repeats at the
same step is not restarted again. With ``min_processes``, a restart on which a host does not come
up goes on with fewer processes, and grows back at a checkpoint once the host answers again.
SIGTERM and SIGINT to the launcher are passed on to every process group, and no process outlives
the launcher, even when it is killed by SIGKILL. The command line around it (``replicator launch
-n 2 -- python train.py``) is ``replicator/cli/launch.py``.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from replicator._src.core import errors
from replicator._src.distributed import beat
from replicator._src.distributed.restarts import Restarts, check, from_keywords, seconds
from replicator._src.distributed.rounds import (
    FAILURE_GRACE,
    WATCHDOG_EXIT_CODE,
    Job,
    Round,
    Verdict,
    free_port,
    spawn,
    worker_env,
)

__all__ = ["launch", "free_port", "WATCHDOG_EXIT_CODE", "elastic_size"]

BACKOFF_LIMIT = 60.0  # seconds: the backoff doubles after each restart, up to this
USAGE_EXIT_CODE = 2  # a usage or configuration error (argparse's, replicator train's refusals)
MAX_DEVICES_PER_PROCESS = 4096  # emulated CPU devices: 4096 take about 8 s to start


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace: float = 10.0,
    watchdog: float | None = None,
    restarts: Restarts | None = None,
    out=None,
    err=None,
    **deprecated,
) -> int:
    """Runs ``command`` as ``num_processes`` local processes of one job; returns its exit code.

    Each process gets ``REPLICATOR_COORDINATOR=127.0.0.1:<port>``, its
    ``REPLICATOR_PROCESS_ID`` and ``REPLICATOR_NUM_PROCESSES`` (and ``REPLICATOR_CPU_DEVICES``),
    which `initialize` reads, and runs in a process group of its own. Every line they print comes
    out prefixed with ``[rank]``. A round of the job ends at its first failure:

    * A process that exits non-zero or is killed: the launcher names the rank that failed first
      (later deaths are the teardown's doing) and the step it was in, sends the others' process
      groups SIGTERM, then SIGKILL after ``min(grace, 0.5)`` seconds.
    * ``watchdog``: when a process goes ``watchdog`` seconds without a `heartbeat` (``rp.fit``
      reports one per step), the launcher names it and stops the round (code 124). The
      watchdog is armed by the first report of any process; a process that is exiting is not
      watched. When several ranks stopped in the same step, it names them all.

    Then, while restarts are left (``restarts.max_restarts``), it waits ``restarts.backoff`` seconds
    (doubled after each restart, up to 60) and starts every process again: ``rp.fit`` resumes
    from the newest good checkpoint. Each restart is logged with the failing rank, its cause and
    its step. A rank that fails at a step where a rank failed before ends the job with "failed
    twice at step N": a deterministic crash is not retried forever.

    Elastic resizing (``restarts.min_processes`` < ``num_processes``): on a restart, a process that exits
    before it reaches ``initialize``, or has not within ``join_timeout`` seconds, is a host that
    is gone. The job goes on with the largest count ``p`` of the hosts that are up with
    ``min_processes <= p`` and ``p`` dividing ``num_processes`` (so the data axes shrink by a
    whole factor: ``ProcessInfo.elastic_factor`` says by how much, for the job to keep its global
    batch). Every ``rejoin_interval`` seconds the launcher asks a lost host whether it is back
    (it runs the command with ``REPLICATOR_PROBE=1``, and ``initialize`` exits at once); once the
    job can grow, it stops it after its next checkpoint and restarts it on more processes. This
    is neither a failure nor a restart counted against ``max_restarts``.

    SIGTERM or SIGINT to the launcher is passed on to every process group; after ``grace``
    seconds (time for ``rp.fit`` to save a checkpoint) the rest get SIGKILL, and the launcher
    returns 128 + the signal. No process outlives the launcher: on Linux each is started with
    ``PR_SET_PDEATHSIG`` (SIGKILL), and everywhere ``initialize`` ends its process group when a
    pipe only the launcher holds reaches its end (the launcher is gone, even by SIGKILL).

    Args:
      command: the program and its arguments.
      num_processes: how many processes (>= 1).
      devices_per_process: emulated CPU devices per process, or None for the platform's own.
      port: the coordinator's port on 127.0.0.1 for the first round (default: a free one;
        each restart takes a free one).
      grace: seconds between the SIGTERM passed on from the launcher and SIGKILL.
      watchdog: seconds without progress after which a process counts as stuck (None: off).
      restarts: a `Restarts`: how often the job starts again after a failure, and how it
        resizes when hosts are lost (default: never restarted).
      out: where the processes' output goes (default: sys.stdout).
      err: where the launcher's own lines go, ``replicator launch: ...`` (default:
        sys.stderr; ``out`` when only ``out`` is given).
      **deprecated: the keywords `Restarts` replaced (``max_restarts``, ``min_processes``,
        ``restart_backoff``, ``join_timeout``, ``rejoin_interval``), for one release.

    Returns:
      0 if every process of a round exited 0, else the code of the failure that ended the job
      (128 + signal if it was killed, as shells do; 124 for the watchdog). A process's exit
      with ``replicator train``'s clean codes (4: nothing to do; 130/143: stopped by
      SIGINT/SIGTERM at a step boundary, resumable) is no failure: the others are waited for,
      nothing is restarted, and the job ends with the largest such code.

    Raises:
      ValueError: for a bad argument, or a command that cannot be found.

    Example, as ``replicator launch -n 4 --max-restarts 3 --min-processes 2 -- python train.py``::

        code = rp.distributed.launch(
            ["python", "train.py"], num_processes=4,
            restarts=rp.distributed.Restarts(max_restarts=3, min_processes=2))
    """
    r = from_keywords(restarts, deprecated)
    _check_launch_args(command, num_processes, devices_per_process, port, grace, watchdog)
    check(num_processes, r)
    read_end, write_end = os.pipe()  # the launcher's lifeline: its end closes with the launcher
    job = _Job(
        tuple(command), num_processes, devices_per_process, grace, watchdog,
        out or sys.stdout, threading.Lock(), read_end, err or out or sys.stderr,
    )  # fmt: skip
    signals: queue.Queue = queue.Queue()
    previous = _install_forwarding(signals)
    try:
        policy = _Policy(job, r.max_restarts, r.min_processes or num_processes, r.backoff)
        return policy.run(signals, port, r.join_timeout, r.rejoin_interval)
    finally:
        _restore_signals(previous)
        os.close(read_end)
        os.close(write_end)


@dataclasses.dataclass(frozen=True)
class _Job(Job):
    """The launch's `Job`, whose own lines (`say`) go to ``err``, apart from the processes'
    output: stderr, where a tool's messages belong."""

    err: object = None

    def say(self, message: str) -> None:
        with self.lock:
            print(f"replicator launch: {message}", file=self.err, flush=True)


def elastic_size(available: int, planned: int, minimum: int) -> int | None:
    """The processes a job of ``planned`` goes on with when ``available`` hosts are up.

    It is the largest ``p <= available`` with ``p >= minimum`` that divides ``planned``, or None.

    >>> elastic_size(3, 4, 2), elastic_size(4, 4, 2), elastic_size(1, 4, 2), elastic_size(5, 6, 2)
    (2, 4, None, 3)
    """
    for p in range(min(available, planned), minimum - 1, -1):
        if p >= 1 and planned % p == 0:
            return p
    return None


class _Policy:
    """Rounds until the job is done: restarts, the same-step rule, resizing, growing back."""

    def __init__(self, job: Job, max_restarts: int, minimum: int, backoff: float) -> None:
        self.job, self.max_restarts, self.minimum = job, max_restarts, minimum
        self.backoff = backoff
        self.restarts = 0
        self.failed_steps: dict[int, int] = {}  # step -> the rank that failed there
        self.up = list(range(job.planned))  # the slots that came up last time
        self.lost: list[int] = []
        self.rejoin: _Rejoin | None = None

    def run(self, signals: queue.Queue, port, join_timeout: float, rejoin_interval: float) -> int:
        resizing = self.minimum < self.job.planned
        first = True
        while True:
            size = elastic_size(len(self.up), self.job.planned, self.minimum)
            if size is None:
                self.job.say(
                    f"only {len(self.up)} of the {self.job.planned} process(es) came up, fewer "
                    f"than --min-processes {self.minimum} (or no count that divides "
                    f"{self.job.planned}); stopping. Lost process slots: {self.lost}."
                )
                return 1
            self.rejoin = None
            if self.lost:
                self.rejoin = _Rejoin(self.job, self.lost, rejoin_interval, join_timeout)
            rnd = Round(self.job, self.up[:size], port=port if first else None)
            try:
                rnd.start()
                verdict = rnd.watch(
                    signals,
                    join_timeout=join_timeout if resizing and not first else None,
                    stop_when=self._can_grow if self.rejoin else None,
                )
                code = self._after(rnd, verdict)
            finally:
                if self.rejoin is not None:
                    self.rejoin.close()
                rnd.close()
            if code is not None:
                return code
            first = False
            if verdict.kind == "exit" or verdict.kind == "watchdog":
                sig = self._wait(signals)
                if sig is not None:
                    return 128 + sig

    def _after(self, rnd: Round, verdict: Verdict) -> int | None:
        """Ends ``rnd`` as ``verdict`` says; the job's exit code, or None to run another round."""
        job = self.job
        if verdict.kind == "done":
            if verdict.value:  # e.g. replicator train stopped by SIGTERM: resumable, no failure
                what = (
                    "nothing to do: the run was at its steps already"
                    if verdict.value == 4
                    else f"stopped by {signal.Signals(verdict.value - 128).name} at a step "
                    f"boundary; the same command resumes"
                )
                job.say(f"the processes stopped cleanly, with exit code {verdict.value} ({what}).")
            return verdict.value or 0
        if verdict.kind == "signal":
            rnd.stop(job.grace)
            message, code = _outcome(verdict, rnd)
            job.say(message)
            return code
        if verdict.kind == "lost":
            rnd.stop(min(job.grace, FAILURE_GRACE))
            self.lost = sorted(set(self.lost) | set(verdict.lost))
            self.up = [s for s in self.up if s not in verdict.lost]
            size = elastic_size(len(self.up), job.planned, self.minimum)
            going = f"going on with {size}" if size else "too few to go on"
            job.say(
                f"process slot(s) {list(verdict.lost)} did not come up (exited, or not at "
                f"rp.distributed.initialize within --join-timeout); {len(self.up)} of "
                f"{job.planned} up, {going} (--min-processes {self.minimum})."
            )
            return None
        if verdict.kind == "stop":  # a lost host is back: grow at this checkpoint
            rnd.stop(job.grace)
            back = self.rejoin.back
            self.up = sorted(set(self.up) | set(back))
            self.lost = [s for s in self.lost if s not in back]
            size = elastic_size(len(self.up), job.planned, self.minimum)
            job.say(
                f"process slot(s) {back} are back: stopped the job after its checkpoint of step "
                f"{rnd.newest_checkpoint()} to go on with {size} process(es)."
            )
            return None
        rnd.stop(min(job.grace, FAILURE_GRACE))
        return self._failed(rnd, verdict)

    def _failed(self, rnd: Round, verdict: Verdict) -> int | None:
        message, code = _outcome(verdict, rnd)
        b = rnd.beat(verdict.rank)
        step, at = _where(b)
        if at and "; stopped" in message:
            message = message.replace("; stopped", f" {at}; stopped", 1)
        elif at:  # a job of one process: no other to stop
            message = f"{message[:-1]} {at}."

        if verdict.kind == "exit" and verdict.value == USAGE_EXIT_CODE and not at:
            self.job.say(
                f"{message} Exit code {USAGE_EXIT_CODE} before any heartbeat is a usage or "
                f"configuration error (replicator train's refusals), which a restart would only "
                f"repeat: not restarted. Fix the command and run it again."
            )
            return code
        at = at or "before any heartbeat"
        if step in self.failed_steps:
            self.job.say(
                f"{message} Rank {verdict.rank} failed twice {at} (rank "
                f"{self.failed_steps[step]} failed there before): a failure that repeats at the "
                f"same step is not restarted again."
            )
            return code
        if self.restarts >= self.max_restarts:
            spent = f" No restart left (--max-restarts {self.max_restarts})." * bool(
                self.max_restarts
            )
            self.job.say(message + spent)
            return code
        self.failed_steps[step] = verdict.rank
        self.restarts += 1
        saved = rnd.newest_checkpoint()
        since = f"the checkpoint of step {saved}" if saved else "its newest checkpoint, if any"
        self.job.say(
            f"{message} Restart {self.restarts} of {self.max_restarts} in {self.backoff:g} s, "
            f"resuming from {since}."
        )
        return None

    def _wait(self, signals: queue.Queue) -> int | None:
        """The backoff before a restart; the signal the launcher got meanwhile, if any."""
        try:
            sig = signals.get(timeout=self.backoff)
        except queue.Empty:
            self.backoff = min(self.backoff * 2, BACKOFF_LIMIT)
            return None
        self.job.say(f"got {signal.Signals(sig).name} while waiting to restart; stopped.")
        return sig

    def _can_grow(self, rnd: Round) -> bool:
        rejoin = self.rejoin
        rejoin.poll()
        if not rejoin.back:
            return False
        size = elastic_size(len(self.up) + len(rejoin.back), self.job.planned, self.minimum)
        if size is None or size <= len(rnd.slots):
            return False
        if rejoin.checkpoint_then is None:
            rejoin.checkpoint_then = rnd.newest_checkpoint()
        return rnd.newest_checkpoint() > rejoin.checkpoint_then


class _Rejoin:
    """Probes of the lost slots, one at a time, every ``interval`` seconds; a probe that has not
    reached ``initialize`` within ``timeout`` seconds finds its host still gone."""

    def __init__(self, job: Job, lost: list[int], interval: float, timeout: float) -> None:
        self.job, self.lost, self.interval, self.timeout = job, list(lost), interval, timeout
        self.back: list[int] = []
        self.checkpoint_then: int | None = None  # the newest checkpoint when a slot came back
        self.next_at = time.monotonic() + interval
        self.probe: tuple | None = None  # (slot, process, beat file, started)
        self.dir = tempfile.mkdtemp(prefix="replicator-probe-")

    def poll(self) -> None:
        now = time.monotonic()
        if self.probe is not None:
            slot, proc, path, started = self.probe
            code = proc.poll()
            if code is None and now - started < self.timeout:
                return
            if code == 0 and beat.read_beat(path).ready:
                self.back.append(slot)
                self.lost.remove(slot)
            elif code is None:
                proc.kill()
                proc.wait()
            self.probe = None
        pending = [s for s in self.lost if s not in self.back]
        if pending and now >= self.next_at:
            slot = pending[0]
            self.lost.append(self.lost.pop(self.lost.index(slot)))  # the next probe: another
            path = os.path.join(self.dir, f"slot{slot}.beat")
            beat.create(path)
            proc = spawn(self.job, worker_env(self.job, slot, path, probe=True), quiet=True)
            self.probe = (slot, proc, path, now)
            self.next_at = now + self.interval

    def close(self) -> None:
        if self.probe is not None and self.probe[1].poll() is None:
            self.probe[1].kill()
            try:
                self.probe[1].wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def _where(b: beat.Beat) -> tuple[int, str]:
    """Where a rank failed, from its last `Beat`: a key (the same key twice is the same step)
    and the words for it."""
    if b.step:
        return b.step, f"at step {b.step}"
    if b.reports:  # a loop that reports no step: its heartbeats count them
        return -b.reports, f"after {b.reports} heartbeat(s)"
    return 0, ""  # no report: before its first step, or a script that reports none


def _outcome(verdict: Verdict, rnd: Round) -> tuple[str, int]:
    """The launcher's line for a verdict that ends a round, and its exit code."""
    n, rank, value = len(rnd.slots), verdict.rank, verdict.value
    others = n - 1
    if verdict.kind == "signal":
        message = f"got {signal.Signals(value).name}; passed it to the {n} process(es)"
        return message + " and waited for them to end.", 128 + value
    if verdict.kind == "watchdog":
        watchdog = rnd.job.watchdog
        tied = verdict.tied
        who = f"rank {rank}"
        if tied:
            who = (
                f"ranks {sorted([rank, *tied])} (each stopped in the same step, so the one the "
                f"others wait for cannot be told apart; rank {rank} reported last the longest ago)"
            )
        message = (
            f"{who} made no progress for more than {watchdog:g} s (--watchdog {watchdog:g}: no "
            f"rp.distributed.heartbeat(), which rp.fit reports each step); stopped it and the "
            f"other {others} process(es)."
        )
        return message, WATCHDOG_EXIT_CODE
    how = f"was killed by {signal.Signals(-value).name}" if value < 0 else f"exited with {value}"
    stopped = f"; stopped the other {others} process(es)" if others else ""
    message = f"rank {rank} {how}{stopped}."
    return message, 128 - value if value < 0 else value


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
    api = "replicator launch"
    errors.positive_int(num_processes, api=api, name="-n")
    errors.positive_int(
        devices_per_process, api=api, name="--devices-per-process",
        none=" (or left out for the platform's own devices)",
    )  # fmt: skip
    if devices_per_process is not None and devices_per_process > MAX_DEVICES_PER_PROCESS:
        raise ValueError(
            f"{api}: --devices-per-process {devices_per_process} is more CPU devices than a "
            f"process can emulate (at most {MAX_DEVICES_PER_PROCESS}); give at most "
            f"{MAX_DEVICES_PER_PROCESS}."
        )
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
