"""``explain --target`` in a process of its own: a TPU compile that aborts never takes the
command down.

libtpu's compiler ends the process (``abort()``, signal 6) on a failed internal check, with 40
lines of C++ stack: libtpu 0.0.42.1 (jax 0.10.2) does so in XLA's SPMD partitioner on some FSDP x
tensor-parallel programs that libtpu 0.0.50.1 (jax 0.12) compiles. So `explain` compiles in a
child process (multiprocessing's "spawn"), which sends back the report, or the error the library
raised, and this process prints it. The child's C++ output goes to a file; its Python ``stderr``
(the fit hint's progress, warnings) comes through the pipe.

When the child dies, what it was compiling decides what follows:

- the step with its layers unrolled (XLA's estimate read per layer): compiled again without, the
  estimate scaled from FLOPs, and the report says why;
- a change the fit hint tried: compiled again without hints, and the report says why;
- the step itself: `CompilerAbortedError`, one line naming the target, the jax/libtpu pair and
  the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import traceback

import jax

import replicator as rp

# what the child is compiling when it dies: the step itself, a per-layer compile, a hint's change
STEP, PER_LAYER, HINT = "the step", "the step with its layers unrolled", "a change the hint tried"


# Tests: the child ends as a failed check in libtpu ends it, before compiling what this names
# ("step", "per_layer", a hint's override such as "zero_stage=3", or "any").
ABORT_FOR_TESTS = "REPLICATOR_TEST_ABORT_COMPILING"


class CompilerAbortedError(RuntimeError):
    """The TPU compiler ended the process compiling a target's step (a failed check in XLA or
    libtpu). The message names the target, the jax/libtpu pair and what to do."""


def explain(config, target, *, per_layer: bool = True):
    """`targets.explain` (hints on) in a child process; see the module's docstring.

    Raises:
      CompilerAbortedError: the compiler ended the child compiling the step itself.
      What `targets.explain` raises (a refusal, `DoesNotFitError`), raised here again.
    """
    hints, notes = True, []
    while True:
        try:
            report = _in_child(config, target, per_layer=per_layer, hints=hints)
            break
        except _Died as died:
            if died.phase == PER_LAYER and per_layer:
                per_layer = False
                notes.append(_note(died, "XLA's estimate is scaled from FLOPs"))
            elif died.phase == HINT and hints:
                hints = False
                notes.append(_note(died, "no change that fits is named"))
            else:
                raise CompilerAbortedError(_message(config, target, died)) from None
    if notes:
        t = report.target
        how = f"{t.xla_seconds_how}; " if t.xla_seconds_how else ""
        report = dataclasses.replace(
            report, target=dataclasses.replace(t, xla_seconds_how=how + "; ".join(notes))
        )
    return report


class _Died(Exception):
    def __init__(self, phase: str, exitcode: int, check: str):
        super().__init__(phase)
        self.phase, self.exitcode, self.check = phase, exitcode, check


def _in_child(config, target, *, per_layer: bool, hints: bool):
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile("w+", prefix="replicator-tpu-", suffix=".log") as log:
        proc = context.Process(
            target=_child_main, args=(child, log.name, config, target, per_layer, hints),
            daemon=True,
        )  # fmt: skip
        proc.start()
        child.close()
        phase, answer = STEP, None
        try:
            while answer is None:
                try:
                    kind, value = parent.recv()
                except EOFError:  # the child is gone without an answer
                    proc.join()
                    log.seek(0)
                    raise _Died(phase, proc.exitcode, _fatal_check(log.read())) from None
                if kind == "phase":
                    phase = value
                elif kind == "stderr":
                    sys.stderr.write(value)
                    sys.stderr.flush()
                else:
                    answer = (kind, value)
        finally:
            parent.close()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    kind, value = answer
    if kind == "report":
        return value
    if kind == "error":
        raise value
    raise RuntimeError(f"explain --target: the compiling process failed:\n{value}")


def _child_main(conn, log_path, config, target, per_layer, hints) -> None:
    """The child: C++ output (fd 2) to ``log_path``, Python's stderr to the parent, then the
    report or the error raised, sent."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = _Relay(conn)
    from replicator.cli import targets

    abort_at = os.environ.get(ABORT_FOR_TESTS)

    def on_compile(what: str) -> None:
        conn.send(("phase", {"step": STEP, "per_layer": PER_LAYER}.get(what, HINT)))
        if abort_at in (what, "any"):  # as libtpu's failed checks end the process
            os.write(2, b"F0101 00:00:00.000000 1 tests.cc:1] Check failed: " + what.encode())
            os.abort()

    targets.on_compile = on_compile
    try:
        answer = ("report", targets.explain(config, target, hints=hints, per_layer=per_layer))
    except Exception as e:  # a refusal: raised again in the parent, unless it cannot travel
        plain = e if _picklable(e) else _plain(e)
        answer = ("error", plain) if plain is not None else ("crash", traceback.format_exc())
    conn.send(answer)
    conn.close()


