"""Run configs: YAML files validated into typed dataclasses, with ``key=value`` overrides.

Only the CLI and the examples read configs; the library takes explicit arguments. A config names
every field it sets; an unknown or mistyped key is an error that names it and lists the valid
ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # "gpt": a byte-level decoder on Python's stdlib sources (d_model, layers, heads, seq_len);
    # "mlp": a residual MLP regression (d_model, layers);
    # "cnn": a classifier with cross-replica BatchNorm on generated shape images (width).
    kind: str = "gpt"
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    width: int = 16  # cnn: channels of the first conv block (the second has twice as many)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "1f1b"  # "gpipe", "circular" or "1f1b"
    microbatches: int = 4
    repeats: int = 2  # virtual stages per device, for "circular"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    name: str = "run"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: dict = dataclasses.field(default_factory=lambda: {"data": -1})
    cpu_devices: int = 8  # emulated when JAX has one CPU device only; 0: never emulate
    steps: int = 100
    global_batch: int = 32
    optimizer: str = "adam"  # "adam" or "sgd"
    learning_rate: float = 3e-3
    clip_global_norm: float | None = 1.0
    zero_stage: int = 0
    accumulate_steps: int = 1
    pipeline: PipelineConfig | None = None  # needed when mesh has a "stage" axis
    log_every: int = 10
    checkpoint_every: int = 50
    out_dir: str = "runs"
    plot: bool = True


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Reads a YAML config and applies ``key=value`` overrides (dotted keys for nested fields).

    Raises:
      ValueError: naming an unknown key (with the valid keys) or a value of the wrong type.
    """
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config {path}: the top level must be a mapping of keys to values.")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: write key=value, e.g. steps=20.")
        target = raw
        *parents, leaf = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ValueError(f"override {item!r}: {part} is not a section.")
        target[leaf] = yaml.safe_load(value)
    return from_dict(TrainConfig, raw, where=str(path))


def from_dict(cls, raw: dict, where: str = "config"):
    """A ``cls`` dataclass from ``raw``, checking every key and type."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{where}: unknown key {key!r} in {cls.__name__}.{hint} Valid keys: "
                f"{', '.join(fields)}."
            )
        values[key] = _check(hints[key], value, f"{where}: {key}")
    return cls(**values)


def _check(hint, value, where: str) -> Any:
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
                return _check(option, value, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: unexpected value {value!r}.")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a section (mapping); got {value!r}.")
        return from_dict(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = dict if hint is dict else hint
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ValueError(
            f"{where}: expected {getattr(expected, '__name__', expected)}; got {value!r} "
            f"({type(value).__name__})."
        )
    return value
