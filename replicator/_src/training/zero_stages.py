"""Checkpoints across ZeRO stages: the optimizer state with and without its wrapper.

Without ZeRO (and loss scaling) a wrapped optimizer's state is the optax transformation's own;
with ZeRO it is a `loss_scaling.WrappedState` whose ``inner`` is that same state, each leaf the
same logical array (only its sharding differs). So leaf ``opt.inner.0.mu.w`` of a ZeRO run is
leaf ``opt.0.mu.w`` of a run without ZeRO, and a checkpoint of one restores into the other:
`renamed` pairs the names, and `read_tree` reads the checkpoint in its own structure.

Equivalent to: restore(like) == restore(like with every ``.inner`` dropped) when the checkpoint
was saved without it (and the reverse).
"""

from __future__ import annotations

import jax

INNER = "inner"


def _without_inner(name: str) -> list[str]:
    """``name`` with one of its ``inner`` components dropped, for each one it has."""
    parts = name.split(".")
    return [".".join(parts[:i] + parts[i + 1 :]) for i, p in enumerate(parts) if p == INNER]


def renamed(saved: dict, wanted: dict) -> dict:
    """``saved`` (orbax name -> entry) with the names of a ZeRO run's optimizer state renamed to
    ``wanted``'s (name -> shown) when one has an ``inner`` component the other has not: every
    leaf that only one side has must pair, else ``saved`` is returned unchanged (and the
    structure check refuses it)."""
    added = [w for w in wanted if w not in saved]
    missing = {s for s in saved if s not in wanted}
    if not added or len(added) != len(missing):
        return saved
    pairs = {}
    for w in added:
        found = [s for s in _without_inner(w) if s in missing]  # saved without ZeRO
        found += [s for s in missing if w in _without_inner(s)]  # saved with it
        if len(found) != 1 or found[0] in pairs.values():
            return saved
        pairs[w] = found[0]
    out = {k: v for k, v in saved.items() if k not in missing}
    for w, s in pairs.items():
        out[w] = saved[s]
    return out


def read_tree(metadata_tree, names: dict, read_as: dict):
    """The tree to read a checkpoint into: its own structure (``metadata_tree``, orbax's), each
    leaf the ``read_as`` entry of the wanted name it is read as (``names``: wanted name ->
    orbax name as saved)."""
    by_saved = {s: read_as[w] for w, s in names.items()}
    flat, treedef = jax.tree_util.tree_flatten_with_path(metadata_tree)
    return jax.tree.unflatten(treedef, [by_saved[orbax_name(path)] for path, _ in flat])


def read_back(restored, names: dict) -> dict:
    """``{wanted name: array}`` of a tree `read_tree` restored."""
    arrays = {orbax_name(path): x for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
    return {w: arrays[s] for w, s in names.items()}


def orbax_name(path) -> str:
    """orbax's name of a leaf: its path's keys joined by dots."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)
