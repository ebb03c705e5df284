"""Which devices a collective of a compiled program joins: its ``replica_groups`` in every form
XLA writes them, and the mesh axes those groups span (`hlo.analyze` reads both)."""

from __future__ import annotations

import re

import numpy as np


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective, from its ``replica_groups``.

    The groups are explicit, iota, or by mesh axes (``mesh['data'=2,'model'=4] {'model'}``;
    which jax emits which: `compat`); ids are positions in that mesh, as in the other forms.

    >>> replica_groups("replica_groups=mesh['data'=2,'model'=2] {'data'}, x=1", 4)
    [[0, 2], [1, 3]]
    >>> replica_groups("replica_groups=[2,2]<=[4], x=1", 4)
    [[0, 1], [2, 3]]
    """
    by_axes = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if by_axes:
        return _groups_over_axes(by_axes.group(1), by_axes.group(2), attrs, num_devices)
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if explicit and explicit.group(1):
        return [
            [int(d) for d in g.split(",") if d]
            for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))
        ]
    return [list(range(num_devices))]  # empty: every device in one group


def _groups_over_axes(mesh: str, chosen: str, attrs: str, num_devices: int) -> list[list[int]]:
    """The groups of ``replica_groups=mesh[<mesh>] {<chosen>}``: devices that differ only along
    the chosen axes."""
    dims = re.findall(r"'([^']+)'=(\d+)", mesh)
    picked = re.findall(r"'([^']+)'", chosen)
    names = [n for n, _ in dims]
    sizes = [int(s) for _, s in dims]
    if (
        re.sub(r"'[^']+'|[\s,]", "", chosen)
        or not set(picked) <= set(names)
        or int(np.prod(sizes)) != num_devices  # positions would not be the program's devices
    ):
        raise ValueError(  # sub-axes or a form this reader does not know: never guess
            f"replicator cannot read these replica groups of XLA's program: {attrs[:200]!r}. "
            "Please report it with your jax version."
        )
    sel = [names.index(n) for n in picked]
    rest = [i for i in range(len(names)) if i not in sel]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose(rest + sel)
    return ids.reshape(-1, int(np.prod([sizes[i] for i in sel]))).tolist()


def axes_spanned(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which members of some group differ (device ids = mesh positions)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varies = np.zeros(len(names), bool)
    for group in groups:
        if len(group) > 1:
            coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
            varies |= (coords != coords[0]).any(axis=0)
    return tuple(n for n, v in zip(names, varies) if v)
