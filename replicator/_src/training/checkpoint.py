"""Checkpoints of the whole training state, with orbax-checkpoint.

A checkpoint is one step directory holding the state pytree (parameters, optimizer state, ZeRO
shards, loss scale, ...) and a small JSON record (the step, the input iterator's position, and
anything else the caller adds). orbax writes each step into a temporary directory and renames it
when complete, so a save interrupted midway is never taken for a checkpoint. `restore` reads the
newest step it can; if that one is unreadable it says so and falls back to the one before, and
once an older step restores, the unreadable newer ones are moved aside (renamed
``<step>.broken-<time>``, never deleted) so that the run can save those steps again.
Restoring takes a ``like`` tree whose shardings say where each array goes. Every array is saved
as the global array it is, in its own shape (ZeRO splits a leaf's axes without flattening or
padding it, a ZeRO-3 `ShardedParam` is saved as the parameter it stores, and ZeRO's rows of
packed stages as their logical rows, `core.logical`), so a checkpoint is the same on every
mesh: one saved on ``{"data": 2, "stage": 2, "model": 2}`` restores onto ``{"data": 8}`` and
the reverse, under any ZeRO stage, 0 included (`zero_stages`; only the target's shardings
count). A checkpoint in ZeRO's earlier flat layout is converted on restore (`flat_layout`,
`split_rows_layout`). A target
sharding that does not divide a leaf is refused before any step is read (a ValueError naming
the leaf), not taken for a broken checkpoint.
Anything else that differs (a leaf added or removed, another shape or dtype) is the caller's
state having changed, not a broken checkpoint: `StateMismatchError`, with no fallback.
A save that fails for lack of space is one `CheckpointWriteError` (`full_disk`), its partial
directory removed and the complete steps untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from typing import Any

import jax
import numpy as np

from replicator._src.core import errors, logical
from replicator._src.core.mesh import replicated_sharding
from replicator._src.core.sharded_params import ShardedParam, is_sharded_param, values
from replicator._src.core.typing import PyTree
from replicator._src.training import (
    flat_layout,
    full_disk,
    restore_checks,
    split_rows_layout,
    zero_stages,
)
from replicator._src.training.restore_checks import StateMismatchError, check_divides, check_dtype
from replicator._src.training.zero_stages import orbax_name as _name


class NoReadableCheckpointError(FileNotFoundError):
    """No step of the directory restores; ``unreadable`` holds each ``(step, exception)``."""

    def __init__(self, message: str, unreadable: list[tuple[int, Exception]]) -> None:
        super().__init__(message)
        self.unreadable = unreadable


STRUCTURE = """\
rp.Checkpoints.restore: checkpoint step {step} in {directory} was saved from another state \
structure than the state to restore into (`like`): {counts}. The checkpoint is fine; the state \
changed, and the older checkpoints of this run have the same structure, so none is tried.
{lists}
Restore into the structure that was saved, then add (or drop) the leaves:

    state, record = ckpt.restore(old_like)         # like, built as the run that saved it did
    state = {{**state, "ema": state["params"]}}      # e.g. add an EMA of the parameters

or start the new structure in a new checkpoint_dir (a new run directory)."""


class Checkpoints:
    """The checkpoints of one run, in ``directory``, keeping the newest ``keep``.

    Args:
      directory: the run's checkpoint directory, created if need be.
      keep: how many of the newest checkpoints to keep.
      async_save: ``save`` returns once the arrays are copied off the devices, and orbax
        writes the files in a background thread while training goes on. A step is still
        complete or absent (written to a temporary directory, renamed when done); ``steps``,
        ``restore``, the next ``save`` and ``close`` wait for a write and raise its error.

    Raises:
      ValueError: if ``keep`` is not an int >= 1.
      TypeError: if ``async_save`` is not a bool.

    >>> import tempfile, jax.numpy as jnp, replicator as rp
    >>> ckpt = rp.Checkpoints(tempfile.mkdtemp(), keep=2)
    >>> for step in (10, 20, 30):
    ...     ckpt.save(step, {"w": jnp.full(3, float(step))}, data_position=step * 4)
    >>> ckpt.steps()
    [20, 30]
    >>> state, record = ckpt.restore({"w": jnp.zeros(3)})
    >>> state["w"].tolist(), record["step"], record["data_position"]
    ([30.0, 30.0, 30.0], 30, 120)
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = False
    ) -> None:
        import orbax.checkpoint as ocp

        errors.positive_int(keep, api="rp.Checkpoints", name="keep")
        if not isinstance(async_save, bool):
            raise TypeError(
                f"rp.Checkpoints: async_save must be True or False; got {async_save!r}."
            )
        self.async_save, self.keep = async_save, keep
        self._writing: int | None = None  # the step of an asynchronous save in progress
        self._failed: int | None = None  # the step of a save that found the disk full
        self._ocp = ocp
        full_disk.quiet_failed_writes()
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, cleanup_tmp_directories=True
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "record": ocp.JsonCheckpointHandler(),
            },
        )

    def steps(self) -> list[int]:
        """The steps saved and complete, oldest first (after a write in progress ends)."""
        self.wait()
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Waits for an asynchronous save in progress to be written.

        Raises:
          CheckpointWriteError: if the disk is full; any other error of the write, as it is.
        """
        step, self._writing = self._writing, None
        with self._out_of_space(step):
            self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        """The newest complete step, or None without one (after a write in progress ends)."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: PyTree, **record: Any) -> None:
        """Saves ``state`` and a JSON record as checkpoint ``step``; drops the oldest over ``keep``.

        Args:
          step: the step number.
          state: a pytree of arrays (a `ShardedParam` is saved as the parameter it stores).
          **record: JSON-able values saved beside ``step`` in the record, such as
            ``data_position``.

        Raises:
          ValueError: before anything is written, if a leaf of ``state`` was donated to
            ``repl.run`` (its buffer is deleted): save the state that ``run`` returned.
          CheckpointWriteError: (an OSError) if the filesystem is full or over quota: the
            partial step is removed, the complete ones are kept, and the message says what
            to do. With ``async_save``, raised by ``wait`` (or the next ``save``, ``close``).
        """
        ocp = self._ocp
        _check_alive(state)
        state = values(state)  # a ZeRO-3 ShardedParam is saved as the parameter it stores
        state = logical.saved(state)  # and ZeRO's packed stages as their logical rows
        record = {"step": int(step), **record}
        self.wait()  # the save in progress (orbax's save would wait for it too): its error
        with self._out_of_space(int(step)):
            self._manager.save(
                int(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)
                ),
                force=True,
            )
        self._writing = int(step)
        if not self.async_save:
            self.wait()

    def restore(
        self, like: PyTree, step: int | None = None, *, cast: bool = False
    ) -> tuple[PyTree, dict]:
        """``(state, record)`` of checkpoint ``step`` (default: the newest readable one).

        Without ``step``, an unreadable step (a corrupt or truncated file, an empty step
        directory) is reported in a warning naming the exception, and the step before is tried.
        Once one restores, the unreadable newer steps are moved aside: renamed to
        ``<step>.broken-<time>`` in ``directory`` (never deleted), so that the run can save
        those step numbers again.

        Args:
          like: a tree with the state's structure whose leaves are arrays or
            ``jax.ShapeDtypeStruct`` values; their shardings say where the restored arrays go
            (another mesh than the one that saved them is fine).
          step: a specific step; then no fallback, and nothing is moved.
          cast: restore a leaf saved in another dtype by casting it to ``like``'s dtype
            (e.g. an fp32 checkpoint into a bf16 state); without it that is an error.

        Returns:
          ``(state, record)``: the state, placed as ``like`` says, and the saved record.

        Raises:
          FileNotFoundError: if there is no readable checkpoint (then nothing is moved: when
            no step restores, ``like`` may be what is wrong; ``rp.fit``'s
            ``start_over_if_unreadable=True`` moves them aside and starts over).
          StateMismatchError: (a ValueError) if ``like`` has leaves the checkpoint does not
            (or lacks some it has), or a leaf of another dtype or shape (a leaf in ZeRO's earlier
            flat layout is converted to its own shape instead). Raised for the newest readable
            step: older steps of the run have the same structure, so none is tried.
          ValueError: before any step is read, if a leaf's sharding in ``like`` splits a
            dimension into parts that do not divide it (e.g. a ``jax.ShapeDtypeStruct`` of a
            checkpoint's leaf with a spec of the old mesh's axes and the new mesh's sizes).
        """
        self.wait()  # an asynchronous save in progress completes first
        abstract = jax.tree.map(_abstract, logical.saved_like(values(like)))
        check_divides(abstract)
        nodes = split_rows_layout.nodes_by_name(values(like))  # leaves a logical node holds
        candidates = [step] if step is not None else self.steps()[::-1]
        if not candidates:
            raise FileNotFoundError(
                f"rp.Checkpoints: no checkpoint in {self.directory}; save one first "
                f"(ckpt.save(step, state)), or restore from the run's own checkpoint directory."
            )
        broken = []  # (step, exception) of the newer steps that failed to restore
        for s in candidates:
            try:
                restored = self._restore(s, abstract, cast=cast, nodes=nodes)
            except StateMismatchError as e:
                e.directory = self.directory
                raise  # the caller's state does not match: an older step would not either
            except Exception as e:  # a corrupt or partial step: try the one before
                if step is not None:
                    raise
                broken.append((s, e))
                warnings.warn(
                    f"rp.Checkpoints: checkpoint step {s} in {self.directory} is unreadable "
                    f"({_described(e)}); trying the one before.",
                    stacklevel=2,
                )
                continue
            if broken:
                self._move_aside(broken, restored_step=s)
            state, record = restored
            return _as_like(like, logical.restored(values(like), state)), record
        raise NoReadableCheckpointError(
            f"rp.Checkpoints: no readable checkpoint in {self.directory}: "
            + "; ".join(f"step {s}: {_described(e)}" for s, e in broken)
            + ". None was moved or deleted: as no step restores, the state to restore into "
            "(`like`) may be what is wrong. If the checkpoints are indeed broken, start the run "
            "over with rp.fit's CheckpointOptions(start_over_if_unreadable=True) (replicator "
            "train: start_over_if_unreadable=true), which moves them aside (renamed "
            "<step>.broken-<time>, not deleted) and trains from step 0.",
            broken,
        )

    def _move_aside(
        self, broken: list[tuple[int, Exception]], *, restored_step: int | None
    ) -> None:
        """Renames the directories of the ``broken`` steps to ``<step>.broken-<time>``, never
        deleting them, so that the run can save those steps again: the steps newer than
        ``restored_step``, which restored into the same ``like`` (so they are broken, not the
        caller's state), or every step when the run starts over (``restored_step`` None). Only
        process 0 renames (as orbax, which has process 0 alone change the directory), to names
        that every process reports alike; every process then reloads the list of steps."""
        first = jax.process_index() == 0
        targets = _from_process_0([self._aside_name(s) for s, _ in broken] if first else None)
        for (s, e), target in zip(broken, targets):
            source = os.path.join(self.directory, str(s))
            if first and os.path.lexists(source):
                os.rename(source, target)
            if restored_step is None:
                then = "and no step restores"
                goes = "The run starts over from step 0 (start_over_if_unreadable=True)."
            else:
                then = f"while step {restored_step} restores"
                goes = f"The run goes on from step {restored_step}."
            warnings.warn(
                f"rp.Checkpoints.restore: checkpoint step {s} in {self.directory} is broken "
                f"({_described(e)}), {then}: moved it aside to {target} (kept, not deleted). "
                f"{goes}",
                stacklevel=3,
            )
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("rp.Checkpoints: broken steps moved aside")
        self._manager.reload()

    def _aside_name(self, step: int) -> str:
        """A free ``<directory>/<step>.broken-<time>`` (``-2``, ``-3``, ... appended if taken)."""
        target = os.path.join(self.directory, f"{step}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
        n, base = 1, target
        while os.path.exists(target):
            n += 1
            target = f"{base}-{n}"
        return target

    @contextlib.contextmanager
    def _out_of_space(self, step: int | None):
        """Turns a write of ``step`` that failed for lack of space into one
        `CheckpointWriteError`, once process 0 has removed the partial step directory."""
        try:
            yield
        except Exception as e:
            code = full_disk.no_space(e)
            if code is None or step is None:
                raise
            self._failed = step
            if jax.process_index() == 0:
                full_disk.remove_partial(self.directory, step)
            self._manager.reload()
            steps = sorted(self._manager.all_steps())
            raise full_disk.error(code, step, self.directory, steps, keep=self.keep) from None

    def _restore(
        self, step: int, abstract: PyTree, *, cast: bool = False, nodes: dict | None = None
    ) -> tuple[PyTree, dict]:
        """Reads one step. A leaf saved in ZeRO's earlier flat layout is read as saved and
        converted to its own shape (`flat_layout`), and so are the packed stages' rows saved
        as each replica's parts (`split_rows_layout`, ``nodes``); one saved under another ZeRO
        stage's name (`zero_stages`) is read by that name."""
        ocp = self._ocp
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        tree, saved = self._saved_leaves(step)
        if saved is not None:
            saved = flat_layout.renamed(saved, {_name(path) for path, _ in flat})
            wanted = {_name(path): jax.tree_util.keystr(path) for path, _ in flat}
            saved = zero_stages.renamed(saved, wanted)
            self._check_structure(step, saved, flat)
        saved = saved or {}
        read_as, converted, names, found = [], {}, {}, {}
        for i, (path, want) in enumerate(flat):
            _, meta, name = saved.get(_name(path), (None, None, None))
            names[_name(path)] = name
            if getattr(meta, "dtype", None) is not None and not cast:
                check_dtype(step, path, meta.dtype, want.dtype)
            shape = getattr(meta, "shape", None)
            held = (nodes or {}).get(_name(path))
            if held is not None and meta is not None and split_rows_layout.saved_replicas(meta) > 1:
                (node, key), n = held, split_rows_layout.saved_replicas(meta)
                if n != node.layout.n or tuple(shape) != tuple(node[key].shape):
                    shown = jax.tree_util.keystr(path)
                    message = split_rows_layout.refusal(step, shown, n, node)
                    raise StateMismatchError(message, step=step, leaf=shown, layout=True)
                read_as.append(
                    jax.ShapeDtypeStruct(tuple(shape), want.dtype, sharding=want.sharding)
                )
                found.setdefault(id(node), (node, {}))[1][key] = i
                continue
            legacy = name == _name(path) + flat_layout.LEGACY_SUFFIX  # a ZeRO-3 flat, <path>.0
            if shape is None or (tuple(shape) == tuple(want.shape) and not legacy):
                read_as.append(want)
                continue
            if not flat_layout.convertible(meta, tuple(want.shape)):
                message = restore_checks.shape_mismatch(step, path, shape, want)
                raise StateMismatchError(message, step=step, leaf=jax.tree_util.keystr(path))
            mesh = getattr(want.sharding, "mesh", None)
            sharding = replicated_sharding(mesh) if mesh is not None else want.sharding
            aval = jax.ShapeDtypeStruct(tuple(shape), want.dtype, sharding=sharding)
            read_as.append((aval,) if legacy else aval)
            converted[i] = (want, flat_layout.stage_blocks(meta), legacy)
        moved = any(n not in (None, w, w + flat_layout.LEGACY_SUFFIX) for w, n in names.items())
        target = jax.tree.unflatten(treedef, read_as)
        if moved:  # read in the checkpoint's own structure, by the names it was saved with
            plain = {w: x[0] if isinstance(x, tuple) else x for w, x in zip(names, read_as)}
            target = zero_stages.read_tree(tree, names, plain)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), record=ocp.args.JsonRestore()
            ),
        )
        if moved:
            arrays = zero_stages.read_back(restored["state"], names)
            leaves = [(arrays[w],) if isinstance(x, tuple) else arrays[w]
                      for w, x in zip(names, read_as)]  # fmt: skip
        else:
            leaves = treedef.flatten_up_to(restored["state"])
        split_rows_layout.convert(found, leaves, [want for _, want in flat])
        for i, (want, blocks, legacy) in converted.items():
            x = leaves[i][0] if legacy else leaves[i]
            leaves[i] = flat_layout.convert(x, want, blocks, flat_layout.stage_axis_of(want))
        return jax.tree.unflatten(treedef, leaves), dict(restored["record"])

    def _saved_leaves(self, step: int) -> tuple[Any, dict | None]:
        """orbax's metadata tree of ``step``, and ``{orbax name: (path as saved, array
        metadata)}`` of every leaf saved in it; None if its metadata is unreadable (then the
        restore itself reports the problem)."""
        try:
            tree = self._manager.item_metadata(step)["state"]
            tree = getattr(tree, "tree", tree)
            leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        except Exception:
            return None, None
        return tree, {_name(path): (jax.tree_util.keystr(path), meta) for path, meta in leaves}

    def _check_structure(self, step: int, saved: dict, flat: list) -> None:
        """Raises `StateMismatchError` listing the leaves only ``like`` has and only the
        checkpoint has, if any."""
        wanted = {_name(path): jax.tree_util.keystr(path) for path, _ in flat}
        added = [shown for name, shown in wanted.items() if name not in saved]
        missing = [shown for name, (shown, *_) in saved.items() if name not in wanted]
        if not added and not missing:
            return
        counts = [f"{len(added)} added", f"{len(missing)} missing"]
        lists = [
            "Added (in the state, not in the checkpoint): " + _listed(added),
            "Missing (in the checkpoint, not in the state): " + _listed(missing),
        ]
        raise StateMismatchError(
            STRUCTURE.format(
                step=step,
                directory=self.directory,
                counts=", ".join(counts) + " leaves",
                lists="\n".join(lists),
            ),
            step=step,
            leaf=(added + missing)[0],
        )

    def close(self) -> None:
        """Waits for a write in progress, then releases orbax's threads."""
        self.wait()
        self._manager.close()
        if self._failed is not None and jax.process_index() == 0:  # once every write has ended
            full_disk.remove_partial(self.directory, self._failed)


