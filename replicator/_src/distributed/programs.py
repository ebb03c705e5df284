"""The same step program on every process: fingerprinted, compared, and a difference refused
before it runs (`check_same_program`).

Processes that traced different programs hang in their first collective, or compute something
other than one program would: the first cause in MaxText's hang playbook ("inconsistent TPU
program"). Each process fingerprints the program it lowered (its StableHLO text, `normalised`
so that equal programs read alike on every process), and the processes compare fingerprints
over ``jax.distributed`` before the first step: one all-gather of 16 bytes when they agree. When
they do not, two more all-gathers find the first line that differs (each line's hash, then that
line's text), so that every process raises the same error, naming the processes and the first
differing instruction. One process compares nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

_SHOWN = 240  # characters of a differing line shown in the error
# What differs across processes in equal programs: source locations (``loc(...)`` and the
# ``#loc`` table, present when the text has debug information) and a Python callback's index
# in this process's registry of callbacks.
_LOCATION = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")
_CALLBACK_INDEX = re.compile(r"(index = )\d+( : ui64)")


class ProgramsDifferError(ValueError):
    """The processes of a job lowered different step programs, refused before they run.

    Raised by ``rp.fit`` on every process, before its first step (a collective of different
    programs would hang), naming the processes by fingerprint and the first line of the
    lowered step that differs.
    """


def normalised(text: str) -> list[str]:
    """The lines of a lowered program's text that every process of a job prints alike for the
    same program: without source locations, and with Python callbacks' process-local indices
    blanked out, after a first line naming the jax release and the platform that compile it.

    >>> text = '  %0 = stablehlo.add %a, %b : tensor<f32> loc(#loc3)\\n#loc3 = loc("x.py":1:2)'
    >>> normalised(text)[1:]
    ['  %0 = stablehlo.add %a, %b : tensor<f32>']
    """
    lines = [_versions()]
    for line in text.splitlines():
        if line.startswith("#loc"):
            continue
        line = _LOCATION.sub("", line).rstrip()
        if "python" in line and "callback" in line:
            line = _CALLBACK_INDEX.sub(r"\1#\2", line)
        lines.append(line)
    return lines


def _versions() -> str:
    device = jax.devices()[0]
    version = " ".join(str(getattr(device.client, "platform_version", "")).split())
    return f"// jax {jax.__version__} on {device.platform} ({version})"


def check_same_program(text: Callable[[], str], *, mesh: Mesh, api: str) -> None:
    """Refuses, on every process, a step whose program differs across the job's processes.

    ``text()`` is this process's program, e.g. ``repl.lower(step_fn, state, batch).as_text()``,
    on ``mesh``. It is compared only when the mesh spans every process of several: a mesh of
    one process's devices runs a program of its own (each process may train a model of its
    own), and then nothing is lowered, gathered or compared. Every process must call this at
    the same point, as it calls the step: the comparison is a collective.

    Raises:
      ProgramsDifferError: (a ValueError) on every process, naming the groups of processes by
        fingerprint and the first line of the program where the first process that differs
        from process 0 differs from it, with both lines.
    """
    if jax.process_count() == 1:
        return
    if len({d.process_index for d in mesh.devices.flat}) < jax.process_count():
        return
    from jax.experimental import multihost_utils

    lines = normalised(text())
    digest = hashlib.sha256("\n".join(lines).encode()).digest()[:16]
    digests = multihost_utils.process_allgather(np.frombuffer(digest, np.uint32))
    digests = np.asarray(digests).reshape(jax.process_count(), -1)
    if (digests == digests[0]).all():
        return
    raise ProgramsDifferError(_difference(lines, digests, api))


def _difference(lines: list[str], digests: np.ndarray, api: str) -> str:
    """The error's message, the same on every process (each calls this: it gathers)."""
    from jax.experimental import multihost_utils

    groups: dict[bytes, list[int]] = {}
    for p, row in enumerate(digests):
        groups.setdefault(row.tobytes(), []).append(p)
    other = next(p for p in range(len(digests)) if (digests[p] != digests[0]).any())
    hashes = np.array([_line_hash(line) for line in lines], np.uint32)
    counts = np.ravel(multihost_utils.process_allgather(np.array([hashes.size], np.int32)))
    padded = np.zeros(int(counts.max()), np.uint32)
    padded[: hashes.size] = hashes
    rows = np.asarray(multihost_utils.process_allgather(padded))
    n0, n1 = int(counts[0]), int(counts[other])
    differs = np.nonzero(rows[0, : min(n0, n1)] != rows[other, : min(n0, n1)])[0]
    at = int(differs[0]) if differs.size else min(n0, n1)
    mine = lines[at][:_SHOWN].strip() if at < len(lines) else "(the end of the program)"
    texts = np.asarray(multihost_utils.process_allgather(_with_length(mine.encode())))
    line0, line1 = (_text(texts[p]) for p in (0, other))
    fingerprints = "; ".join(
        f"process{'es' * (len(ps) > 1)} {', '.join(map(str, ps))}: {key[:4].hex()}"
        for key, ps in groups.items()
    )
    where = "the versions line" if at == 0 else f"line {at} of the lowered step"
    return (
        f"{api}: the {len(digests)} processes lowered different step programs, which would "
        f"hang (or compute differently) in their first collective; refused before the first "
        f"step. Fingerprints: {fingerprints}. The first difference between processes 0 and "
        f"{other} is {where}: process 0 has `{line0}`, process {other} has `{line1}`. Every "
        f"process must build the same step_fn on the same state and batch shapes, with the "
        f"same jax: look for what depends on the process (jax.process_index(), the host, its "
        f"environment variables or files, unseeded randomness) or differing code."
    )


def _with_length(raw: bytes) -> np.ndarray:
    """``raw`` (at most ``4 * _SHOWN`` bytes) after its length in 2 bytes, padded to a fixed
    size for a gather; `_text` reads it back."""
    raw = raw[: 4 * _SHOWN]
    out = np.zeros(4 * _SHOWN + 2, np.uint8)
    out[0], out[1] = divmod(len(raw), 256)
    out[2 : 2 + len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def _text(row: np.ndarray) -> str:
    n = int(row[0]) * 256 + int(row[1])
    return bytes(row[2 : 2 + n]).decode(errors="replace")


def _line_hash(line: str) -> int:
    return int.from_bytes(hashlib.blake2b(line.encode(), digest_size=4).digest(), "little")
