"""`StopFlag`: SIGTERM and SIGINT ask `fit` to stop (preemption) at a step boundary, the same
one in every process.

Alone, a process stops at the first boundary after the signal. With several processes, a signal
usually reaches one of them (or each at another time), and a process that stopped alone would
leave the others waiting in the next step's collectives. So the process that got the signal posts
a notice in JAX's coordination service (its key-value store), and a thread in each process watches
for it. On the notice, each watcher reports the last step its process has started and the step
to stop after is one past the largest report: every process has not yet passed it. A process that
has passed its own report waits at its next boundary until the step is known; the watchers never
wait on the training, so that wait ends as soon as every process has reported (or fails after
``timeout`` seconds, naming the processes that did not).
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading

import jax

from replicator._src.core import compat

_runs = itertools.count()  # fit calls in this process: every process makes the same ones


class StopFlag:
    """Whether to stop after a step: a signal here, or a notice from another process.

    Use ``with flag.installed():`` around the loop, and ``flag.after_step(step)`` after starting
    each step, before anything that waits on its results.
    """

    def __init__(self, *, timeout: float = 120.0, poll: float = 0.05) -> None:
        self.requested = False  # a signal reached this process
        self.signal_name = ""
        self.stopped_by = ""  # why the run stopped: "SIGTERM", or "SIGTERM in process 1"
        self._timeout, self._poll = timeout, poll
        self._agreement: _Agreement | None = None

    @contextlib.contextmanager
    def installed(self):
        """Catches SIGTERM and SIGINT (from the main thread) and, with several processes, watches
        the others' notices; both undone on exit."""
        with contextlib.ExitStack() as stack:
            if threading.current_thread() is threading.main_thread():
                stack.enter_context(self._handlers())
            if jax.process_count() > 1:
                client = compat.coordination_client()
                if client is not None:
                    self._agreement = _Agreement(
                        client,
                        prefix=f"replicator/fit/{next(_runs)}",
                        me=jax.process_index(),
                        count=jax.process_count(),
                        timeout=self._timeout,
                        poll=self._poll,
                    )
                    stack.callback(self._agreement.close)
            yield self

    @contextlib.contextmanager
    def _handlers(self):
        previous = {}

        def handler(signum, frame):
            self.requested = True
            self.signal_name = signal.Signals(signum).name

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def after_step(self, step: int) -> bool:
        """Whether to stop after ``step`` (the steps started so far); called once per step, in
        order, by every process. With several processes it may wait for the others' reports
        (never for their training), and raises RuntimeError if they do not come."""
        if self._agreement is None:
            if self.requested:
                self.stopped_by = self.signal_name
            return self.requested
        if self.requested:
            self._agreement.post(self.signal_name)
        stop = self._agreement.after_step(step)
        if stop:
            self.stopped_by = self._agreement.notice or self.signal_name
        return stop


class _Agreement:
    """The step every process stops after, agreed through JAX's coordination service."""

    def __init__(
        self, client, *, prefix: str, me: int, count: int, timeout: float, poll: float
    ) -> None:
        self.client, self.prefix, self.me, self.count = client, prefix, me, count
        self.timeout, self.poll = timeout, poll
        self.notice = ""  # "SIGTERM in process 1"
        self._lock = threading.Lock()
        self._current = 0  # the last step this process has started
        self._reported: int | None = None
        self._stop_after: int | None = None
        self._error = ""
        self._posted = False
        self._decided = threading.Event()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="replicator-stop", daemon=True)
        self._watcher.start()

    def post(self, signal_name: str) -> None:
        if not self._posted:
            self._posted = True
            self.client.key_value_set(
                f"{self.prefix}/notice", f"{signal_name} in process {self.me}", allow_overwrite=True
            )

    def after_step(self, step: int) -> bool:
        with self._lock:
            self._current = step
            wait = self._stop_after is None and self._reported is not None
            wait = wait and step > self._reported
        if wait and not self._decided.wait(self.timeout):
            # The watcher's own read of the reports times out as well, a poll later at most:
            # give it that long to name who did not answer (or to agree after all).
            self._decided.wait(self.timeout + self.poll)
        if (wait and not self._decided.is_set()) or self._error:
            raise RuntimeError(
                f"rp.fit: {self.notice or 'a stop request'}, but the processes could not agree "
                f"on the step to stop after within {self.timeout:g} s: "
                f"{self._error or 'no answer'}. The last checkpoint is kept; restart the job."
            )
        return self._stop_after is not None and step >= self._stop_after

    def _watch(self) -> None:
        key = f"{self.prefix}/notice"
        while not self._closed.wait(self.poll):
            try:
                notice = self.client.key_value_try_get(key)
            except Exception:  # not posted yet (NOT_FOUND)
                continue
            self._agree(notice)
            return

    def _agree(self, notice: str) -> None:
        with self._lock:
            self.notice, self._reported = notice, self._current
        reports: dict[int, int] = {}
        try:
            self.client.key_value_set(f"{self.prefix}/step/{self.me}", str(self._reported))
            for process in range(self.count):
                if self._closed.is_set():
                    return
                reports[process] = int(
                    self.client.blocking_key_value_get(
                        f"{self.prefix}/step/{process}", int(self.timeout * 1000)
                    )
                )
        except Exception as e:  # a process gone, or the service
            waited = min(set(range(self.count)) - set(reports))
            self._error = f"no report from process {waited} ({str(e).splitlines()[0]})"
        else:
            with self._lock:
                self._stop_after = max(reports.values()) + 1
        self._decided.set()

    def close(self) -> None:
        self._closed.set()
        self._watcher.join(timeout=2 * self.poll + 0.1)
