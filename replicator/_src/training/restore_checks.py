"""What `Checkpoints.restore` checks of the state to restore into, before and while reading:
a sharding that does not divide a leaf (nothing is read), a dtype that would be cast."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from replicator._src.core.mesh import indivisible_split
from replicator._src.core.typing import PyTree


class StateMismatchError(ValueError):
    """The state to restore into does not have the checkpoint's structure, shapes or dtypes.

    Attributes:
      step: the checkpoint step read.
      directory: the checkpoint directory.
      leaf: the first leaf that differs (its path, as ``jax.tree_util.keystr`` shows it).
      layout: True when the state is the same but the checkpoint holds it in a layout that
        restores only onto another mesh (the message names it); False: the state differs.
    """

    def __init__(
        self, message: str, *, step: int | None = None, leaf: str | None = None, layout=False
    ):
        super().__init__(message)
        self.step, self.leaf, self.directory, self.layout = step, leaf, None, layout


def check_dtype(step: int, path, saved, want) -> None:
    """Raises `StateMismatchError` if a leaf saved as ``saved`` would be cast to ``want``
    (dtypes JAX itself treats as one, such as float64 and float32 without x64, are equal)."""
    try:
        saved, want = np.dtype(saved), np.dtype(want)
    except TypeError:  # not a NumPy dtype (orbax reads such leaves as saved, or refuses)
        return
    if jax.dtypes.canonicalize_dtype(saved) == jax.dtypes.canonicalize_dtype(want):
        return
    raise StateMismatchError(
        f"rp.Checkpoints.restore: leaf {jax.tree_util.keystr(path)} of checkpoint step {step} "
        f"is {saved}, but the state to restore into has {want}; restoring would cast it. "
        f"Restore into the saved dtype (e.g. jax.ShapeDtypeStruct(shape, jnp.{saved}, "
        f"sharding=...)), then cast on purpose: "
        f"jax.tree.map(lambda x: x.astype(jnp.{want}), state); or restore(like, cast=True).",
        step=step,
        leaf=jax.tree_util.keystr(path),
    )


def check_divides(abstract: PyTree) -> None:
    """Raises ValueError, naming the first, if a leaf's ``NamedSharding`` splits one of its
    dimensions into parts that do not divide it (orbax would fail on every step alike, which
    is the state to restore into being wrong, not the checkpoints)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            continue
        shape, sizes = tuple(leaf.shape), dict(sharding.mesh.shape)
        bad = indivisible_split(shape, sharding.spec, sizes)
        if bad is not None:
            dim, parts, names = bad
            raise ValueError(
                f"rp.Checkpoints.restore: leaf {jax.tree_util.keystr(path)} of shape "
                f"{list(shape)} cannot be restored with {sharding.spec} on this mesh "
                f"({sizes}): dimension {dim} has size {shape[dim]}, which does not divide over "
                f"{parts} devices of {', '.join(map(repr, names))}. Nothing was read (the "
                f"checkpoints are fine). Restore that leaf with a spec that divides it: leave "
                f"the dimension whole (None in the spec) or split it over axes whose sizes "
                f"divide {shape[dim]}; build `like` on the new mesh with repl.place(tree, "
                f"specs) or repl.abstract(init_fn), which check every split."
            )


def shape_mismatch(step: int, path, shape, want) -> str:
    """The refusal of a leaf saved in another shape than ``want``'s (another model or optimizer
    than the one the state is built with), in one line."""
    return (
        f"rp.Checkpoints.restore: leaf {jax.tree_util.keystr(path)} of checkpoint step {step} "
        f"has shape {tuple(shape)}, but the state to restore into has {tuple(want.shape)}: "
        f"the model or optimizer differs from the run that saved it (the mesh and the ZeRO "
        f"stage may differ). Restore with that model and optimizer, or start a new run in "
        f"another checkpoint directory."
    )
