"""The run directory of ``replicator train`` (``out_dir/name``) around `jobs.run`: checked before
anything is written, created only once the job is built, removed again when the run is refused
before its first step; the ``init_from`` a run started with; and the machine it runs on.

Built on the public API only, as the rest of the CLI.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys

INIT_FROM_RECORD = "init_from.txt"  # in out_dir/name: the init_from the run started from


def check_out_dir(out_dir: str, name: str) -> None:
    """Refuses an ``out_dir`` (or ``out_dir/name``) that is a file or lies under one, or a
    directory this process cannot write, before anything is created.

    Raises:
      ValueError: naming the key and the fix.
    """
    out = os.path.join(out_dir, name)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(
            f"name={name!r}: {out} is a file, not a run directory; give another name, or move "
            f"the file away."
        )
    existing = out if os.path.isdir(out) else _existing_parent(out)
    if isinstance(existing, tuple):  # a file on the way
        raise ValueError(
            f"out_dir={out_dir!r}: {existing[0]} is a file, not a directory; give an out_dir "
            f"that is a directory or does not exist yet, e.g. out_dir=runs."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"out_dir={out_dir!r}: cannot write the run directory {out} ({existing} is not "
            f"writable); give an out_dir you can write, e.g. out_dir=runs."
        )


def _existing_parent(path: str) -> str | tuple[str]:
    """The deepest existing directory above ``path``, or ``(file,)`` if a file is in the way."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path if os.path.isdir(path) else (path,)


def make(out: str, out_dir: str) -> list[str]:
    """Creates the run directory ``out`` and its missing parents; returns the directories it
    created, outermost first (for `remove`). A run directory that exists (a resumed run) is
    used as it is.

    Raises:
      ValueError: naming ``out_dir``, if the directory cannot be created.
    """
    missing, path = [], os.path.abspath(out)
    while not os.path.exists(path):
        missing.insert(0, path)
        path = os.path.dirname(path)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"out_dir={out_dir!r}: cannot create the run directory {out} ({e.strerror}); give an "
            f"out_dir you can write, e.g. out_dir=runs."
        ) from None
    return missing


def remove(created: list[str]) -> None:
    """Removes what `make` created (a run refused before its first step leaves nothing): the
    run directory with what the run wrote in it, and the parents it created if they are empty.
    Nothing, for a run directory that existed before."""
    if not created:
        return
    shutil.rmtree(created[0] if len(created) == 1 else created[-1], ignore_errors=True)
    for parent in reversed(created[:-1]):
        with contextlib.suppress(OSError):
            os.rmdir(parent)


def checkpoint_steps(out: str) -> list[int]:
    """The steps of the checkpoints in ``out/checkpoints`` (names that are numbers), sorted."""
    try:
        names = os.listdir(os.path.join(out, "checkpoints"))
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def note_init_from(init_from: str | None, out: str, run_name: str) -> None:
    """Records the ``init_from`` of a fresh run in ``out``; on a resumed run started from another
    (or from none), says in one line on stderr that the run's checkpoint wins over it.

    Call it on process 0 once ``out`` exists.
    """
    record = os.path.join(out, INIT_FROM_RECORD)
    steps = checkpoint_steps(out)
    given = _normal(init_from)
    if not steps:  # a fresh run (or none saved yet): init_from is what it starts from
        if given is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(record)
        else:
            with open(record, "w") as f:
                f.write(given + "\n")
        return
    try:
        with open(record) as f:
            started = f.read().strip() or None
    except OSError:
        started = None
    if given is None or given == started:
        return
    began = f"init_from={started!r}" if started else "no init_from"
    print(
        f"replicator train {run_name}: resuming from the checkpoint of step {steps[-1]} in "
        f"{os.path.join(out, 'checkpoints')}, which wins: the run was started with {began}, and "
        f"init_from={init_from!r} is not read. To start fresh from it, give another name= or "
        f"out_dir= (or delete {out}).",
        file=sys.stderr,
        flush=True,
    )


def _normal(path: str | None) -> str | None:
    return None if not path else os.path.realpath(os.path.expanduser(path))


def machine(devices: list) -> str:
    """Where the job runs, for its first line: ``cpu (AMD EPYC 7B13, 8 emulated devices)``, or
    ``tpu (TPU v5 lite, 8 devices)``. XLA:CPU's code (and so the last bits of a loss after many
    steps) differs by CPU, hence its model name."""
    first, n = devices[0], len(devices)
    if first.platform == "cpu":
        count = f"{n} emulated devices" if n > 1 else "1 device"
        return f"cpu ({cpu_name()}, {count})"
    kind = getattr(first, "device_kind", "") or first.platform
    return f"{first.platform} ({kind}, {n} device{'s' * (n > 1)})"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s, on Linux), or what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
