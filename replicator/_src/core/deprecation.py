"""Names kept for one release after they moved or were renamed, each with a DeprecationWarning.

A face module serves them from its ``__getattr__``, so they work but are left out of
``dir()`` and of the documented surface. Every entry is listed in CHANGELOG.md with the release
that removes it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def moved_names(module: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that serves the old names of ``table`` with a warning.

    Args:
      module: the module the names were in, e.g. ``"replicator"``.
      table: each old name mapped to the dotted path of what replaces it, e.g.
        ``{"Family": "replicator.planner.Ladder"}``.

    Returns:
      A function for the module's ``__getattr__``: it returns the new object for an old name,
      after a ``DeprecationWarning`` that names the new one, and raises ``AttributeError``
      for any other name.

    >>> getattr_ = moved_names("m", {"old": "math.pi"})
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     value = getattr_("old")
    >>> round(value, 2), str(caught[0].message)
    (3.14, 'm.old is deprecated and will be removed in the next release; use math.pi.')
    """

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in the next release; use "
            f"{table[name]}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return _resolve(table[name])

    return __getattr__