class _Relay:
    """A text stream that sends what is written to the parent, a line at a time."""

    def __init__(self, conn):
        self._conn, self._buffer = conn, ""

    def write(self, text: str) -> int:
        self._buffer += text
        if "\n" in self._buffer:
            done, _, self._buffer = self._buffer.rpartition("\n")
            self._conn.send(("stderr", done + "\n"))
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self._conn.send(("stderr", self._buffer))
            self._buffer = ""

    def isatty(self) -> bool:
        return False


def _picklable(error: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return False
    return True


def _plain(error: Exception) -> Exception | None:
    """An error that cannot be pickled as the builtin it is a kind of (a refusal keeps its
    message and its exit code), or None."""
    for kind in (FileNotFoundError, NotImplementedError, ValueError, TypeError, OSError):
        if isinstance(error, kind):
            return kind(str(error))
    return None


def _fatal_check(log: str) -> str:
    """The compiler's own words for why it ended the process: glog's fatal line (``F1128 ...]
    Check failed: ...``), else the last line that says ``Check failed``, else ''."""
    for line in log.splitlines():
        found = re.match(r"F\d{4} [\d:.]+\s+\d+ ([\w.]+:\d+)\] (.*)", line)
        if found:
            return f"{found.group(2).strip()} ({found.group(1)})"
    checks = [line.strip() for line in log.splitlines() if "Check failed" in line]
    return checks[-1] if checks else ""


def _pair() -> str:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return f"jax {jax.__version__} with libtpu {importlib.metadata.version('libtpu')}"
    return f"jax {jax.__version__}"


def _how(died: _Died) -> str:
    if died.exitcode is not None and died.exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"ended the process ({signal.Signals(-died.exitcode).name})"
    return f"ended the process (exit code {died.exitcode})"


def _note(died: _Died, instead: str) -> str:
    return f"{_pair()} {_how(died)} compiling {died.phase}, so {instead} ({_fix()})"


def _fix() -> str:
    if jax.__version_info__ < (0, 12):
        return (
            "jax 0.12 with libtpu 0.0.50.1 compiles some of what libtpu 0.0.42.1 aborts on "
            "(Python 3.12 or newer, pip install -U 'replicator[tpu]'), and another layout (a "
            "different zero_stage or mesh.model) may compile"
        )
    return "another layout (a different zero_stage or mesh.model) may compile"


def _message(config, target: rp.targets.Target, died: _Died) -> str:
    check = f": {died.check}" if died.check else ""
    killed = died.exitcode == -signal.SIGKILL
    why = " (out of memory on this machine?)" if killed else ""
    return (
        f"the TPU compiler ({_pair()}) {_how(died)}{why} compiling {config.name}'s step for "
        f"{target.label}{check}; {_fix()}."
    )
