"""The YAML of run configs, read strictly: a key given twice in one mapping is an error (plain
YAML keeps the second without a word), and a file that is not one mapping of keys, or an
override that is not YAML, is one line naming the file or the override and the fix."""

from __future__ import annotations

import os

import yaml


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping that gives one key twice; the message names the key and both lines."""


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, except that a mapping giving a key twice is an error.

    Plain YAML keeps the last of two equal keys, so ``steps: 5`` then ``steps: 7`` would train 7
    steps without a word. Keys brought in by a merge (``<<: *base``) may still be overridden.
    """

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._paths: dict[int, str] = {}  # a mapping node's dotted path: "model."

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            paths = self._paths
            prefix, seen = paths.get(id(node), ""), {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: the base class refuses it
                    continue
                paths[id(value_node)] = f"{prefix}{key}."
                if first is not key_node.start_mark:
                    a, b = first.line + 1, key_node.start_mark.line + 1
                    where = f"on line {a}" if a == b else f"on lines {a} and {b}"
                    raise DuplicateKeyError(
                        f"key {prefix}{key} appears twice, {where}; YAML would silently keep "
                        f"the second. Keep one of them."
                    )
        return super().construct_mapping(node, deep=deep)


def read_config(path: str | os.PathLike) -> dict:
    """The mapping of the YAML file at ``path``; one-line errors for what is not one."""
    if os.path.isdir(path):
        raise ValueError(
            f"config {path} is a directory; give the path of a YAML file, e.g. configs/lm_dp.yaml."
        )
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=UniqueKeyLoader)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"config {path}: no config file there; give the path of a YAML file, e.g. "
            f"configs/lm_dp.yaml."
        ) from None
    except DuplicateKeyError as e:
        raise ValueError(f"config {path}: {e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        tabs = "; YAML indents with spaces: replace the tabs with spaces" * ("'\\t'" in str(e))
        raise ValueError(f"config {path} is not YAML: {_one_line(e)}{tabs}") from None
    if raw is None:
        raise ValueError(
            f"config {path} is empty (no keys, or comments only); give at least the keys that "
            f"differ from the defaults, e.g. name: run1 and model: {{kind: mlp}}, or start from "
            f"a file of configs/."
        )
    if not isinstance(raw, dict):
        raise ValueError(
            f"config {path}: the top level must be a mapping of keys to values (e.g. steps: 100 "
            f"on a line of its own); got {_a(type(raw).__name__)}."
        )
    return raw


def _a(name: str) -> str:
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def set_override(raw: dict, item: str, key: str, value: str) -> None:
    """Sets the dotted ``key`` of ``raw`` to the YAML ``value`` of the override ``item``."""
    target = raw
    *parents, leaf = key.split(".")
    for part in parents:
        if part == "optimizer" and isinstance(target.get(part), str):
            target[part] = {"name": target[part]}  # optimizer: adam, then optimizer.x=...
        if part == "wandb" and isinstance(target.get(part), bool):
            target[part] = {}  # wandb: true, then wandb.mode=...
        if target.get(part) is None:  # absent, or null (e.g. profile: null): a new section
            target[part] = {}
        target = target[part]
        if not isinstance(target, dict):
            raise ValueError(f"override {item!r}: {part} is not a section.")
    try:
        target[leaf] = yaml.load(value, Loader=UniqueKeyLoader)
    except DuplicateKeyError as e:
        raise ValueError(f"override {item!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"override {item!r} is not YAML: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
