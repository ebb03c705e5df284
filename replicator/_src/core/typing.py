"""Shared type aliases."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeAlias

PyTree: TypeAlias = Any
"""A nested structure of lists, tuples, dicts, dataclasses and arrays (a JAX pytree)."""

AxisName: TypeAlias = Hashable
"""The name of a mesh axis, such as ``"data"`` or ``"stage"``."""

StepFn: TypeAlias = Callable[..., tuple[PyTree, PyTree]]
"""``step_fn(state, *args) -> (state, outputs)``, written for one replica."""
