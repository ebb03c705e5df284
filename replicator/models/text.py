"""The built-in text (`stdlib_text`: Python 3.11's standard-library sources, shipped in
``corpus/``) and random windows of it as token batches (`token_batches`)."""

from __future__ import annotations

import functools
import lzma
import pathlib
from collections.abc import Iterator

import numpy as np

CORPUS = pathlib.Path(__file__).parent / "corpus" / "python311_stdlib.txt.xz"
CORPUS_BYTES = 2_000_000  # its length, uncompressed


@functools.cache
def _corpus() -> bytes:
    return lzma.decompress(CORPUS.read_bytes())


def stdlib_text(max_bytes: int = CORPUS_BYTES) -> bytes:
    """The built-in text: the first ``max_bytes`` bytes of Python 3.11's standard library.

    The ``.py`` sources of CPython 3.11.7's ``Lib/`` in sorted order (test directories and
    ``site-packages`` left out), 2,000,000 bytes shipped with the package
    (``replicator/models/corpus/``, under the Python Software Foundation License), so that
    every Python reads the same bytes and nothing is downloaded.

    Args:
      max_bytes: how many bytes to return, at most 2,000,000.

    Returns:
      The text as ``bytes``.

    Raises:
      ValueError: if ``max_bytes`` is not between 1 and 2,000,000.

    >>> text = stdlib_text(1000)
    >>> len(text), b"phased-in incompatible language changes" in text
    (1000, True)
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise ValueError(f"stdlib_text: max_bytes must be an int; got {max_bytes!r}.")
    if not 1 <= max_bytes <= CORPUS_BYTES:
        raise ValueError(
            f"stdlib_text: max_bytes={max_bytes}, but the built-in text has {CORPUS_BYTES:,} "
            f"bytes; use 1 <= max_bytes <= {CORPUS_BYTES}."
        )
    return _corpus()[:max_bytes]


def token_batches(
    data: bytes, *, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless random windows of ``data`` as byte tokens, deterministic for a seed.

    Args:
      data: the text.
      batch_size: windows per batch.
      seq_len: tokens per window.
      seed: the seed of the windows' starts.

    Yields:
      ``{"tokens", "targets"}``, int32 ``[batch_size, seq_len]``, targets shifted by one.

    Raises:
      ValueError: at the first ``next``, if ``data`` is shorter than ``seq_len + 1`` bytes.

    >>> batch = next(token_batches(b"hello world", batch_size=2, seq_len=4))
    >>> batch["tokens"].shape, batch["targets"].dtype
    ((2, 4), dtype('int32'))
    """
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
