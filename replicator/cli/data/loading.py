"""``data.path`` read into examples for a model kind (`examples`), checked against a batch of its
built-in data (`check`), and served resumably, each process its part (`input_fn`)."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from replicator.cli.data.files import format_of, one_line, read_text, windows
from replicator.cli.data.records import RecordBatches, Records
from replicator.cli.data.tokenizer import Tokenized, encode

if TYPE_CHECKING:
    from replicator.cli.data.section import DataConfig


def examples(data: DataConfig, *, kind: str, seq_len: int) -> dict[str, np.ndarray] | Records:
    """The examples under ``data.path`` for model ``kind``, one row each; for ArrayRecord files,
    `Records` (read by index as batches are served, not here).

    Raises:
      FileNotFoundError: if the path does not exist, or a directory holds no file to read.
      ValueError: if the file cannot be read as the format says, or holds too few tokens.
    """
    if data.tokenizer is not None:
        return encode(data, kind=kind, seq_len=seq_len)
    path = os.path.expanduser(data.path)
    pattern = not os.path.exists(path) and glob.has_magic(path)
    if pattern and data.format in ("auto", "arrayrecord"):
        return Records.open(data, kind=kind, seq_len=seq_len)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"data.path={data.path!r}: no such file or directory; give a text file, a "
            f"directory of text files, a .npy/.npz file, or ArrayRecord files (a file, a "
            f"directory or a glob of shards)."
        )
    fmt = data.format if data.format != "auto" else format_of(path)
    if fmt == "arrayrecord":
        return Records.open(data, kind=kind, seq_len=seq_len)
    if fmt == "text":
        if kind != "gpt":
            raise ValueError(
                f"data.path={data.path!r} is text, which only model.kind='gpt' trains on; "
                f"give model.kind={kind!r} a .npz with arrays x and y."
            )
        return windows(np.frombuffer(read_text(path, data.extensions), np.uint8), seq_len, path)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        write = "np.save(path, ids)" if fmt == "npy" else "np.savez(path, x=x, y=y)"
        why = "not an array file" if "pickled" in str(e) else one_line(e)
        raise ValueError(
            f"data.path={data.path!r} is not a {fmt} file NumPy reads ({why}); write it with "
            f"{write}, or set data.format to the format it has."
        ) from e
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


def check(found: Mapping[str, np.ndarray] | Records, like: Mapping[str, np.ndarray], *,
          path: str, global_batch: int, vocab: int | None = None,
          init_from: str | None = None) -> None:  # fmt: skip
    """Refuses examples that are not what the model trains on: the keys, each example's shape
    and dtype kind of ``like`` (a batch of the built-in data), token ids below ``vocab``, and
    at least one global batch.

    ``init_from`` is the checkpoint ``vocab`` comes from, if any (its advice then differs:
    a checkpoint's vocabulary cannot change).

    `Records` are not read whole: their first and last records are checked here, and every
    record against the same rules as batches read it (`Records.expect`). `Tokenized` examples
    are checked against the tokenizer's whole vocabulary, not only the ids the text gave.
    """
    if isinstance(found, Tokenized) and vocab is not None and found.vocab_size > vocab:
        what = f"data.tokenizer={found.tokenizer!r} has {found.vocab_size} token ids (0-" + (
            f"{found.vocab_size - 1})"
        )
        if init_from is not None:  # the checkpoint's vocabulary is its embedding: fixed
            raise ValueError(
                f"{what}, more than the {vocab} of init_from={init_from!r} (vocab_size in its "
                f"config.json: model.vocab cannot differ); use the tokenizer the checkpoint was "
                f"trained with{_own_tokenizer(init_from, found.tokenizer)}, or a checkpoint "
                f"whose vocab_size is at least {found.vocab_size}."
            )
        raise ValueError(
            f"{what}, more than model.vocab={vocab}; set model.vocab={found.vocab_size} (or "
            f"more), so that the model has an embedding for each."
        )
    if isinstance(found, Records):
        found.expect(like, vocab=vocab)
        with found.source() as source:
            for key in sorted({0, found.size - 1}):
                found.example(source[key], key)
        if found.size < global_batch:
            raise ValueError(
                f"data.path={path!r}: {found.size} records are fewer than one global_batch of "
                f"{global_batch}; use more data or a smaller global_batch."
            )
        return
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
            if a.min() < 0:
                fix = "token ids start at 0: write the data without negative ids"
            elif init_from is not None:
                fix = f"use token ids below {vocab}, the vocab_size of init_from={init_from!r}"
            else:
                fix = f"set model.vocab={int(a.max()) + 1} (or more), or use ids below {vocab}"

            raise ValueError(
                f"data.path={path!r}: {name} has ids from {a.min()} to {a.max()}, outside the "
                f"model's vocabulary 0-{vocab - 1}; {fix}."
            )
    if sizes.pop() < global_batch:
        raise ValueError(
            f"data.path={path!r}: {len(next(iter(found.values())))} examples are fewer than "
            f"one global_batch of {global_batch}; use more data or a smaller global_batch."
        )


def _own_tokenizer(init_from: str, given: str) -> str:
    """`` (data.tokenizer=DIR/tokenizer.json)`` when the checkpoint has a tokenizer that is not
    the one given, else what such a tokenizer must be."""
    for name in ("tokenizer.json", "tokenizer.model"):
        own = os.path.join(init_from, name)
        if os.path.isfile(own) and not os.path.samefile(own, os.path.expanduser(given)):
            return f" (data.tokenizer={own})"
    return " (one of at most its vocab_size ids)"


def input_fn(found: dict[str, np.ndarray] | Records, data: DataConfig,
             global_batch: int) -> Callable:  # fmt: skip
    """``input_fn(ctx)`` serving ``found`` as `rp.Batches`, or `Records` as `RecordBatches`
    (both resumable, sharded per process)."""
    if isinstance(found, Records):
        return lambda ctx: RecordBatches(
            found, global_batch, ctx=ctx, shuffle=data.shuffle, seed=data.seed
        )

    import replicator as rp  # configs are read before JAX is imported

    arrays = dict(found)  # a plain dict (a pytree), also of `Tokenized` examples
    if data.shuffle and not 0 <= data.seed < 2**32:
        raise ValueError(
            f"data.seed={data.seed}: the examples are shuffled with NumPy, whose seeds are 0 to "
            f"2**32 - 1; use a seed in that range (e.g. data.seed=0)."
        )

    def make(ctx):
        return rp.Batches(arrays, global_batch, ctx=ctx, shuffle=data.shuffle, seed=data.seed)

    return make
