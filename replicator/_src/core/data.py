"""The input pipeline: ``InputContext``, per-process batches to global arrays, prefetching."""

from __future__ import annotations

import atexit
import base64
import dataclasses
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from replicator._src.core.typing import PyTree


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What ``input_fn`` needs to know to produce this process's part of each global batch.

    Attributes:
      num_input_pipelines: how many processes run ``input_fn`` (one per process).
      input_pipeline_id: this process's index in ``[0, num_input_pipelines)``; use it to pick
        this process's shard of the data.
      num_replicas_in_sync: the number of replicas over all processes.

    >>> ctx = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)
    >>> ctx.per_replica_batch_size(256)
    32
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica sees, given the global batch size.

        Raises:
          ValueError: if ``global_batch_size`` does not divide by ``num_replicas_in_sync``.
        """
        n = self.num_replicas_in_sync
        if global_batch_size % n:
            raise ValueError(
                f"InputContext.per_replica_batch_size: global batch of {global_batch_size} "
                f"examples does not split over {n} replicas; use a multiple of {n} (e.g. "
                f"{n * max(1, -(-global_batch_size // n))})."
            )
        return global_batch_size // n

    def per_pipeline_batch_size(self, global_batch_size: int) -> int:
        """The part of the global batch this process's ``input_fn`` yields."""
        return self.per_replica_batch_size(global_batch_size) * (
            self.num_replicas_in_sync // self.num_input_pipelines
        )


_OPEN: weakref.WeakSet[DistributedIterator] = weakref.WeakSet()


def _close_open_iterators() -> None:
    for iterator in list(_OPEN):
        iterator.close(timeout=2.0)


def _track(iterator: DistributedIterator) -> None:
    """Closes ``iterator`` at exit, before JAX's own exit handlers (which run last-in first-out
    and were registered when its backend started, before this)."""
    if not _OPEN:
        atexit.unregister(_close_open_iterators)
        atexit.register(_close_open_iterators)
    _OPEN.add(iterator)


class _End:
    """Queued after the last batch."""


@dataclasses.dataclass
class _Failure:
    error: BaseException


class DistributedIterator(Iterator[PyTree]):
    """Iterates ``input_fn``'s batches as global ``jax.Array`` values split over the replicas.

    Made by ``Replicator.distribute``. With ``prefetch > 0`` a background thread pulls from
    ``input_fn``, checks each batch and starts its host-to-device copy, keeping up to
    ``prefetch`` batches ready, so input work overlaps the running step. Errors raised by
    ``input_fn`` or by the checks are re-raised from ``next()`` in the caller's thread.
    """

    def __init__(
        self,
        source: Iterable[PyTree],
        *,
        sharding: NamedSharding,
        num_local_replicas: int,
        prefetch: int,
    ) -> None:
        self._source = iter(source)
        self._stateful = callable(getattr(self._source, "get_state", None))
        self._position = encode_state(self._source.get_state()) if self._stateful else None
        self._sharding = sharding
        self._num_local = num_local_replicas
        self._first: list[tuple[Any, tuple]] | None = None
        self._first_def = None
        self._count = 0
        self._closed = threading.Event()
        self._queue: queue.Queue | None = None
        if prefetch:
            self._queue = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(target=self._fill, daemon=True, name="rp-prefetch")
            self._thread.start()
            _track(self)

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> PyTree:
        if self._queue is None:
            batch, self._position = self._pull()
            return batch
        item = self._queue.get()
        if isinstance(item, _End):
            self._queue.put(item)  # later next() calls end too
            raise StopIteration
        if isinstance(item, _Failure):
            self._queue.put(_End())
            raise item.error
        batch, self._position = item
        return batch

    def get_state(self) -> Any:
        """The input position after the last batch ``next()`` returned.

        Batches prefetched but not yet taken are not counted.

        Returns:
          JSON-able data for ``distribute(..., state=)``; None if ``input_fn``'s iterator has
          no ``get_state`` (then resume with ``skip``).
        """
        return self._position

    def _pull(self) -> tuple[PyTree, Any]:
        """The next batch of the source, placed, and the source's position after it."""
        batch = next(self._source)
        position = encode_state(self._source.get_state()) if self._stateful else None
        return self._place(batch), position

    def close(self, timeout: float = 10.0) -> None:
        """Stops the prefetch thread and waits for it; batches it had prefetched are dropped.

        Called for every open iterator when the interpreter exits, so that the thread is not
        frozen in the middle of a device copy.
        """
        self._closed.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fill(self) -> None:
        try:
            while True:
                try:
                    item = self._pull()
                except StopIteration:
                    break
                if not self._put(item):
                    return
            self._put(_End())
        except BaseException as e:  # handed to the consumer, raised from next()
            self._put(_Failure(e))

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _place(self, batch: PyTree) -> PyTree:
        """Checks one process-local batch and makes it a global array split over replicas."""
        index = self._count
        self._count += 1
        leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
        arrays = []
        for path, leaf in leaves:
            name = jax.tree_util.keystr(path) or "(the batch)"
            if not isinstance(leaf, np.ndarray | jax.Array | np.generic):
                raise TypeError(
                    f"Replicator.distribute: batch {index}, leaf {name} is a "
                    f"{type(leaf).__name__}, not an array. input_fn must yield a pytree of NumPy "
                    f"or JAX arrays whose first axis is the batch; convert lists with np.asarray "
                    f"and keep strings and other metadata out of the batch."
                )
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] % self._num_local:
                b = np.shape(leaf)[0] if np.ndim(leaf) else "no"
                n = self._num_local
                raise ValueError(
                    f"Replicator.distribute: batch {index}, leaf {name} of shape "
                    f"{np.shape(leaf)} has {b} examples on its first axis, which does not split "
                    f"over the {n} replicas of this process. Yield a multiple of {n} examples "
                    f"(compute it with ctx.per_replica_batch_size(global_batch)), and drop or "
                    f"pad a last partial batch."
                )
            arrays.append(np.asarray(leaf))
        signature = [(path, (a.shape, a.dtype)) for (path, _), a in zip(leaves, arrays)]
        if self._first is None:
            self._first, self._first_def = signature, treedef
        else:
            self._check_same(index, signature, treedef)
        return jax.tree.unflatten(
            treedef,
            [jax.make_array_from_process_local_data(self._sharding, a) for a in arrays],
        )

    def _check_same(self, index, signature, treedef) -> None:
        if treedef != self._first_def:
            raise ValueError(
                f"Replicator.distribute: batch {index} has structure {treedef}, but batch 0 had "
                f"{self._first_def}. Every batch must have the same structure (the same keys), "
                f"since each new structure compiles step_fn again."
            )
        for (path, (shape, dtype)), (_, (shape0, dtype0)) in zip(signature, self._first):
            if shape != shape0 or dtype != dtype0:
                raise ValueError(
                    f"Replicator.distribute: batch {index}, leaf {jax.tree_util.keystr(path)} is "
                    f"{dtype}{list(shape)}, but batch 0 had {dtype0}{list(shape0)}. Every batch "
                    f"must keep its shapes and dtypes (each new shape compiles step_fn again): "
                    f"drop or pad a last partial batch."
                )


def make_input_context(num_replicas: int) -> InputContext:
    """The context of this process: one input pipeline per process."""
    return InputContext(
        num_input_pipelines=jax.process_count(),
        input_pipeline_id=jax.process_index(),
        num_replicas_in_sync=num_replicas,
    )


def call_input_fn(input_fn: Callable[[InputContext], Iterable[PyTree]], ctx: InputContext):
    source = input_fn(ctx)
    if not isinstance(source, Iterable):
        raise TypeError(
            f"Replicator.distribute: input_fn must return an iterable of batches (e.g. be a "
            f"generator that yields them); it returned a {type(source).__name__}."
        )
    return source


def encode_state(state: Any) -> Any:
    """An iterator's ``get_state()`` as JSON-able data (grain's DataLoader gives bytes)."""
    if isinstance(state, bytes):
        return {"__bytes__": base64.b64encode(state).decode("ascii")}
    return state


def decode_state(state: Any) -> Any:
    if isinstance(state, dict) and set(state) == {"__bytes__"}:
        return base64.b64decode(state["__bytes__"])
    return state


def resume(source: Iterable[PyTree], state: Any) -> Iterator[PyTree]:
    """``source``'s iterator, moved to ``state`` (from ``DistributedIterator.get_state``)."""
    iterator = iter(source)
    if not callable(getattr(iterator, "set_state", None)):
        raise TypeError(
            f"Replicator.distribute: state= needs an input_fn whose iterator has "
            f"get_state/set_state (rp.Batches, a grain iterator); input_fn gave a "
            f"{type(iterator).__name__}. For a deterministic generator, resume with skip= "
            f"(the number of batches to pass over) instead."
        )
    iterator.set_state(decode_state(state))
    return iterator


