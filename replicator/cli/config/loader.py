"""A YAML config file read into a `TrainConfig`: ``key=value`` overrides applied (`load`), the
short forms turned into their long forms (`short_forms`), then every key, type and range checked
as the frozen dataclasses are built (`from_dict`)."""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any

from replicator.cli.checks import did_you_mean
from replicator.cli.config.checkpoint import CHECKPOINT_SIZES
from replicator.cli.config.short_forms import both_rates, long_forms
from replicator.cli.config.train import TrainConfig
from replicator.cli.yaml_files import read_config, set_override


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Reads a YAML config and applies ``key=value`` overrides (dotted keys for nested fields).

    An empty ``init_from`` (``init_from=``, ``init_from=null``) is the same as none: the file's
    model sizes stay.

    Raises:
      FileNotFoundError: if there is no file at ``path``.
      ValueError: naming an unknown key (with the valid keys), a value of the wrong type or out
        of range (with the valid ones), or a file that is not a YAML mapping.
    """
    raw = read_config(path)
    overridden = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: write key=value, e.g. steps=20.")
        if "" in key.split("."):
            raise ValueError(
                f"override {item!r}: {key!r} has an empty part; write key=value with a dotted "
                f"key for a section, e.g. model.layers=2."
            )
        overridden.add(key)
        set_override(raw, item, key, value)
    if raw.get("init_from") in ("", None):  # empty or null: as if the key were absent
        overridden.discard("init_from")
    if "init_from" in overridden and isinstance(raw.get("model"), dict):
        # The file's sizes describe the model it trains from scratch; the checkpoint's replace
        # them (a size also given on the command line must agree with the checkpoint).
        for key in CHECKPOINT_SIZES:
            if f"model.{key}" not in overridden:
                raw["model"].pop(key, None)
    # An override of the rate replaces it in whichever form the file gives it.
    section = raw.get("optimizer")
    if {"learning_rate", "optimizer.learning_rate"} <= overridden:
        raise both_rates("overrides: ")
    if "learning_rate" in overridden and isinstance(section, dict):
        section.pop("learning_rate", None)
    elif "optimizer.learning_rate" in overridden:
        raw.pop("learning_rate", None)
    return from_dict(TrainConfig, raw, where=str(path))


SHORT_KEYS = {TrainConfig: ("learning_rate",)}  # keys of a file that only its short forms have


def from_dict(cls, raw: dict, where: str = "config", prefix: str = ""):
    """A ``cls`` dataclass from ``raw`` (plain data, as YAML reads it), checking every key, type
    and range; a `TrainConfig`'s short forms are turned into their long forms first
    (`short_forms.long_forms`).

    ``prefix`` is the section's dotted path (``"model."``) in the messages.

    >>> from_dict(TrainConfig, {"optimizer": "sgd", "learning_rate": 0.1}).optimizer.name
    'sgd'
    """
    if cls is TrainConfig and not prefix:
        raw = long_forms(raw, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        if key not in fields:
            valid = [*fields, *SHORT_KEYS.get(cls, ())]
            raise ValueError(
                f"{where}: unknown key {key!r} in {cls.__name__}.{did_you_mean(key, valid)}"
                f" Valid keys: {', '.join(valid)}."
            )
        values[key] = _check(hints[key], value, f"{where}: {prefix}{key}", where, f"{prefix}{key}.")
    try:
        return cls(**values)
    except ValueError as e:
        message, own = str(e), f"{cls.__name__}: "
        if not message.startswith(own):
            raise
        raise ValueError(f"{where}: {prefix}{message[len(own) :]}") from None


def _check(hint, value, where: str, file: str = "config", prefix: str = "") -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(option, value, where, file, prefix)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: unexpected value {value!r}.")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a section (mapping); got {value!r}.")
        return from_dict(hint, value, file, prefix)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    expected = dict if hint is dict else hint
    if value is None:  # `key=` on the command line, or `key:` / null in the file
        name = where.rsplit(": ", 1)[-1]
        raise ValueError(
            f"{where} has no value (`{name}=` or null), and it takes "
            f"{getattr(expected, '__name__', expected)}; give one ({name}=VALUE), or leave the "
            f"key out for its default."
        )
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ValueError(
            f"{where}: expected {getattr(expected, '__name__', expected)}; got {value!r} "
            f"({type(value).__name__}).{_as_int(value) if expected is int else ''}"
        )
    return value


def _as_int(value) -> str:
    """`` Write it as 1000.`` for a whole number written as a float (``1e3``, ``1000.0``)."""
    if isinstance(value, bool) or not isinstance(value, str | float):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number) or number != int(number):
        return ""
    return f" Write it as an integer: {int(number)}."
