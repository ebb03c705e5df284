"""The binding stack: which lowering the placeholder collectives mean at trace time.

A lowering pushes a `Binding` while it traces ``step_fn``; every placeholder collective reads the
innermost one. With nothing pushed, the binding is `LOCAL`: one replica, collectives are identities.
The stack is thread-local, so two threads can trace under different lowerings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

from replicator._src.typing import AxisName


@dataclasses.dataclass(frozen=True)
class Binding:
    """What the placeholder collectives bind to.

    Attributes:
      kind: ``"local"``, ``"pmap"`` or ``"shard_map"``.
      axes: the replica axis names the collectives reduce over; ``()`` for local.
      num_replicas: the product of the sizes of ``axes``; 1 for local.
      axis_sizes: every mapped axis of the program and its size, replica axes included, so
        that a pipeline can find its ``stage`` axis.
    """

    kind: str
    axes: tuple[AxisName, ...]
    num_replicas: int
    axis_sizes: tuple[tuple[AxisName, int], ...] = ()

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    def axis_size(self, name: AxisName) -> int:
        """The size of a mapped axis, or 1 if the program does not map it."""
        return dict(self.axis_sizes).get(name, 1)


LOCAL = Binding("local", (), 1)


class _Stack(threading.local):
    def __init__(self) -> None:
        self.items: list[Binding] = []


_STACK = _Stack()


def current_binding() -> Binding:
    """The innermost binding of this thread, or `LOCAL`."""
    return _STACK.items[-1] if _STACK.items else LOCAL


@contextlib.contextmanager
def bind(binding: Binding) -> Iterator[Binding]:
    """Binds the placeholder collectives to ``binding`` for the duration of the block."""
    _STACK.items.append(binding)
    try:
        yield binding
    finally:
        _STACK.items.pop()


def replica_axis_name() -> AxisName | tuple[AxisName, ...] | None:
    """The axis name(s) of the replicas in the current binding, for libraries that take one.

    Flax's ``BatchNorm(axis_name=...)`` and similar layers call ``lax.pmean`` themselves. Pass
    them this value, read while ``step_fn`` is traced, and they reduce over exactly the replicas:
    ``None`` under the local lowering (one replica, no reduction), the data axis (or axes) under
    ``pmap`` and ``shard_map``.

    >>> import replicator as rp
    >>> rp.replica_axis_name() is None      # outside any Replicator: one replica
    True
    """
    axes = current_binding().axes
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes
