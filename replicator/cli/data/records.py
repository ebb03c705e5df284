"""ArrayRecord files as examples, never read whole: `Records` reads and checks one record at a
time, by index, and `RecordBatches` serves them with grain, deterministic and resumable."""

from __future__ import annotations

import bisect
import dataclasses
import glob
import io
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from replicator.cli.data.section import DataConfig

# An ArrayRecord file's name: "train.array_record", or a shard "train.array_record-00003-of-00016".
ARRAY_RECORD_NAME = re.compile(r"\.array_record(-\d+-of-\d+)?$")


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


def array_record_files(directory: str) -> list[str]:
    names = sorted(n for n in os.listdir(directory) if ARRAY_RECORD_NAME.search(n))
    return [f for f in (os.path.join(directory, n) for n in names) if os.path.isfile(f)]


def _record_paths(path: str) -> list[str]:
    """The ArrayRecord files of ``data.path``: the file, the directory's or the glob's."""
    full = os.path.expanduser(path)
    if os.path.isfile(full):
        return [full]
    if os.path.isdir(full):
        files = array_record_files(full)
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
