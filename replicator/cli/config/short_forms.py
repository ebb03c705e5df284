"""A config as read, with its short forms turned into their long forms, as plain data: the first
step of reading a config, before any dataclass is built (`long_forms`).

The short forms a file may use, and what they become:

- ``optimizer: adam`` (a name alone): ``optimizer: {name: adam}``;
- ``learning_rate: 1e-3`` (top level): ``optimizer: {learning_rate: 1e-3}``;
- ``wandb: true``: ``wandb: {}`` (offline); ``wandb: false``: no ``wandb``;
- ``model: {kind: llama}``: ``model: {kind: gpt, family: llama}``;
- ``out_dir`` and ``init_from`` starting with ``~``: the home directory's path;
- an empty ``init_from`` (``""`` or null): no ``init_from``;
- ``init_from: DIR``: the ``model:`` sizes and family of the checkpoint's config.json
  (`checkpoint.checkpoint_model`).

The `TrainConfig` built from the result then only checks it.

>>> long_forms({"optimizer": "sgd", "learning_rate": 0.1, "wandb": True}, "c.yaml")
{'optimizer': {'name': 'sgd', 'learning_rate': 0.1}, 'wandb': {}}
"""

from __future__ import annotations

import math
import os
from typing import Any

from replicator.cli.checks import not_one_of
from replicator.cli.config.checkpoint import checkpoint_model
from replicator.cli.optimizers import NAMES


def both_rates(where: str) -> ValueError:
    return ValueError(
        f"{where}learning_rate and optimizer.learning_rate are both set; set one of them (the "
        f"top-level learning_rate is short for optimizer.learning_rate), e.g. "
        f"optimizer: {{name: adam, learning_rate: 3e-3}}."
    )


def long_forms(raw: dict, where: str) -> dict:
    """``raw`` (a config's mapping, as read) with its short forms long: a new mapping.

    Args:
      raw: the config's keys and values, as YAML reads them.
      where: the file (or ``"config"``), for the messages.

    Returns:
      The same config in its long forms, plain data for `TrainConfig`.

    Raises:
      ValueError: naming the key, for a short form of a wrong value (an optimizer of no name,
        a learning rate that is not a number > 0, a wandb that is neither a section nor
        true/false, both learning rates, an ``init_from`` that is not a checkpoint or whose
        sizes the file contradicts).
    """
    out = dict(raw)
    for key in ("out_dir", "init_from"):  # ~ is the home directory, in a file too
        if isinstance(out.get(key), str) and out[key].startswith("~"):
            out[key] = os.path.expanduser(out[key])
    if out.get("init_from", "") in ("", None):  # empty or null: as if the key were absent
        out.pop("init_from", None)
    optimizer = out.get("optimizer")
    if isinstance(optimizer, str):  # optimizer: adam, short for {name: adam}
        if optimizer not in NAMES:
            raise not_one_of(f"{where}: ", "optimizer", optimizer, NAMES, what="an optimizer")
        out["optimizer"] = optimizer = {"name": optimizer}
    if out.get("learning_rate", "") is None:  # null: as if the key were absent
        out.pop("learning_rate")
    if "learning_rate" in out:  # learning_rate: 1e-3, short for the optimizer's
        rate = _rate(out.pop("learning_rate"), where)
        if isinstance(optimizer, dict) and "learning_rate" in optimizer:
            raise both_rates(f"{where}: ")
        if optimizer is None or isinstance(optimizer, dict):
            out["optimizer"] = {**(optimizer or {}), "learning_rate": rate}
    wandb = out.get("wandb")
    if isinstance(wandb, bool):  # wandb: true, short for wandb: {} (offline)
        out["wandb"] = {} if wandb else None
    elif wandb is not None and not isinstance(wandb, dict):
        raise ValueError(
            f"{where}: wandb: expected a section (mapping) or true/false; got {wandb!r}."
        )
    model = out.get("model")
    if isinstance(model, dict) and model.get("kind") == "llama":  # short for gpt, family llama
        family = model.get("family", "llama")
        if family == "gpt":
            raise ValueError(
                f"{where}: model.kind=llama is short for model.kind=gpt with "
                f"model.family=llama, and model.family=gpt contradicts it; for the GPT write "
                f"model.kind=gpt, or drop model.family."
            )
        # another family on Llama's block (qwen2, mixtral) is honoured; an unknown one is
        # refused by the section with the valid ones
        out["model"] = model = {**model, "kind": "gpt", "family": family}
    if "init_from" in out and isinstance(out.get("model", {}), dict):
        out["model"] = checkpoint_model(out.get("model", {}), out["init_from"], where)
    return out


def _rate(value: Any, where: str) -> float:
    """A top-level ``learning_rate``, checked (a string of YAML 1.1, ``1e-3``, is a number)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"{where}: learning_rate: expected float; got {value!r} ({type(value).__name__})."
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{where}: learning_rate must be a finite number > 0; got {value!r} (e.g. "
            f"learning_rate=3e-3)."
        )
    return float(value)
