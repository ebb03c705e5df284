"""The stop agreement of `StopFlag`, with processes played by threads around a fake
key-value store (the real one, with real processes: tests/multiprocess/test_preemption.py)."""

import os
import signal
import threading
import time

import pytest

from replicator._src.training.stop_flag import StopFlag, _Agreement


class FakeStore:
    """The part of JAX's coordination-service client that the agreement uses."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.changed:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value
            self.changed.notify_all()

    def key_value_try_get(self, key):
        with self.changed:
            if key not in self.values:
                raise KeyError(f"NOT_FOUND: {key}")
            return self.values[key]

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


def _agreement(store, me, *, timeout=30.0):
    return _Agreement(store, prefix="run", me=me, count=2, timeout=timeout, poll=0.01)


def test_a_notice_from_one_process_stops_every_process_after_the_same_step():
    store = FakeStore()
    agreements = [_agreement(store, 0), _agreement(store, 1)]
    stopped = {}

    def process(me: int, pause: float) -> None:
        for step in range(1, 10_000):
            if me == 1 and step == 7:
                agreements[1].post("SIGTERM")
            if agreements[me].after_step(step):
                stopped[me] = step
                return
            time.sleep(pause)

    threads = [threading.Thread(target=process, args=a) for a in ((0, 0.03), (1, 0.01))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for a in agreements:
        a.close()
    assert stopped[0] == stopped[1] >= 8, stopped
    reported = [int(store.values[f"run/step/{p}"]) for p in (0, 1)]
    assert reported[0] < reported[1]  # the processes were at different steps...
    assert stopped[0] == max(reported) + 1  # ...and stop after one that neither had passed
    assert agreements[0].notice == "SIGTERM in process 1"


def test_a_process_that_never_reports_ends_the_wait_with_an_error_naming_it():
    store = FakeStore()
    alone = _agreement(store, 1, timeout=0.5)  # process 0 never watches
    alone.post("SIGTERM")
    with pytest.raises(RuntimeError, match=r"could not agree .* no report from process 0 "):
        for step in range(1, 1000):
            alone.after_step(step)
            time.sleep(0.01)
    alone.close()


def test_alone_a_signal_stops_at_the_next_step():
    flag = StopFlag()
    with flag.installed():
        assert not flag.after_step(1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # Python runs the handler between bytecodes
        assert flag.after_step(2)
    assert flag.stopped_by == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is not None
