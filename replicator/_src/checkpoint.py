"""Checkpoints of the whole training state, with orbax-checkpoint.

A checkpoint is one step directory holding the state pytree (parameters, optimizer state, ZeRO
shards, loss scale, ...) and a small JSON record (the step, the input iterator's position, and
anything else the caller adds). orbax writes each step into a temporary directory and renames it
when complete, so a save interrupted midway is never taken for a checkpoint. `restore` reads the
newest step it can; if that one is unreadable it says so and falls back to the one before.
Restoring takes a ``like`` tree whose shardings say where each array goes: a checkpoint saved on
8 devices restores onto a mesh of 4.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax

from replicator._src.typing import PyTree


class Checkpoints:
    """The checkpoints of one run, in ``directory``, keeping the newest ``keep``.

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

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3) -> None:
        import orbax.checkpoint as ocp

        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"rp.Checkpoints: keep must be an int >= 1; got {keep!r}.")
        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, cleanup_tmp_directories=True
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "record")
        )

    def steps(self) -> list[int]:
        """The steps saved and complete, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: PyTree, **record: Any) -> None:
        """Writes ``state`` and a JSON ``record`` (``step`` plus the keyword arguments, such as
        ``data_position``) as checkpoint ``step``, then drops the oldest beyond ``keep``."""
        ocp = self._ocp
        record = {"step": int(step), **record}
        self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, like: PyTree, step: int | None = None) -> tuple[PyTree, dict]:
        """``(state, record)`` of checkpoint ``step`` (default: the newest readable one).

        Args:
          like: a tree with the state's structure whose leaves are arrays or
            ``jax.ShapeDtypeStruct``s; their shardings say where the restored arrays go (another
            mesh than the one that saved them is fine).
          step: a specific step; then no fallback.

        Raises:
          FileNotFoundError: if there is no readable checkpoint.
        """
        ocp = self._ocp
        abstract = jax.tree.map(_abstract, like)
        candidates = [step] if step is not None else self.steps()[::-1]
        if not candidates:
            raise FileNotFoundError(f"rp.Checkpoints: no checkpoint in {self.directory}.")
        errors = []
        for s in candidates:
            try:
                restored = self._manager.restore(
                    s,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()
                    ),
                )
            except Exception as e:  # a corrupt or partial step: try the one before
                if step is not None:
                    raise
                errors.append(f"step {s}: {type(e).__name__}: {str(e)[:200]}")
                warnings.warn(
                    f"rp.Checkpoints: checkpoint step {s} in {self.directory} is unreadable "
                    f"({type(e).__name__}); trying the one before.",
                    stacklevel=2,
                )
                continue
            return restored["state"], dict(restored["record"])
        raise FileNotFoundError(
            f"rp.Checkpoints: no readable checkpoint in {self.directory}: " + "; ".join(errors)
        )

    def close(self) -> None:
        self._manager.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
