"""The checks and messages of the config sections (`config`, `optimizers`): each names the
field, what it must be, and an example of a good value."""

from __future__ import annotations

import difflib
import math


def where_of(obj) -> str:
    return f"{type(obj).__name__}: "  # from_dict puts the file and the section in its place


def at_least(obj, name: str, low: int) -> None:
    int_at_least(where_of(obj), name, getattr(obj, name), low)


def int_at_least(where: str, name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}{name} must be an int >= {low}; got {value!r}.")


def one_of(obj, name: str, valid: tuple[str, ...], *, what: str) -> None:
    value = getattr(obj, name)
    if value not in valid:
        raise not_one_of(where_of(obj), name, value, valid, what=what)


def not_one_of(where: str, name: str, value, valid: tuple[str, ...], *, what: str) -> ValueError:
    """``{where}{name}={value!r} is not {what}; use one of ...``, with the closest valid value."""
    return ValueError(
        f"{where}{name}={value!r} is not {what}; use one of "
        f"{', '.join(map(repr, valid))}.{did_you_mean(value, valid)}"
    )


def did_you_mean(value, valid) -> str:
    """`` Did you mean 'x'?`` for the closest of ``valid`` to ``value``, or nothing."""
    close = difflib.get_close_matches(str(value), valid, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def finite_positive(obj, name: str, *, example: str, none: bool = False) -> None:
    value = getattr(obj, name)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        extra = " or null" if none else ""
        raise ValueError(
            f"{where_of(obj)}{name} must be a finite number > 0{extra}; got {value!r} "
            f"(e.g. {example})."
        )