class Batches(Iterator[dict]):
    """Deterministic, resumable batches from in-memory arrays, with a checkpointable position.

    Each epoch visits the examples in a new order (a permutation seeded by ``seed`` and the
    epoch) and cuts it into global batches of ``global_batch_size``; this process yields its
    contiguous part of each global batch (``ctx.per_pipeline_batch_size``). The global batches
    are therefore the same for any number of processes, and the position (``get_state()``:
    epoch and batch) is the same on every process. ``rp.fit`` checkpoints it, and a resumed run
    continues with the next batch without replaying the ones before. The last partial batch of
    an epoch is dropped, so that every batch has the same shape.

    Args:
      data: a pytree of arrays with the same first axis (the examples), e.g.
        ``{"x": images, "y": labels}``.
      global_batch_size: examples per step, over all replicas.
      ctx: the ``InputContext`` given to ``input_fn`` (None: one process).
      shuffle: a new order each epoch (False: the stored order).
      seed: the shuffling seed.
      num_epochs: stop after this many epochs (None: never stop).

    >>> import numpy as np
    >>> data = {"x": np.arange(10.0), "y": np.arange(10) % 2}
    >>> it = Batches(data, global_batch_size=4, shuffle=False)
    >>> next(it)["x"].tolist(), it.get_state()
    ([0.0, 1.0, 2.0, 3.0], {'epoch': 0, 'batch': 1})
    >>> later = Batches(data, global_batch_size=4, shuffle=False)
    >>> later.set_state(it.get_state())
    >>> next(later)["x"].tolist()
    [4.0, 5.0, 6.0, 7.0]
    """

    def __init__(
        self,
        data: PyTree,
        global_batch_size: int,
        *,
        ctx: InputContext | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: int | None = None,
    ) -> None:
        leaves = jax.tree.leaves(data)
        if not leaves:
            raise ValueError("rp.Batches: data has no arrays; pass e.g. {'x': x, 'y': y}.")
        sizes = {len(leaf) for leaf in leaves}
        if len(sizes) != 1:
            raise ValueError(
                f"rp.Batches: the arrays of data have different first axes {sorted(sizes)}; "
                f"every leaf needs one row per example."
            )
        (self._size,) = sizes
        ctx = ctx or InputContext()
        self._per = ctx.per_pipeline_batch_size(global_batch_size)
        if global_batch_size > self._size:
            raise ValueError(
                f"rp.Batches: global_batch_size={global_batch_size} is more than the "
                f"{self._size} examples of data; use at most {self._size}."
            )
        self._data = jax.tree.map(np.asarray, data)
        self._global = global_batch_size
        self._offset = ctx.input_pipeline_id * self._per
        self._shuffle, self._seed, self._num_epochs = shuffle, seed, num_epochs
        self._epoch, self._batch = 0, 0
        self._order_epoch, self._order = -1, None

    @property
    def batches_per_epoch(self) -> int:
        """The global batches of one epoch (a last partial batch is dropped)."""
        return self._size // self._global

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict:
        if self._batch >= self.batches_per_epoch:
            self._epoch, self._batch = self._epoch + 1, 0
        if self._num_epochs is not None and self._epoch >= self._num_epochs:
            raise StopIteration
        if self._order_epoch != self._epoch:
            self._order_epoch = self._epoch
            self._order = (
                np.random.default_rng([self._seed, self._epoch]).permutation(self._size)
                if self._shuffle
                else np.arange(self._size)
            )
        start = self._batch * self._global + self._offset
        rows = self._order[start : start + self._per]
        self._batch += 1
        return jax.tree.map(lambda a: a[rows], self._data)

    def get_state(self) -> dict:
        """The position after the last batch returned: ``{"epoch": int, "batch": int}``."""
        return {"epoch": self._epoch, "batch": self._batch}

    def set_state(self, state: dict) -> None:
        """Resumes at a position that `get_state` returned, on any number of processes.

        Raises:
          ValueError: if ``state`` is not ``{"epoch": int, "batch": int}``.
        """
        if not isinstance(state, dict) or set(state) != {"epoch", "batch"}:
            raise ValueError(
                f"rp.Batches.set_state: expected {{'epoch': int, 'batch': int}} from get_state(); "
                f"got {state!r}."
            )
        self._epoch, self._batch = int(state["epoch"]), int(state["batch"])
