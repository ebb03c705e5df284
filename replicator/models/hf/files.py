"""The ``*.safetensors`` files of a checkpoint, read: their tensors (from the headers, checked),
and the rows of a tensor that blocks of it need, in few large positioned reads."""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Iterator
from typing import NamedTuple

import ml_dtypes
import numpy as np

from replicator.models.hf import checks

DTYPES = {  # the safetensors dtypes read and written
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class Tensor(NamedTuple):
    file: pathlib.Path
    code: str  # the safetensors dtype, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the file

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.code]


def tensors(directory: pathlib.Path, api: str = "hf.load") -> dict[str, Tensor]:
    """Every tensor of the checkpoint in ``directory``: the files its index names, else every
    ``*.safetensors`` file there; each file's header checked (`checks.read_header`), and
    each tensor in one file only (the one the index names)."""
    index = directory / "model.safetensors.index.json"
    weights = checks.read_index(index, api) if index.is_file() else None
    if weights is not None:
        files = sorted(set(weights.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{api}: {directory} holds no *.safetensors file; save the model with "
            f"save_pretrained (safetensors is its default) or with hf.save."
        )
    tensors: dict[str, Tensor] = {}
    for name in files:
        for tensor, found in checks.read_header(directory / name, api).items():
            if tensor in tensors:
                raise checks.duplicate(tensor, tensors[tensor].file, directory / name, api)
            tensors[tensor] = Tensor(directory / name, *found)
    if weights is not None:
        checks.check_index(weights, tensors, index, api)
    return tensors


CHUNK_BYTES = 64 * 2**20  # the most bytes one read brings in; a longer span is read in pieces


def pread_into(fd: int, offset: int, buffer: memoryview) -> None:
    """Fills ``buffer`` with the file's bytes from ``offset``: every read `load` makes."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise EOFError(f"hf.load: a safetensors file ends before byte {offset + len(buffer)}.")
        done += n


Box = tuple[tuple[int, int], ...]  # a block: a (start, stop) per dimension


def _intervals(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (``(start, stop)`` pairs) merged where they overlap or touch, in order.

    >>> _intervals([(4, 6), (0, 2), (1, 3), (3, 4), (8, 9)])
    [(0, 6), (8, 9)]
    """
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[0] < r[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _span(boxes: list[Box], first: int, last: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """The elements, counted from row ``first``'s first one, from the first to the last that
    ``boxes`` hold in rows ``first`` to ``last`` (excluded) of a tensor of ``shape``: the one
    contiguous run of bytes a read of those rows needs.

    >>> _span([((0, 4), (2, 3)), ((1, 2), (0, 1))], 1, 3, (4, 5))  # rows 1-2: 1,0 to 2,2
    (0, 8)
    """
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    lo, hi = math.inf, 0
    for box in boxes:
        a, z = max(box[0][0], first), min(box[0][1], last)
        if a >= z:
            continue
        inner = list(zip(box[1:], strides[1:]))
        lo = min(lo, (a - first) * strides[0] + sum(s * k for (s, _), k in inner))
        hi = max(hi, (z - 1 - first) * strides[0] + sum((e - 1) * k for (_, e), k in inner) + 1)
    return int(lo), hi


class Reader:
    """Reads the rows of the checkpoint's tensors that blocks need with positioned reads (no
    mapping of whole files, so the host's memory holds only what was asked for)."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors
        self._fds: dict[pathlib.Path, int] = {}
        self._buffer = np.empty(0, np.uint8)  # the pieces', reused: no page faults for each

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffer = np.empty(0, np.uint8)

    def _piece(self, size: int, dtype: np.dtype) -> np.ndarray:
        """``size`` elements of ``dtype`` in the reused buffer (grown to the largest piece)."""
        if self._buffer.nbytes < size * dtype.itemsize:
            self._buffer = np.empty(size * dtype.itemsize, np.uint8)
        return self._buffer[: size * dtype.itemsize].view(dtype)

    def rows(self, name: str, boxes: list[Box]) -> Iterator[tuple[int, np.ndarray]]:
        """Tensor ``name``'s rows (indices on its first dimension) that ``boxes`` (non-empty
        blocks of it) hold, as ``(first row, rows)`` pieces of at most `CHUNK_BYTES` (or one
        row), in order. A piece is one read: the bytes from the first element a box holds in
        its rows to the last (its other elements are left unread). So each byte is read at
        most once, and none outside the rows the boxes touch. A piece is valid until the next
        one is asked for (they share one buffer)."""
        t = self.tensors[name]
        if t.file not in self._fds:
            self._fds[t.file] = os.open(t.file, os.O_RDONLY)
        width = math.prod(t.shape[1:])  # elements in a row
        per = max(1, CHUNK_BYTES // max(1, width * t.dtype.itemsize))
        for start, stop in _intervals([box[0] for box in boxes]):
            for first in range(start, stop, per):
                last = min(stop, first + per)
                lo, hi = _span(boxes, first, last, t.shape)
                piece = self._piece((last - first) * width, t.dtype)
                offset = t.offset + (first * width + lo) * t.dtype.itemsize
                try:
                    pread_into(self._fds[t.file], offset, memoryview(piece[lo:hi].view(np.uint8)))
                except EOFError:  # cut short since its header was read
                    raise ValueError(
                        f"hf.load: {t.file} is truncated: it ends inside tensor {name!r}; "
                        f"{checks.AGAIN}."
                    ) from None
                yield first, piece.reshape(last - first, *t.shape[1:])
