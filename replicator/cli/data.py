"""Your own data for ``replicator train``: local text files, NumPy arrays and ArrayRecord files,
no download.

A ``data:`` section names a path; the job reads it once into examples (ArrayRecord files:
record by record, as batches need them), checks every example against what the model kind
trains on (the shapes and dtypes of a batch of its built-in data), and serves them with
`rp.Batches` (ArrayRecord: `RecordBatches`): each process reads its part of every global batch
(`InputContext`), every epoch in a new order, and the position is checkpointed, so a resumed
run goes on with the next batch.

- ``gpt``: a text file, or a directory of them (every file whose suffix is in ``extensions``,
  in sorted order), read as bytes: token ids 0-255, the byte-level vocabulary. With
  ``tokenizer`` (a Hugging Face ``tokenizer.json`` or a SentencePiece ``.model``), each file is
  one document, encoded by the tokenizer, its end-of-document token (EOS) appended; the
  documents are packed one after another into one stream (`encode`). Or a ``.npy``
  of token ids: 1-D (one stream) or 2-D ``[N, seq_len + 1]`` (windows). A stream is cut into
  ``N = (len - 1) // seq_len`` windows of ``seq_len + 1`` tokens, one after another; each
  example is ``tokens = window[:-1]``, ``targets = window[1:]``.
- ``mlp`` and ``cnn``: a ``.npz`` with arrays ``x`` and ``y``, one row per example, of the
  shapes and dtypes of the kind's built-in batches (``mlp``: ``x [N, 16]`` float, ``y [N, 1]``
  float; ``cnn``: ``x [N, 16, 16, 1]`` float, ``y [N]`` integer labels).
- ArrayRecord files (``format: arrayrecord``, or a name ending in ``.array_record``, with or
  without a shard suffix such as ``-00000-of-00008``): a file, a directory of such files, or a
  glob of shards. They are not read into memory: grain reads each batch's records by index
  (`Records`, `RecordBatches`). Each record is one example, as the bytes ``np.save`` writes:
  for ``gpt`` a 1-D integer array of ``seq_len + 1`` token ids (the window), for ``mlp`` and
  ``cnn`` the bytes ``np.savez`` writes of one example's ``x`` and ``y``. Every record is
  checked as it is read.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

FORMATS = ("auto", "text", "npy", "npz", "arrayrecord")
# data.tokenizer's suffixes: a Hugging Face tokenizer.json, a SentencePiece model.
TOKENIZER_SUFFIXES = (".json", ".model")
# The end-of-document tokens looked for in a tokenizer.json that does not say which is its EOS.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
# An ArrayRecord file's name: "train.array_record", or a shard "train.array_record-00003-of-00016".
ARRAY_RECORD_NAME = re.compile(r"\.array_record(-\d+-of-\d+)?$")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # A file, a directory, or a glob of ArrayRecord shards; None: the model kind's built-in
    # data (stdlib sources, generated).
    path: str | None = None
    # "auto" (from the name: .npy, .npz, .array_record, else text), "text", "npy", "npz",
    # "arrayrecord"
    format: str = "auto"
    extensions: str = ".txt,.md,.py,.rst"  # text directories: the suffixes read
    shuffle: bool = True  # a new order of the examples each epoch
    seed: int = 0
    # Text through a tokenizer: a Hugging Face tokenizer.json or a SentencePiece .model; each
    # file one document, its EOS appended. None: the text's bytes are the token ids.
    tokenizer: str | None = None
    # The tokenizer's end-of-document token, e.g. "</s>"; None: the tokenizer's own (the
    # SentencePiece eos_id, the eos_token of a tokenizer_config.json beside the tokenizer.json,
    # or the one of EOS_NAMES it has).
    eos: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(
                f"DataConfig: format={self.format!r} is not a data format; use one of "
                f"{', '.join(map(repr, FORMATS))}."
            )
        if self.path is not None and not self.path:
            raise ValueError(
                "DataConfig: path must be a file, a directory or a glob of ArrayRecord shards, "
                "or null."
            )
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        if self.tokenizer is None:
            if self.eos is not None:
                raise ValueError(
                    f"DataConfig: eos={self.eos!r} names a tokenizer's end-of-document token; "
                    f"set data.tokenizer too, or remove data.eos (bytes have no EOS)."
                )
            return
        if os.path.splitext(self.tokenizer)[1] not in TOKENIZER_SUFFIXES:
            raise ValueError(
                f"DataConfig: tokenizer={self.tokenizer!r} is not a tokenizer file replicator "
                f"reads; give a Hugging Face tokenizer.json (a name ending in .json) or a "
                f"SentencePiece model (.model)."
            )
        if self.path is None:
            raise ValueError(
                f"DataConfig: tokenizer={self.tokenizer!r} encodes the text of data.path, which "
                f"is not set; set data.path to a text file or a directory of them."
            )
        if self.format not in ("auto", "text"):
            raise ValueError(
                f"DataConfig: tokenizer={self.tokenizer!r} encodes text, and data.format="
                f"{self.format!r} holds token ids or arrays already; set data.format=text (or "
                f"auto), or remove data.tokenizer."
            )
        if self.eos is not None and not self.eos:
            raise ValueError(
                "DataConfig: eos must name one of the tokenizer's tokens (e.g. eos='</s>'), or "
                "be null (the tokenizer's own)."
            )


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
    fmt = data.format if data.format != "auto" else _format_of(path)
    if fmt == "arrayrecord":
        return Records.open(data, kind=kind, seq_len=seq_len)
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
        write = "np.save(path, ids)" if fmt == "npy" else "np.savez(path, x=x, y=y)"
        why = "not an array file" if "pickled" in str(e) else _one_line(e)
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


def _format_of(path: str) -> str:
    if os.path.isfile(path) and path.endswith(".npy"):
        return "npy"
    if os.path.isfile(path) and path.endswith(".npz"):
        return "npz"
    if os.path.isfile(path) and ARRAY_RECORD_NAME.search(path):
        return "arrayrecord"
    if os.path.isdir(path) and _array_record_files(path):
        return "arrayrecord"
    return "text"


def _read_text(path: str, extensions: str) -> bytes:
    chunks = []
    for name in _text_files(path, extensions):
        with open(name, "rb") as f:
            chunks.append(f.read())
    return b"".join(chunks)


def _text_files(path: str, extensions: str) -> list[str]:
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


# Text through a tokenizer (data.tokenizer): documents encoded, then packed with EOS after each.

# Files are encoded in groups of about this many characters (a list of documents at a time), so
# that the tokenizer's objects for the tokens of the whole corpus never exist at once.
ENCODE_CHARS = 1 << 24


class Tokenized(dict):
    """The examples (``tokens``, ``targets``) of text encoded by ``data.tokenizer``: a dict
    that also holds the tokenizer's vocabulary size, which `check` holds against the model's."""

    def __init__(self, arrays: Mapping[str, np.ndarray], *, tokenizer: str, vocab_size: int):
        super().__init__(arrays)
        self.tokenizer, self.vocab_size = tokenizer, vocab_size


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """``data.tokenizer``, read: a Hugging Face tokenizer.json or a SentencePiece model.

    Attributes:
      name: ``data.tokenizer`` as the config gave it.
      vocab_size: the token ids are 0 to ``vocab_size - 1``.
      eos: the end-of-document token put after each document; ``eos_id`` its id.
      encode: documents (a list of str) to their ids (lists of int), no special token added.
    """

    name: str
    vocab_size: int
    eos: str
    eos_id: int
    encode: Callable[[list[str]], list[list[int]]]

    @classmethod
    def open(cls, data: DataConfig) -> Tokenizer:
        """``data.tokenizer``, by its suffix: ``.json`` with the ``tokenizers`` package,
        ``.model`` with ``sentencepiece``; its EOS is ``data.eos``, or its own.

        Raises:
          FileNotFoundError: if there is no such file.
          ValueError: if its package is not installed or cannot read it, or no EOS is found.
        """
        path = os.path.expanduser(data.tokenizer)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"data.tokenizer={data.tokenizer!r}: no such file; give a Hugging Face "
                f"tokenizer.json or a SentencePiece .model (to train one on your text first, "
                f"see Tokenizers in docs/guides/llama_and_hf.md)."
            )
        if path.endswith(".model"):
            return _sentencepiece(data, path)
        return _huggingface(data, path)


def encode(data: DataConfig, *, kind: str, seq_len: int) -> Tokenized:
    """The examples of ``data.path``'s text encoded by ``data.tokenizer``.

    Each file is one document, as the byte path reads them (a file, or a directory's files
    ending in ``data.extensions``, sorted). Each document is encoded whole, without the special
    tokens the tokenizer may add (no BOS), then its EOS is appended; empty files are skipped.
    The documents follow one another in one stream, cut into windows as `windows` cuts bytes::

        ids = []
        for text in documents:
            ids += tokenizer.encode(text) + [eos_id]
        examples = windows(ids, seq_len)

    Raises:
      FileNotFoundError: if ``data.path`` or ``data.tokenizer`` does not exist.
      ValueError: if ``kind`` is not ``gpt``, the data is not text, a file is not UTF-8, the
        tokenizer cannot be read or has no EOS, or the stream is shorter than one window.
    """
    if kind != "gpt":
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} encodes text, which only model.kind='gpt' "
            f"trains on; remove data.tokenizer (model.kind={kind!r} trains on a .npz with "
            f"arrays x and y)."
        )
    path = os.path.expanduser(data.path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"data.path={data.path!r}: no such file or directory; give a text file or a "
            f"directory of text files for data.tokenizer to encode."
        )
    fmt = data.format if data.format != "auto" else _format_of(path)
    if fmt != "text":
        raise ValueError(
            f"data.path={data.path!r} is {fmt} data (token ids or arrays), and data.tokenizer "
            f"encodes text; give a text file or directory, or remove data.tokenizer."
        )
    tokenizer = Tokenizer.open(data)
    eos = np.array([tokenizer.eos_id], np.int32)
    files, pieces, group, chars = _text_files(path, data.extensions), [], [], 0
    for i, name in enumerate(files):
        text = _document(data.path, name)
        if text:
            group.append(text)
            chars += len(text)
        if group and (chars >= ENCODE_CHARS or i == len(files) - 1):
            for ids in tokenizer.encode(group):
                pieces += [np.asarray(ids, np.int32), eos]
            group, chars = [], 0
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    examples = windows(stream, seq_len, data.path)
    return Tokenized(examples, tokenizer=data.tokenizer, vocab_size=tokenizer.vocab_size)


def _document(path: str, name: str) -> str:
    with open(name, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data.path={path!r}: {name} is not UTF-8 text ({e.reason} at byte {e.start}), "
            f"which data.tokenizer encodes; convert it to UTF-8, or leave it out of the files "
            f"read (data.extensions)."
        ) from e


def _huggingface(data: DataConfig, path: str) -> Tokenizer:
    try:
        import tokenizers
    except ImportError as e:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} is read with the tokenizers package, which is "
            f"not installed ({e}); pip install tokenizers."
        ) from e
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the package raises Exception itself for what it cannot read
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} is not a tokenizer.json the tokenizers package "
            f"reads ({_one_line(e)}); give the file Tokenizer.save(path) writes."
        ) from e
    vocab = tok.get_vocab(with_added_tokens=True)
    eos, where = data.eos, "data.eos"
    if eos is None:
        eos, where = _configured_eos(path)
    if eos is None:
        found = [name for name in EOS_NAMES if name in vocab]
        if len(found) != 1:
            what = f"several: {', '.join(found)}" if found else f"none of {', '.join(EOS_NAMES)}"
            raise ValueError(
                f"data.tokenizer={data.tokenizer!r} has not one end-of-document token to put "
                f"after each document ({what}); name one of its tokens in data.eos (e.g. "
                f"data.eos={(found or ['<|endoftext|>'])[0]!r}), or train it with one as a "
                f"special token."
            )
        eos = found[0]
    if eos not in vocab:
        added = tok.get_added_tokens_decoder().values()
        special = sorted(t.content for t in added if t.special)
        raise ValueError(
            f"{where}={eos!r} is not a token of data.tokenizer={data.tokenizer!r}; name one of "
            f"its tokens in data.eos{f' (its special tokens: {special})' if special else ''}."
        )
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: no offsets
    return Tokenizer(
        data.tokenizer,
        max(vocab.values()) + 1,
        eos,
        vocab[eos],
        lambda docs: [e.ids for e in batch(docs, add_special_tokens=False)],
    )


def _configured_eos(path: str) -> tuple[str | None, str]:
    """The ``eos_token`` of a ``tokenizer_config.json`` beside the tokenizer.json, if any."""
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    try:
        with open(config) as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None, "data.eos"
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        return eos, f"the eos_token of {config}"
    return None, "data.eos"


def _sentencepiece(data: DataConfig, path: str) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError as e:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} is read with the sentencepiece package, which "
            f"is not installed ({e}); pip install sentencepiece."
        ) from e
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError) as e:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} is not a SentencePiece model sentencepiece "
            f"reads ({_one_line(e)}); give the .model SentencePieceTrainer.train writes."
        ) from e
    size = sp.get_piece_size()
    if data.eos is not None:
        eos_id = sp.piece_to_id(data.eos)
        if sp.id_to_piece(eos_id) != data.eos:  # a piece it does not have: the unknown's id
            controls = [sp.id_to_piece(i) for i in range(size) if sp.is_control(i)]
            raise ValueError(
                f"data.eos={data.eos!r} is not a piece of data.tokenizer={data.tokenizer!r}; "
                f"name one of its pieces in data.eos (its control pieces: {controls[:10]})."
            )
    elif sp.eos_id() < 0:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} is a SentencePiece model without an "
            f"end-of-document piece to put after each document (its eos_id is -1); name one of "
            f"its pieces in data.eos, or train it with eos_id >= 0 (the default, 2)."
        )
    else:
        eos_id = sp.eos_id()
    encode = lambda docs: sp.encode(docs, out_type=int)
    return Tokenizer(data.tokenizer, size, sp.id_to_piece(eos_id), eos_id, encode)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


@dataclasses.dataclass(frozen=True)
class _Shard:
    """One file's records, as array_record's ``FileInstruction`` (its record count known, so
    that the data source does not open every file again to count them)."""

    filename: str
    skip: int
    take: int
    examples_in_shard: int


class Records:
    """ArrayRecord files as examples for model ``kind``, read by index, never whole.

    Each record is one example: for ``gpt`` the bytes ``np.save`` writes of a 1-D integer array
    of ``seq_len + 1`` token ids (a window; ``tokens = window[:-1]``, ``targets =
    window[1:]``), for other kinds the bytes ``np.savez`` writes of one example's arrays
    (``x`` and ``y``). `example` decodes one record and checks it; after `expect`, against the
    keys, shapes, dtype kinds and vocabulary of the model's batches too.

    Attributes:
      path: ``data.path`` as the config gave it (named in messages).
      files: the ArrayRecord files, in the order of their records.
      size: the number of records in all files.
    """

    def __init__(
        self, path: str, files: Sequence[str], counts: Sequence[int], *, kind: str, seq_len: int
    ) -> None:
        self.path, self.files, self._counts = path, list(files), list(counts)
        self._ends = list(np.cumsum(self._counts, dtype=np.int64).tolist())
        self.size = self._ends[-1] if self._ends else 0
        self.kind, self.seq_len = kind, seq_len
        self._like: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._vocab: int | None = None

    @classmethod
    def open(cls, data: DataConfig, *, kind: str, seq_len: int) -> Records:
        """The ArrayRecord files of ``data.path``: a file, a directory (its files named
        ``*.array_record`` or ``*.array_record-NNNNN-of-NNNNN``, sorted) or a glob (its files,
        sorted). Only each file's index is read, to count its records.

        Raises:
          FileNotFoundError: if there is no such file, or no file in the directory or glob.
          ValueError: if grain is not installed, or a file is empty or not an ArrayRecord file,
            or the files hold no record, or ``data.seed`` is not a grain seed.
        """
        _grain(data.path)
        _check_seed(data.seed, data.shuffle)
        files = _record_paths(data.path)
        counts = [_num_records(data.path, f) for f in files]
        if not sum(counts):
            raise ValueError(
                f"data.path={data.path!r}: the ArrayRecord file{'s' if len(files) > 1 else ''} "
                f"{', '.join(files)} hold{'' if len(files) > 1 else 's'} no record; write at "
                f"least one global_batch of examples into {'them' if len(files) > 1 else 'it'}."
            )
        return cls(data.path, files, counts, kind=kind, seq_len=seq_len)

    def source(self) -> Any:
        """A grain ``ArrayRecordDataSource`` of the records (key ``i`` is record ``i`` over all
        files); a context manager that closes its readers."""
        grain = _grain(self.path)
        shards = [_Shard(f, 0, n, n) for f, n in zip(self.files, self._counts) if n]
        return grain.sources.ArrayRecordDataSource(shards)

    def expect(self, like: Mapping[str, np.ndarray], *, vocab: int | None = None) -> None:
        """From now on, `example` also checks each record against ``like`` (a batch of the
        model's built-in data: its keys, each example's shape and dtype kind) and integer ids
        against ``vocab``, and casts it to ``like``'s dtypes."""
        self._like = {name: (np.shape(a)[1:], np.asarray(a).dtype) for name, a in like.items()}
        self._vocab = vocab

    def example(self, record: bytes, key: int) -> dict[str, np.ndarray]:
        """Record ``key`` (its bytes ``record``) as one example, checked.

        Raises:
          ValueError: naming ``data.path``, the file and the record, if it is not ``np.save``
            or ``np.savez`` bytes, or not an example of the model (see `Records`).
        """
        try:
            loaded = np.load(io.BytesIO(record), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(
                f"{self._where(key)} is not the bytes np.save or np.savez writes ({e}); write "
                f"each example as np.save (gpt: one window of seq_len + 1 token ids) or "
                f"np.savez (x and y) to an io.BytesIO, and its getvalue() as the record."
            ) from e
        if isinstance(loaded, np.ndarray):
            arrays: np.ndarray | dict[str, np.ndarray] = loaded
        else:
            with loaded:
                arrays = {name: loaded[name] for name in loaded.files}
        found = self._window(arrays, key) if self.kind == "gpt" else self._arrays(arrays, key)
        if self._like is None:
            return found
        if set(found) != set(self._like):
            raise ValueError(
                f"{self._where(key)} holds arrays {sorted(found)}; this model trains on "
                f"{sorted(self._like)}."
            )
        out = {}
        for name, a in found.items():
            shape, dtype = self._like[name]
            if a.shape != shape or _kind(a.dtype) != _kind(dtype):
                raise ValueError(
                    f"{self._where(key)}: {name} has shape {list(a.shape)} and dtype {a.dtype}; "
                    f"this model trains on examples of shape {list(shape)} and dtype {dtype}."
                )
            vocab = self._vocab
            if vocab is not None and a.dtype.kind in "iu" and a.size:
                if a.min() < 0 or a.max() >= vocab:
                    raise ValueError(
                        f"{self._where(key)}: {name} has ids from {a.min()} to {a.max()}, "
                        f"outside the model's vocabulary 0-{vocab - 1}; use ids from 0 to "
                        f"{vocab - 1} (or a larger model.vocab, without init_from)."
                    )
            out[name] = a.astype(dtype, copy=False)
        return out

    def _window(self, arrays: np.ndarray | dict, key: int) -> dict[str, np.ndarray]:
        n = self.seq_len + 1
        if not isinstance(arrays, np.ndarray):
            raise ValueError(
                f"{self._where(key)} holds arrays {sorted(arrays)}; model.kind='gpt' trains on "
                f"records of seq_len + 1 = {n} token ids, each the bytes np.save writes of a 1-D "
                f"integer array."
            )
        if arrays.ndim != 1 or arrays.dtype.kind not in "iu":
            raise ValueError(
                f"{self._where(key)} holds a {arrays.dtype} array of shape {list(arrays.shape)}; "
                f"model.kind='gpt' trains on 1-D integer arrays of seq_len + 1 = {n} token ids."
            )
        if len(arrays) != n:
            fix = f", or set model.seq_len={len(arrays) - 1}" if len(arrays) > 1 else ""
            raise ValueError(
                f"{self._where(key)} holds {len(arrays)} token ids; model.seq_len="
                f"{self.seq_len} trains on windows of seq_len + 1 = {n}: write windows of {n} "
                f"ids{fix}."
            )
        if self._like is None:
            return {"tokens": arrays[:-1].astype(np.int32), "targets": arrays[1:].astype(np.int32)}
        return {"tokens": arrays[:-1], "targets": arrays[1:]}  # checked, then cast

    def _arrays(self, arrays: np.ndarray | dict, key: int) -> dict[str, np.ndarray]:
        if isinstance(arrays, np.ndarray):
            raise ValueError(
                f"{self._where(key)} holds one array; model.kind={self.kind!r} trains on "
                f"records of one example's x and y, each the bytes np.savez writes "
                f"(np.savez(buffer, x=x, y=y))."
            )
        return arrays

    def _where(self, key: int) -> str:
        i = bisect.bisect_right(self._ends, key)
        start = self._ends[i] - self._counts[i]
        return f"data.path={self.path!r}: record {key - start} of {self.files[i]}"


class RecordBatches(Iterator[dict]):
    """Deterministic, resumable batches of `Records`, read by index with grain.

    The rules of `rp.Batches`: each epoch visits the records in a new order (grain's index
    shuffle, seeded by ``seed`` and the epoch; no table of the order is kept) and cuts it into
    global batches of ``global_batch_size``, dropping the last partial one. This process reads
    and yields only its contiguous part of each global batch (``ctx.per_pipeline_batch_size``
    records), so the global batches are the same for any number of processes. Batches are read
    ahead by grain's threads. The position (``get_state()``: ``{"next_index": batches taken}``,
    grain's) is the same on every process; ``rp.fit`` checkpoints it, and a resumed run goes on
    with the next batch.

    Equivalent to::

        for step in itertools.count():
            epoch, b = divmod(step, records.size // global_batch_size)
            keys = [order(epoch)[b * global_batch_size + offset + j] for j in range(per)]
            yield stack([records.example(source[k], k) for k in keys])

    Args:
      records: the `Records` to serve.
      global_batch_size: examples per step, over all replicas.
      ctx: the ``InputContext`` given to ``input_fn`` (None: one process).
      shuffle: a new order each epoch (False: the stored order).
      seed: the shuffling seed, 0 to 2**32 - 1.
      read_ahead: batches grain reads ahead, each in a thread of its own.

    Raises:
      ValueError: if ``global_batch_size`` is more than the records or does not split over
        ``ctx``'s replicas.
    """

    def __init__(
        self,
        records: Records,
        global_batch_size: int,
        *,
        ctx: Any = None,
        shuffle: bool = True,
        seed: int = 0,
        read_ahead: int = 4,
    ) -> None:
        import replicator as rp  # configs are read before JAX is imported

        grain = _grain(records.path)
        _check_seed(seed, shuffle)
        ctx = ctx or rp.InputContext()
        self._per = ctx.per_pipeline_batch_size(global_batch_size)
        if global_batch_size > records.size:
            raise ValueError(
                f"data.path={records.path!r}: {records.size} records are fewer than one "
                f"global_batch of {global_batch_size}; use more data or a smaller global_batch."
            )
        self._records, self._global = records, global_batch_size
        self._offset = ctx.input_pipeline_id * self._per
        order = grain.MapDataset.range(records.size)
        self._order = order.shuffle(seed=seed) if shuffle else order
        self._source = records.source()
        steps = grain.MapDataset.range(sys.maxsize).map(self._read)
        options = grain.ReadOptions(num_threads=read_ahead, prefetch_buffer_size=read_ahead)
        self._iterator = iter(steps.to_iter_dataset(options))

    @property
    def batches_per_epoch(self) -> int:
        return self._records.size // self._global

    def keys(self, step: int) -> list[int]:
        """The records this process reads for global batch ``step`` (counted from 0)."""
        epoch, batch = divmod(step, self.batches_per_epoch)
        start = epoch * self._records.size + batch * self._global + self._offset
        return [int(self._order[start + j]) for j in range(self._per)]

    def _read(self, step: int) -> dict[str, np.ndarray]:
        keys = self.keys(step)
        found = [self._records.example(r, k) for r, k in zip(self._source.__getitems__(keys), keys)]
        return {name: np.stack([e[name] for e in found]) for name in found[0]}

    def __iter__(self) -> RecordBatches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict:
        return dict(self._iterator.get_state())

    def set_state(self, state: dict) -> None:
        if (
            not isinstance(state, dict)
            or set(state) != {"next_index"}
            or not isinstance(state["next_index"], int)
            or state["next_index"] < 0
        ):
            raise ValueError(
                f"data.path={self._records.path!r}: the input position {state!r} is not one of "
                f"ArrayRecord batches ({{'next_index': int}}, from get_state()); it was saved "
                f"with another data: section. Resume with the data: section the run started "
                f"with, or start the run in a new out_dir."
            )
        self._iterator.set_state(dict(state))

    def close(self) -> None:
        """Stops grain's read-ahead threads."""
        self._iterator.close()


def _grain(path: str | None) -> Any:
    try:
        import grain
        from array_record.python import array_record_module  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"data.format='arrayrecord' (data.path={path!r}) is read with grain, which is not "
            f'installed ({e}); pip install "replicator[grain]", or give a .npy/.npz file.'
        ) from e
    return grain


