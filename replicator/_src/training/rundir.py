"""The owner of a run directory: one run at a time writes a checkpoint directory and a metrics file.

Two runs into one directory would save the same step numbers over each other, rotate out each
other's checkpoints (``keep``) and interleave ``metrics.jsonl``. `rp.fit` therefore takes an
exclusive lock first: ``fcntl.flock`` on a lock file (``.replicator.lock`` inside the checkpoint
directory, ``<metrics file>.lock`` next to the metrics file), held through an open file
descriptor for the whole run. The file records the owner (PID, host, start time) for the message
that a second run gets. The kernel drops the lock when its process ends in any way, ``kill -9``
included, so a stale lock file never blocks a resume. A run that ends (returns or raises)
removes its lock files; only a killed run leaves one behind. With several processes, only
process 0 takes it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import inspect
import json
import os
import socket
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

LOCK_NAME = ".replicator.lock"


class RunDirLockedError(RuntimeError):
    """Another live run holds the lock of this run directory."""

    def __init__(self, message: str, *, path: str, owner: dict) -> None:
        super().__init__(message)
        self.path = path
        self.owner = owner


LOCKED = """\
{api}: the run directory {directory} is in use by another run: {owner}. Two runs into one \
directory would overwrite each other's checkpoints and interleave their metrics, so this one \
does not start. Wait until that run ends (then run this command again: it resumes), stop it \
(a killed run leaves no lock behind), or give this run another directory."""


def lock_paths(
    checkpoint_dir: str | os.PathLike | None, metrics_path: str | os.PathLike | None
) -> list[str]:
    """The lock files of a run writing ``checkpoint_dir`` and ``metrics_path`` (either may be
    None): one inside the checkpoint directory, one next to the metrics file."""
    paths = []
    if checkpoint_dir is not None and "://" not in os.fspath(checkpoint_dir):
        paths.append(os.path.join(os.path.abspath(os.fspath(checkpoint_dir)), LOCK_NAME))
    if metrics_path is not None:
        paths.append(os.path.abspath(os.fspath(metrics_path)) + ".lock")
    return paths


class RunLock:
    """An exclusive lock on a run's lock files, released by `release` or when the process ends.

    Args:
      paths: the lock files (see `lock_paths`); their directories are created.
      api: the API named in the error message.

    Raises:
      RunDirLockedError: at once, if a live process holds one of the locks; the message names
        the directory and the owner (PID, host, start time) and says how to proceed.
    """

    def __init__(self, paths: Sequence[str], *, api: str = "rp.fit") -> None:
        self._fds: list[tuple[int, str]] = []  # (descriptor, path) of each lock held
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        try:
            for path in paths:
                fd = self._lock(path, api)
                if fd is None:
                    continue
                self._fds.append((fd, path))
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        except BaseException:
            self.release()
            raise

    @staticmethod
    def _lock(path: str, api: str) -> int | None:
        """A descriptor of ``path`` holding its flock; None where the file system cannot lock.
        A file the run that held it removed meanwhile is opened anew (its lock guards nothing)."""
        import fcntl

        while True:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_owner(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    directory = (
                        os.path.dirname(path)
                        if path.endswith(LOCK_NAME)
                        else path.removesuffix(".lock")
                    )
                    raise RunDirLockedError(
                        LOCKED.format(api=api, directory=directory, owner=_describe(holder)),
                        path=directory,
                        owner=holder,
                    ) from None
                warnings.warn(  # e.g. a file system without flock: run unlocked
                    f"{api}: could not lock {path} ({e}); two runs into this directory "
                    f"would not be stopped.",
                    stacklevel=4,
                )
                return None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def release(self) -> None:
        """Removes the lock files, then unlocks them (closing the only descriptor releases the
        flock); a run that opened a file before it was removed sees that and opens it anew."""
        while self._fds:
            fd, path = self._fds.pop()
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


@contextlib.contextmanager
def locked(
    checkpoint_dir: str | os.PathLike | None,
    metrics_path: str | os.PathLike | None,
    *,
    api: str = "rp.fit",
) -> Iterator[RunLock | None]:
    """Holds the run's lock within the block, on process 0 only (other processes: None)."""
    import jax

    paths = lock_paths(checkpoint_dir, metrics_path)
    if not paths or jax.process_index() != 0:
        yield None
        return
    with RunLock(paths, api=api) as lock:
        yield lock


def holds_run_lock(fn: Callable) -> Callable:
    """Decorates `fit`: the run directory named by its ``checkpoint_dir`` and ``metrics_path``
    arguments is locked for the call, and released when it returns or raises."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        with locked(bound.get("checkpoint_dir"), bound.get("metrics_path")):
            return fn(*args, **kwargs)

    return wrapper


def _read_owner(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(owner: dict) -> str:
    if not owner.get("pid"):
        return "a process that has not written its name yet"
    text = f"PID {owner['pid']} on host {owner.get('host', '?')}"
    if owner.get("started"):
        text += f", started {owner['started']}"
    return text
