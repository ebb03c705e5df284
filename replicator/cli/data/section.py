"""The ``data:`` section of a config (`DataConfig`): where your own data is, its format, and the
tokenizer its text goes through."""

from __future__ import annotations

import dataclasses
import os

FORMATS = ("auto", "text", "npy", "npz", "arrayrecord")
# data.tokenizer's suffixes: a Hugging Face tokenizer.json, a SentencePiece model.
TOKENIZER_SUFFIXES = (".json", ".model")


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
