"""A checkpoint checked against the state it would restore into, from its metadata alone.

`check_restore` reads what orbax wrote beside the arrays (each leaf's shape and dtype, and the
step's JSON record: its step and data position) and checks them as `Checkpoints.restore`
would, without reading an array or changing a file: a run can be checked against a layout, a
mesh or a TPU target (``repl.abstract`` on ``rp.tpu_devices``) before a pod is booked. It also
says what the restore holds per device: every array read straight into its sharding, a leaf
saved in ZeRO's earlier flat layout read whole (replicated) before it is converted, and one of
packed stages saved as each replica's parts read as saved before it is made logical (refused, as
the restore refuses it, for another replica count).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import types

import jax
import numpy as np

from replicator._src.core import logical
from replicator._src.core.sharded_params import values
from replicator._src.core.typing import PyTree
from replicator._src.training import (
    checkpoint,
    flat_layout,
    restore_checks,
    split_rows_layout,
    zero_stages,
)


@dataclasses.dataclass(frozen=True)
class RestoreCheck:
    """What `check_restore` found: the checkpoint matches the state.

    Attributes:
      step: the checkpoint's step.
      record: its JSON record (``step``, ``data_position``, ...).
      leaves: how many arrays it holds.
      restore_bytes: the most bytes one device holds while the arrays are read (each in its
        sharding, a flat-layout leaf whole besides its converted shard).
    """

    step: int
    record: dict
    leaves: int
    restore_bytes: int


def check_restore(directory: str | os.PathLike, like: PyTree, *, step: int | None = None):
    """Checks from its metadata that a checkpoint restores into ``like``, reading no array.

    Checkpoint ``step`` (default: the newest) of ``directory`` is checked as
    ``Checkpoints.restore`` would check it; nothing is read into memory, nothing on disk changes.

    Args:
      directory: a `Checkpoints` directory (``rp.fit``'s ``checkpointing.directory``).
      like: the state to restore into, as ``Checkpoints.restore`` takes it: arrays or
        ``jax.ShapeDtypeStruct`` values whose shardings say where each array goes.
      step: a step of the directory; default the newest.

    Returns:
      A `RestoreCheck`.

    Raises:
      FileNotFoundError: no such directory, or no checkpoint in it.
      StateMismatchError: (a ValueError) a leaf added or missing, or of another shape or dtype
        than saved, named, as ``Checkpoints.restore`` would raise it.
      ValueError: a sharding in ``like`` that does not divide its leaf.

    >>> import tempfile, jax, jax.numpy as jnp, replicator as rp
    >>> d = tempfile.mkdtemp()
    >>> rp.Checkpoints(d).save(7, {"w": jnp.ones((4, 2))}, data_position=28)
    >>> found = rp.training.check_restore(d, {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)})
    >>> found.step, found.record["data_position"], found.restore_bytes
    (7, 28, 32)
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"rp.training.check_restore: no directory {directory}.")
    abstract = jax.tree.map(checkpoint._abstract, logical.saved_like(values(like)))
    restore_checks.check_divides(abstract)
    step, tree, record = _read_metadata(directory, step)
    saved = {
        checkpoint._name(path): (jax.tree_util.keystr(path), meta)
        for path, meta in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    wanted = {checkpoint._name(path): jax.tree_util.keystr(path) for path, _ in flat}
    saved = flat_layout.renamed(saved, set(wanted))
    saved = zero_stages.renamed(saved, wanted)
    here = types.SimpleNamespace(directory=directory)  # what the structure's refusal names
    checkpoint.Checkpoints._check_structure(here, step, saved, flat)
    nodes = split_rows_layout.nodes_by_name(values(like))  # leaves a logical node holds
    held = 0
    for path, want in flat:
        meta = saved[checkpoint._name(path)][1]
        restore_checks.check_dtype(step, path, meta.dtype, want.dtype)
        held += _per_device(want.shape, want.dtype, want.sharding)
        node = nodes.get(checkpoint._name(path))
        if node is not None and split_rows_layout.saved_replicas(meta) > 1:  # earlier layout
            (node, key), n = node, split_rows_layout.saved_replicas(meta)
            if n != node.layout.n or tuple(meta.shape) != tuple(node[key].shape):
                shown = jax.tree_util.keystr(path)
                message = split_rows_layout.refusal(step, shown, n, node)
                raise checkpoint.StateMismatchError(message, step=step, leaf=shown, layout=True)
            held += _per_device(meta.shape, want.dtype, want.sharding)  # read, then made logical
            continue
        if tuple(meta.shape) == tuple(want.shape):
            continue
        if not flat_layout.convertible(meta, tuple(want.shape)):
            message = restore_checks.shape_mismatch(step, path, meta.shape, want)
            raise checkpoint.StateMismatchError(message, step=step, leaf=jax.tree_util.keystr(path))
        held += _per_device(meta.shape, want.dtype, None)  # read whole, then converted
    return RestoreCheck(step, record, len(flat), held)


def _read_metadata(directory: str, step: int | None) -> tuple[int, PyTree, dict]:
    """``(step, orbax's metadata tree of the state, the JSON record)``: no array read; orbax's
    warnings that a read-only manager neither creates nor saves, silenced."""
    import orbax.checkpoint as ocp

    with _quiet_absl():
        manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(read_only=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "record": ocp.JsonCheckpointHandler()},
        )  # fmt: skip
        try:
            steps = sorted(manager.all_steps())
            if not steps or (step is not None and step not in steps):
                what = "no checkpoint" if not steps else f"no step {step} (it has {steps})"
                raise FileNotFoundError(f"rp.training.check_restore: {what} in {directory}.")
            step = steps[-1] if step is None else step
            tree = manager.item_metadata(step)["state"]
            record = manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))
        finally:
            manager.close()
    return step, getattr(tree, "tree", tree), dict(record["record"])


@contextlib.contextmanager
def _quiet_absl():
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _per_device(shape, dtype, sharding) -> int:
    """Bytes of one device's shard of an array of ``shape`` placed by ``sharding`` (the whole
    array without one)."""
    shape = tuple(shape)
    if sharding is not None and hasattr(sharding, "shard_shape"):
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * np.dtype(dtype).itemsize
