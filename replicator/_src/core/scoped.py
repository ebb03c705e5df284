"""Per-thread stacks of scoped values: the one helper behind every ``with ...:`` setting.

The binding of the placeholder collectives, the entered ``Replicator``, the placements and
pipeline notes being recorded: each is a value pushed for the duration of a ``with`` block and
read by code running inside it, on the same thread.

>>> stack = Stack()
>>> stack.top("none")
'none'
>>> with stack.push("outer"), stack.push("inner"):
...     stack.top()
'inner'
>>> stack.top() is None
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Stack(threading.local, Generic[T]):
    """A stack of values for each thread; `push` enters one for the duration of a block."""

    def __init__(self) -> None:
        self.items: list[T] = []

    @contextlib.contextmanager
    def push(self, value: T) -> Iterator[T]:
        """Makes ``value`` the top of this thread's stack within the block, and yields it."""
        self.items.append(value)
        try:
            yield value
        finally:
            self.items.pop()

    def top(self, default=None):
        """The innermost value pushed on this thread, or ``default`` when none is."""
        return self.items[-1] if self.items else default

    def __bool__(self) -> bool:
        return bool(self.items)