def _from_process_0(value: Any) -> Any:
    """Process 0's ``value`` (a JSON value) on every process."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array(raw.size, np.int32)))
    buffer = raw.copy() if jax.process_index() == 0 else np.zeros(size, np.uint8)
    return json.loads(bytes(multihost_utils.broadcast_one_to_all(buffer)))


def _described(e: BaseException) -> str:
    """``Type: message`` of an exception, the message cut to 300 characters."""
    message = " ".join(str(e).split())
    if len(message) > 300:
        message = message[:300] + " ..."
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def _check_alive(state: PyTree) -> None:
    """Raises ValueError, naming the first, if a leaf of ``state`` has a deleted buffer."""
    path = errors.deleted_leaf(state)
    if path is not None:
        raise ValueError(
            f"rp.Checkpoints.save: state leaf {path} "
            f"was donated to repl.run (or deleted), so its buffer is gone and nothing was "
            f"saved. Save the state that repl.run returned (state, out = repl.run(step_fn, "
            f"state, batch); rp.fit returns it as result.state), or use "
            f"Replicator(donate=False) to keep the inputs of run alive."
        )


def _listed(paths: list[str], limit: int = 20) -> str:
    """``paths`` joined by commas, the first ``limit`` of them."""
    if not paths:
        return "none"
    shown = ", ".join(paths[:limit])
    return shown + (f", and {len(paths) - limit} more" if len(paths) > limit else "")


def _as_like(like: PyTree, tree: PyTree) -> PyTree:
    """``tree`` (``like``'s arrays) with ``like``'s `ShardedParam` nodes around them again."""

    def wrap(node, x):
        return ShardedParam(x, node.dim, node.auto) if isinstance(node, ShardedParam) else x

    return jax.tree.map(wrap, like, tree, is_leaf=is_sharded_param)


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
