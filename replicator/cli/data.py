"""Your own data for ``replicator train``: local text files and NumPy arrays, no download.

A ``data:`` section names a path; the job reads it once into examples, checks every example
against what the model kind trains on (the shapes and dtypes of a batch of its built-in data),
and serves them with `rp.Batches`: each process reads its part of every global batch
(`InputContext`), every epoch in a new order, and the position is checkpointed, so a resumed
run goes on with the next batch.

- ``gpt``: a text file, or a directory of them (every file whose suffix is in ``extensions``,
  in sorted order), read as bytes: token ids 0-255, the byte-level vocabulary. Or a ``.npy``
  of token ids: 1-D (one stream) or 2-D ``[N, seq_len + 1]`` (windows). A stream is cut into
  ``N = (len - 1) // seq_len`` windows of ``seq_len + 1`` tokens, one after another; each
  example is ``tokens = window[:-1]``, ``targets = window[1:]``.
- ``mlp`` and ``cnn``: a ``.npz`` with arrays ``x`` and ``y``, one row per example, of the
  shapes and dtypes of the kind's built-in batches (``mlp``: ``x [N, 16]`` float, ``y [N, 1]``
  float; ``cnn``: ``x [N, 16, 16, 1]`` float, ``y [N]`` integer labels).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

import numpy as np

FORMATS = ("auto", "text", "npy", "npz")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # A file or directory; None: the model kind's built-in data (stdlib sources, generated).
    path: str | None = None
    format: str = "auto"  # "auto" (from the suffix: .npy, .npz, else text), "text", "npy", "npz"
    extensions: str = ".txt,.md,.py,.rst"  # text directories: the suffixes read
    shuffle: bool = True  # a new order of the examples each epoch
    seed: int = 0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(
                f"DataConfig: format={self.format!r} is not a data format; use one of "
                f"{', '.join(map(repr, FORMATS))}."
            )
        if self.path is not None and not self.path:
            raise ValueError("DataConfig: path must be a file or directory, or null.")


def examples(data: DataConfig, *, kind: str, seq_len: int) -> dict[str, np.ndarray]:
    """The examples under ``data.path`` for model ``kind``, one row each.

    Raises:
      FileNotFoundError: if the path does not exist, or a directory holds no text file.
      ValueError: if the file cannot be read as the format says, or holds too few tokens.
    """
    path = os.path.expanduser(data.path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"data.path={data.path!r}: no such file or directory; give a text file, a "
            f"directory of text files, or a .npy/.npz file."
        )
    fmt = data.format if data.format != "auto" else _format_of(path)
    if fmt == "text":
        if kind != "gpt":
            raise ValueError(
                f"data.path={data.path!r} is text, which only model.kind='gpt' trains on; "
                f"give model.kind={kind!r} a .npz with arrays x and y."
            )
        return windows(np.frombuffer(_read_text(path, data.extensions), np.uint8), seq_len, path)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"data.path={data.path!r} is not a {fmt} file NumPy reads: {e}") from e
    if isinstance(loaded, np.ndarray):
        if kind != "gpt":
            raise ValueError(
                f"data.path={data.path!r} holds one array; model.kind={kind!r} needs a .npz "
                f"with arrays x and y (np.savez(path, x=x, y=y))."
            )
        if loaded.ndim == 2 and loaded.shape[1] == seq_len + 1:
            return {
                "tokens": loaded[:, :-1].astype(np.int32),
                "targets": loaded[:, 1:].astype(np.int32),
            }
        if loaded.ndim != 1:
            raise ValueError(
                f"data.path={data.path!r}: token ids must be 1-D (a stream) or [N, seq_len + 1 = "
                f"{seq_len + 1}] (windows); got shape {loaded.shape}."
            )
        return windows(loaded, seq_len, path)
    with loaded:
        return {name: loaded[name] for name in loaded.files}


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


def check(found: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray], *, path: str,
          global_batch: int, vocab: int | None = None) -> None:  # fmt: skip
    """Refuses examples that are not what the model trains on: the keys, each example's shape
    and dtype kind of ``like`` (a batch of the built-in data), token ids below ``vocab``, and
    at least one global batch."""
    if set(found) != set(like):
        raise ValueError(
            f"data.path={path!r} holds arrays {sorted(found)}; this model trains on {sorted(like)}."
        )
    sizes = {len(a) for a in found.values()}
    if len(sizes) != 1:
        raise ValueError(f"data.path={path!r}: the arrays have different lengths {sorted(sizes)}.")
    for name, a in found.items():
        want = like[name]
        if a.shape[1:] != want.shape[1:] or a.dtype.kind != want.dtype.kind:
            raise ValueError(
                f"data.path={path!r}: {name} has examples of shape {list(a.shape[1:])} and "
                f"dtype {a.dtype}; this model trains on {list(want.shape[1:])} of dtype "
                f"{want.dtype}."
            )
        ids = a.dtype.kind in "iu"
        if vocab is not None and ids and a.size and (a.min() < 0 or a.max() >= vocab):
            raise ValueError(
                f"data.path={path!r}: {name} has ids from {a.min()} to {a.max()}, outside the "
                f"model's vocabulary 0-{vocab - 1}."
            )
    if sizes.pop() < global_batch:
        raise ValueError(
            f"data.path={path!r}: {len(next(iter(found.values())))} examples are fewer than "
            f"one global_batch of {global_batch}; use more data or a smaller global_batch."
        )


def input_fn(found: dict[str, np.ndarray], data: DataConfig, global_batch: int) -> Callable:
    """``input_fn(ctx)`` serving ``found`` as `rp.Batches` (resumable, sharded per process)."""

    import replicator as rp  # configs are read before JAX is imported

    def make(ctx):
        return rp.Batches(found, global_batch, ctx=ctx, shuffle=data.shuffle, seed=data.seed)

    return make


def _format_of(path: str) -> str:
    if os.path.isfile(path) and path.endswith(".npy"):
        return "npy"
    if os.path.isfile(path) and path.endswith(".npz"):
        return "npz"
    return "text"


def _read_text(path: str, extensions: str) -> bytes:
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
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
    chunks = []
    for name in files:
        with open(name, "rb") as f:
            chunks.append(f.read())
    return b"".join(chunks)
