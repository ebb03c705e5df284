"""Byte-level text that ships with Python (`stdlib_text`: the standard library's sources) and
random windows of it as token batches (`token_batches`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np


def stdlib_text(max_bytes: int = 2_000_000) -> bytes:
    """The sources of Python's standard library, concatenated in sorted order: no download.

    Skips ``site-packages`` and test directories; stops at ``max_bytes``. Deterministic for a
    given Python installation.
    """
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "test", "tests", "idle_test")
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


def token_batches(
    data: bytes, *, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless random windows of ``data`` as byte tokens: ``{"tokens", "targets"}`` int32
    ``[batch_size, seq_len]``, targets shifted by one. Deterministic for a seed."""
    if len(data) < seq_len + 1:
        raise ValueError(
            f"token_batches: {len(data)} bytes are fewer than seq_len + 1 = {seq_len + 1}."
        )
    array = np.frombuffer(data, dtype=np.uint8)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(array) - seq_len, size=batch_size)
        window = np.stack([array[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        yield {"tokens": window[:, :-1], "targets": window[:, 1:]}
