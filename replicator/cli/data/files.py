"""The local files ``data.path`` names: their format, a directory's text files, and a token
stream cut into windows (next-token examples)."""

from __future__ import annotations

import os

import numpy as np

from replicator.cli.data.records import ARRAY_RECORD_NAME, array_record_files


def windows(tokens: np.ndarray, seq_len: int, path: str) -> dict[str, np.ndarray]:
    """A token stream cut into consecutive windows of ``seq_len + 1``: next-token examples."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"data.path={path!r}: {len(tokens)} tokens are fewer than seq_len + 1 = "
            f"{seq_len + 1}, one example; use more text or a smaller model.seq_len."
        )
    index = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    window = np.asarray(tokens)[index].astype(np.int32)
    return {"tokens": window[:, :-1], "targets": window[:, 1:]}


def format_of(path: str) -> str:
    if os.path.isfile(path) and path.endswith(".npy"):
        return "npy"
    if os.path.isfile(path) and path.endswith(".npz"):
        return "npz"
    if os.path.isfile(path) and ARRAY_RECORD_NAME.search(path):
        return "arrayrecord"
    if os.path.isdir(path) and array_record_files(path):
        return "arrayrecord"
    return "text"


def read_text(path: str, extensions: str) -> bytes:
    chunks = []
    for name in text_files(path, extensions):
        with open(name, "rb") as f:
            chunks.append(f.read())
    return b"".join(chunks)


def text_files(path: str, extensions: str) -> list[str]:
    """The text files of ``path``: the file, or the directory's files ending in one of
    ``extensions`` (recursively, sorted; hidden directories skipped). Each is one document."""
    if os.path.isfile(path):
        return [path]
    suffixes = tuple(s.strip() for s in extensions.split(",") if s.strip())
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(suffixes)]
    if not files:
        raise FileNotFoundError(
            f"data.path={path!r} is a directory with no file ending in {', '.join(suffixes)}; "
            f"set data.extensions (e.g. data.extensions=.txt,.json) or give a file."
        )
    return files


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