def _kind(dtype: np.dtype) -> str:
    """A dtype's kind, integers signed or not alike (token ids may be stored as uint16)."""
    return "i" if dtype.kind in "iu" else dtype.kind


def _check_seed(seed: int, shuffle: bool) -> None:
    if shuffle and not 0 <= seed < 2**32:
        raise ValueError(
            f"data.seed={seed}: ArrayRecord data is shuffled by grain, whose seeds are 0 to "
            f"2**32 - 1; use a seed in that range."
        )


def _array_record_files(directory: str) -> list[str]:
    names = sorted(n for n in os.listdir(directory) if ARRAY_RECORD_NAME.search(n))
    return [f for f in (os.path.join(directory, n) for n in names) if os.path.isfile(f)]


def _record_paths(path: str) -> list[str]:
    """The ArrayRecord files of ``data.path``: the file, the directory's or the glob's."""
    full = os.path.expanduser(path)
    if os.path.isfile(full):
        return [full]
    if os.path.isdir(full):
        files = _array_record_files(full)
        if not files:
            raise FileNotFoundError(
                f"data.path={path!r} is a directory with no ArrayRecord file (a name ending in "
                f".array_record, or a shard such as train.array_record-00000-of-00008); name "
                f"the files so, or give a glob of them (e.g. data.path={path.rstrip('/')}/*)."
            )
        return files
    files = sorted(f for f in glob.glob(full) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(
            f"data.path={path!r}: no file matches; give an ArrayRecord file, a directory of "
            f"them, or a glob of shards (e.g. data/train.array_record-*)."
        )
    return files


def _num_records(path: str, file: str) -> int:
    from array_record.python.array_record_module import ArrayRecordReader

    if os.path.getsize(file) == 0:
        raise ValueError(
            f"data.path={path!r}: {file} is empty (0 bytes); write records into it with "
            f"ArrayRecordWriter, or leave it out of data.path."
        )
    try:
        reader = ArrayRecordReader(file)
        try:
            return reader.num_records()
        finally:
            reader.close()
    except RuntimeError as e:
        raise ValueError(
            f"data.path={path!r}: {file} is not an ArrayRecord file ({e}); write it with "
            f"array_record's ArrayRecordWriter, or set data.format to the format it has."
        ) from e
