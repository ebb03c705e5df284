"""Stage parameters packed into rows, and the model that says what each row holds.

A pipeline whose stages differ (``rp.pipeline.sequential``) packs each stage's parameter tree
into one flat row per dtype. `PackedStages` is that dict of rows, ``{dtype: [K, n]}`` (or
``[V, K, n]``), and it carries its model: anything that maps the rows (``jax.tree.map``, a
placement, a gradient) keeps it, so that the optimizer can see each stage's own tree, leaf by
leaf, as on one device, instead of the buffers.

The model is any object with the `StageRows` methods; `PackedStages` only holds it.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from replicator._src.core.typing import PyTree


class StageRows(Protocol):
    """What a packed row of each logical stage holds (``rp.pipeline.SequentialStages`` is one)."""

    num_stages: int  # K, the rows along the 'stage' axis
    repeats: int  # V, rows per device (virtual stages); K x V logical stages

    def abstract_stage(self, j: int) -> PyTree:
        """The parameter tree of logical stage ``j``, of ``ShapeDtypeStruct`` leaves."""

    def unpack_row(self, j: int, row: dict[str, jax.Array]) -> PyTree:
        """The tree of stage ``j``, from its row ``{dtype: [n]}``."""

    def pack_row(self, j: int, tree: PyTree) -> dict[str, jax.Array]:
        """The tree of stage ``j`` (or one shaped like it) as its row ``{dtype: [n]}``."""


class PackedStages(dict):
    """The packed rows of a pipeline's stages, ``{dtype: rows}``, with the model that packed
    them (``model``). A dict for every purpose but one: as a pytree node it keeps ``model``.

    >>> import jax.numpy as jnp
    >>> packed = PackedStages(None, {"float32": jnp.zeros((2, 3))})
    >>> type(jax.tree.map(lambda a: a + 1, packed)).__name__, sorted(packed)
    ('PackedStages', ['float32'])
    """

    __slots__ = ("model",)

    def __init__(self, model: StageRows | Any, rows: dict) -> None:
        super().__init__(rows)
        self.model = model

    def __repr__(self) -> str:
        return f"PackedStages({dict.__repr__(self)})"

    def __reduce__(self):  # copy and pickle keep the model
        return (PackedStages, (self.model, dict(self)))


def _flatten_with_keys(p: PackedStages):
    keys = tuple(sorted(p))
    return [(jax.tree_util.DictKey(k), p[k]) for k in keys], (keys, p.model)


def _flatten(p: PackedStages):
    keys = tuple(sorted(p))
    return [p[k] for k in keys], (keys, p.model)


def _unflatten(aux, children) -> PackedStages:
    keys, model = aux
    return PackedStages(model, dict(zip(keys, children, strict=True)))


jax.tree_util.register_pytree_with_keys(PackedStages, _flatten_with_keys, _unflatten, _flatten)


def is_packed(x: Any) -> bool:
    """Whether ``x`` is a `PackedStages` (for ``is_leaf``)."""
    return isinstance(x, PackedStages)


def packed_nodes(tree: PyTree) -> list[PackedStages]:
    """The `PackedStages` nodes of ``tree``."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_packed) if is_packed(x)]


def is_stage_rows(x: Any) -> bool:
    """Whether ``x`` holds a pipeline's stage rows: a `PackedStages`, or a node that stores them
    split (ZeRO-3's, whose class says ``holds_stage_rows = True`` and which has ``model``)."""
    return is_packed(x) or getattr(type(x), "holds_stage_rows", False)


def stage_row_nodes(tree: PyTree) -> list:
    """The nodes of ``tree`` that hold stage rows (`is_stage_rows`)."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_stage_rows) if is_stage_rows(x)]
