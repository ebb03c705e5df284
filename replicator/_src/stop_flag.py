"""`StopFlag`: SIGTERM and SIGINT ask `fit` to stop (preemption) at its next step boundary."""

from __future__ import annotations

import contextlib
import signal
import threading


class StopFlag:
    """SIGTERM/SIGINT set a flag that the loop reads at each step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
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
