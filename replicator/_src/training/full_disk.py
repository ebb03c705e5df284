"""A checkpoint that cannot be written for lack of space: `CheckpointWriteError`.

When the filesystem of a checkpoint directory is full (or over quota), orbax's write fails deep in
tensorstore (``RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']``), or in a
plain file write (``OSError`` ENOSPC), and orbax logs that failure's traceback from each of its
threads before raising it; the writes still in flight then complete into orbax's closed event
loop, each printing a traceback of its own. `rp.Checkpoints` turns it into one
`CheckpointWriteError`: it removes the partial ``<step>.orbax-checkpoint-tmp`` directory (which
holds the space the write took), keeps the complete checkpoints as they are, and says what to
do; orbax's logged tracebacks of that failure, and those late completions, are dropped
(`quiet_failed_writes`), since the error says it all.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import threading
import time
import traceback

# The OS's words for a full filesystem, and tensorstore's way of quoting its errno.
_NO_SPACE = {
    errno.ENOSPC: ("No space left on device", "os_error_code='28'"),
    errno.EDQUOT: ("Disk quota exceeded", "os_error_code='122'"),
}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written: its filesystem is full (ENOSPC) or over quota (EDQUOT).

    Raised by `rp.Checkpoints.save` (and by ``wait``, ``close`` or the next ``save`` for an
    asynchronous save), so by `rp.fit`. The partial step directory has been removed and the
    complete checkpoints are untouched: once there is space, running again resumes from the newest.
    ``errno`` is the OS's (``errno.ENOSPC`` or ``errno.EDQUOT``), ``step`` the step that was not
    written and ``directory`` the checkpoint directory.
    """

    def __init__(
        self, message: str, *, code: int = errno.ENOSPC, step: int = -1, directory: str = ""
    ) -> None:
        super().__init__(message)
        self.errno = code
        self.step = step
        self.directory = directory


NO_SPACE = """\
rp.Checkpoints.save: checkpoint step {step} could not be written to {directory}: {reason} \
({errno}). Its partial directory was removed; the complete checkpoints there are untouched \
(newest: {newest}), so running again resumes from {resume}. Make room on that filesystem: free \
space (or quota), keep fewer checkpoints (keep={keep} now; a save needs room for one checkpoint \
more before the oldest beyond keep is deleted), or give checkpoint_dir a larger disk."""


def error(code: int, step: int, directory: str, steps: list[int], *, keep: int):
    """The `CheckpointWriteError` of ``step``, not written to ``directory`` (whose complete
    steps are ``steps``) for lack of space (``code``: the errno)."""
    newest = f"step {steps[-1]}" if steps else "none"
    message = NO_SPACE.format(
        step=step,
        directory=directory,
        reason=os.strerror(code).lower(),
        errno=errno.errorcode[code],
        newest=newest,
        resume=newest if steps else "step 0",
        keep=keep,
    )
    return CheckpointWriteError(message, code=code, step=step, directory=directory)


def no_space(failure: BaseException) -> int | None:
    """``errno.ENOSPC`` or ``errno.EDQUOT`` if ``failure`` (or an exception it was raised from
    or groups) is a write that failed for lack of space, else None."""
    seen, todo = set(), [failure]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return e.errno
        text = str(e)
        for code, words in _NO_SPACE.items():
            if any(word in text for word in words):
                return code
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def remove_partial(directory: str, step: int, *, timeout: float = 60.0) -> None:
    """Removes orbax's temporary directories of ``step`` (``<step>.orbax-checkpoint-tmp...``) in
    ``directory``: a write that failed midway, whose files hold space. Complete steps and
    anything else there are left alone.

    The other writes of that save may still be running when the first failure is raised (and
    would create their files again): first, orbax's writer threads still alive (its own thread
    classes, one per write operation) are waited for, ``timeout`` seconds at most in all."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if (
            type(thread).__module__.startswith("orbax.")
            and thread is not threading.current_thread()
        ):
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
    prefix = f"{step}.orbax-checkpoint-tmp"
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


class _FullDiskRecords(logging.Filter):
    """Drops orbax's log records of a write that failed for lack of space (their tracebacks run
    to hundreds of lines); `rp.Checkpoints` raises that failure as one `CheckpointWriteError`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname and record.name != "asyncio":
            return True  # asyncio: "exception was never retrieved" of the writes cut short
        failure = record.exc_info[1] if record.exc_info else None
        if failure is not None and no_space(failure) is not None:
            return False
        return not any(w in record.getMessage() for words in _NO_SPACE.values() for w in words)


_FILTER = _FullDiskRecords()


def _late_completion(unraisable) -> bool:
    """Whether ``unraisable`` is a tensorstore future completing into an asyncio event loop that
    has closed (orbax's, once a failed write ended the save): nothing waits for it."""
    e = unraisable.exc_value
    if not isinstance(e, RuntimeError) or str(e) != "Event loop is closed":
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return unraisable.object is None and bool(frames) and frames[0].name == "call_soon_threadsafe"


def _unraisable_hook(unraisable) -> None:
    if not _late_completion(unraisable):
        _unraisable_hook.previous(unraisable)


def quiet_failed_writes() -> None:
    """Drops orbax's logs of a full-disk failure (a filter on absl's ``absl`` logger, which orbax
    logs through) and the late completions of the writes it cut short (a ``sys.unraisablehook``
    that passes everything else on); installed once."""
    logging.getLogger("absl").addFilter(_FILTER)  # a no-op if it is there already
    logging.getLogger("asyncio").addFilter(_FILTER)
    if sys.unraisablehook is not _unraisable_hook:
        _unraisable_hook.previous = sys.unraisablehook
        sys.unraisablehook = _unraisable_hook
