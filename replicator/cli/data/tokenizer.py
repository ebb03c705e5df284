"""Text through a tokenizer (``data.tokenizer``): a Hugging Face tokenizer.json or a
SentencePiece model read as a `Tokenizer`, and each document encoded, then packed with its EOS
after it (`encode`)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from replicator.cli.data.files import format_of, one_line, text_files, windows

if TYPE_CHECKING:
    from replicator.cli.data.section import DataConfig

# The end-of-document tokens looked for in a tokenizer.json that does not say which is its EOS.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")

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
    fmt = data.format if data.format != "auto" else format_of(path)
    if fmt != "text":
        raise ValueError(
            f"data.path={data.path!r} is {fmt} data (token ids or arrays), and data.tokenizer "
            f"encodes text; give a text file or directory, or remove data.tokenizer."
        )
    tokenizer = Tokenizer.open(data)
    eos = np.array([tokenizer.eos_id], np.int32)
    files, pieces, group, chars = text_files(path, data.extensions), [], [], 0
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


def _package(name: str, data: DataConfig):
    """The package ``name`` that reads ``data.tokenizer``, or a refusal that says to install
    it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} is read with the {name} package, which is not "
            f"installed ({e}); pip install {name}."
        ) from e


def _huggingface(data: DataConfig, path: str) -> Tokenizer:
    tokenizers = _package("tokenizers", data)
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the package raises Exception itself for what it cannot read
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} is not a tokenizer.json the tokenizers package "
            f"reads ({one_line(e)}); give the file Tokenizer.save(path) writes."
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
    sentencepiece = _package("sentencepiece", data)
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError) as e:
        raise ValueError(
            f"data.tokenizer={data.tokenizer!r} is not a SentencePiece model sentencepiece "
            f"reads ({one_line(e)}); give the .model SentencePieceTrainer.train writes."
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
