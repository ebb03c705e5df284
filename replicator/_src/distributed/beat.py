"""The heartbeat file: how a worker tells ``replicator launch`` where it stands, without a
system call per step.

Each worker of the launcher has a small file, mapped into memory on both sides, holding one
`Beat`: the ``time.monotonic()`` of its last report (or of the start of its exit); how it exits
(`RUNNING`, `EXITING`, `FAILED`, `FAILED_IN_RUNTIME`); its number of reports; the training step
it last started and the step of its newest checkpoint (0: none yet); and when it reached
``rp.distributed.initialize`` (0.0: not yet), which is how the launcher tells a host that is up
from one that never started. ``CLOCK_MONOTONIC`` is shared by every process of the machine, so
the launcher compares these times with its own clock, and with each other.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import time
from typing import NamedTuple

ENV_HEARTBEAT = "REPLICATOR_HEARTBEAT_FILE"

BEAT = struct.Struct("<ddqqqd")
RUNNING, EXITING, FAILED, FAILED_IN_RUNTIME = 0.0, 1.0, 2.0, 3.0


class Beat(NamedTuple):
    """One worker's report, as `read_beat` finds it."""

    time: float  # of the last report, or of the start of the exit; 0.0: no report yet
    how: float  # RUNNING, EXITING, FAILED or FAILED_IN_RUNTIME
    reports: int  # heartbeats so far
    step: int  # the training step last started (0: none, or not told)
    checkpoint: int  # the step of the newest checkpoint saved (0: none)
    ready: float  # when the process reached initialize (0.0: not yet)


EMPTY = Beat(0.0, RUNNING, 0, 0, 0, 0.0)

_page: list = []  # [mmap] once opened; [None] without the launcher
_mine = {"time": 0.0, "how": RUNNING, "reports": 0, "step": 0, "checkpoint": 0, "ready": 0.0}


def create(path: str) -> None:
    """Writes a fresh heartbeat file (no report yet) at ``path``; the launcher's side."""
    with open(path, "wb") as f:
        f.write(BEAT.pack(*EMPTY))


def read_beat(path: str) -> Beat:
    """The `Beat` in the file at ``path`` (`EMPTY` if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return Beat(*BEAT.unpack(f.read(BEAT.size)))
    except (OSError, struct.error):
        return EMPTY


def _open():
    path = os.environ.get(ENV_HEARTBEAT)
    page = None
    if path:
        try:
            with open(path, "r+b") as f:
                page = mmap.mmap(f.fileno(), BEAT.size)
        except (OSError, ValueError):
            page = None
    _page[:] = [page]
    if page is not None:
        atexit.register(mark_exiting)  # a process at its end is not stuck: stop watching it
    return page


def _write(**fields) -> bool:
    page = _page[0] if _page else _open()
    if page is None:
        return False
    _mine.update(fields)
    BEAT.pack_into(page, 0, *(_mine[k] for k in Beat._fields))
    return True


def report(step: int | None = None) -> bool:
    """One heartbeat (at the start of a step; ``step``: the step it starts, if known). Whether
    there is a launcher to report to."""
    fields = {"time": time.monotonic(), "how": RUNNING, "reports": _mine["reports"] + 1}
    if step is not None:
        fields["step"] = int(step)
    return _write(**fields)


def checkpointed(step: int) -> None:
    """Tells the launcher that the checkpoint of ``step`` is saved."""
    _write(checkpoint=int(step))


def mark_ready() -> None:
    """Tells the launcher that this process is up: it reached ``initialize``."""
    _write(ready=time.monotonic())


def mark_exiting(how: float = EXITING) -> None:
    """Tells the launcher that this process is exiting (and how): it is not stuck."""
    _write(time=time.monotonic(), how=how)
