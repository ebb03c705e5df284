"""The ``optimizer:`` section of a run config: the optax transformation and its schedule.

``optimizer: {name: adamw, learning_rate: 1e-3, schedule: cosine, warmup_steps: 20}``.
``optimizer: adam`` (a name alone) is short for ``{name: adam}``, and a top-level
``learning_rate`` for ``optimizer.learning_rate``.

Weight decay (``adamw``, ``lion``) skips biases and normalisation parameters. `decay_mask` decides
it once, from the whole parameters: a leaf is decayed if it has two dimensions or more and none
of its keys names a bias or a norm (ends in ``bias``, is ``b``, ``scale`` or ``norm``, starts
with ``ln``), the key rule catching the biases and norm scales of stacked layers (``[L, d]``).
`make_optimizer` hands optax that mask as a tree of Python bools, fixed before any step: under
ZeRO the optimizer's program runs on flat slices, and a mask decided from what it sees there
could differ from the one of the whole parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from replicator.cli.checks import at_least, finite_positive, one_of, where_of

NAMES = ("adam", "adamw", "sgd", "lion", "adafactor")
LR_SCHEDULES = ("constant", "cosine", "linear")  # learning-rate schedules
_DECAYS = ("adamw", "lion")  # the optimizers with decoupled weight decay
_BETAS = ("adam", "adamw", "lion")  # the optimizers with b1 and b2
_DEFAULT_DECAY = {"adamw": 1e-4, "lion": 1e-3}  # optax's
DEFAULT_LEARNING_RATE = 3e-3


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adam"  # "adam", "adamw", "sgd", "lion" or "adafactor"
    learning_rate: float = DEFAULT_LEARNING_RATE  # the peak rate (after the warmup)
    schedule: str = "constant"  # "constant", "cosine" (to end_factor) or "linear" (to end_factor)
    warmup_steps: int = 0  # linear warmup from 0 to learning_rate, then the schedule
    end_factor: float = 0.0  # cosine and linear: the last step's rate, x learning_rate
    decay_steps: int | None = None  # the schedule's length (default: the run's steps)
    weight_decay: float | None = None  # adamw, lion (default: optax's, 1e-4 and 1e-3)
    b1: float | None = None  # adam, adamw, lion (default: optax's, 0.9)
    b2: float | None = None  # adam, adamw, lion (default: optax's, 0.999; lion 0.99)
    momentum: float | None = None  # sgd only: heavy-ball momentum
    ema_decay: float | None = None  # keep ema = d * ema + (1 - d) * params in the state

    def __post_init__(self) -> None:
        where = where_of(self)
        one_of(self, "name", NAMES, what="an optimizer")
        finite_positive(self, "learning_rate", example="learning_rate=3e-3")
        one_of(self, "schedule", LR_SCHEDULES, what="a learning-rate schedule")
        at_least(self, "warmup_steps", 0)
        if self.decay_steps is not None:
            at_least(self, "decay_steps", 1)
        _in_range(self, "end_factor", 0.0, 1.0, closed=True, example="end_factor=0.1")
        if self.weight_decay is not None:
            _in_range(self, "weight_decay", 0.0, math.inf, example="weight_decay=0.01")
            if self.weight_decay > 0 and self.name not in _DECAYS:
                raise ValueError(
                    f"{where}weight_decay={self.weight_decay!r}: optimizer.name={self.name!r} "
                    f"has no weight decay (only 'adamw' and 'lion' do); use optimizer.name=adamw, "
                    f"or drop weight_decay."
                )
        for key in ("b1", "b2"):
            if getattr(self, key) is None:
                continue
            _in_range(self, key, 0.0, 1.0, example=f"{key}=0.9")
            if self.name not in _BETAS:
                raise ValueError(
                    f"{where}{key} is for 'adam', 'adamw' and 'lion'; optimizer.name="
                    f"{self.name!r} has none. Drop {key}, or use one of those optimizers."
                )
        if self.momentum is not None:
            _in_range(self, "momentum", 0.0, 1.0, example="momentum=0.9")
            if self.name != "sgd":
                raise ValueError(
                    f"{where}momentum is for optimizer.name='sgd'; got momentum="
                    f"{self.momentum!r} with name={self.name!r}. Use optimizer.name=sgd, or drop "
                    f"momentum (for adam, adamw and lion it is b1)."
                )
        if self.ema_decay is not None:
            _in_range(self, "ema_decay", 0.0, 1.0, example="ema_decay=0.999")


def _in_range(obj, name: str, low: float, high: float, *, example: str, closed=False) -> None:
    """``low <= value < high`` (``<= high`` if ``closed``), a number, else a ``ValueError``."""
    value = getattr(obj, name)
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if number and low <= value and (value <= high if closed else value < high):
        return
    if high == math.inf:
        expected = f"a number >= {low:g}"
    else:
        expected = f"in [{low:g}, {high:g}{']' if closed else ')'}"
    raise ValueError(f"{where_of(obj)}{name} must be {expected}; got {value!r} (e.g. {example}).")


def schedule_fn(config: OptimizerConfig, *, steps: int) -> Callable:
    """The learning rate at each step (an optax schedule) over ``config.decay_steps`` steps, or
    over the run's ``steps``; past its end the rate stays at its last value.

    Args:
      config: the ``optimizer:`` section.
      steps: the run's steps, the schedule's length unless ``config.decay_steps`` is set.

    Returns:
      ``schedule(step) -> learning rate``, step counted from 0.
    """
    import optax

    steps = config.decay_steps or steps
    peak, warm = config.learning_rate, min(config.warmup_steps, steps)
    end = peak * config.end_factor
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(steps, warm + 1), end)
    after = (
        optax.constant_schedule(peak)
        if config.schedule == "constant"
        else optax.linear_schedule(peak, end, max(steps - warm, 1))
    )
    if not warm:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def _named_bias_or_norm(path) -> bool:
    names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
    return any(
        n.endswith("bias") or n in ("b", "scale", "norm") or n.startswith("ln") for n in names if n
    )


def decay_mask(params: Any) -> Any:
    """Which leaves of ``params`` weight decay applies to, as a tree of Python bools.

    A leaf is decayed if it has two dimensions or more and none of its keys names a bias or a
    norm (see the module docstring): biases, norm scales and other vectors are not.

    Args:
      params: the whole parameters, as one device has them (arrays, or anything with a
        ``shape``, such as ``jax.ShapeDtypeStruct``), before any ZeRO placement.

    Returns:
      The tree of ``params`` with a bool at each leaf.
    """
    import jax
    import numpy as np

    def decays(path, x) -> bool:
        ndim = len(x.shape) if hasattr(x, "shape") else np.ndim(x)
        return ndim >= 2 and not _named_bias_or_norm(path)

    return jax.tree_util.tree_map_with_path(decays, params)


def _mask(params: Any):
    return decay_mask if params is None else decay_mask(params)


def make_optimizer(config: OptimizerConfig, *, steps: int, params: Any) -> tuple[Any, Callable]:
    """The optax transformation the ``optimizer:`` section describes, and its schedule.

    Args:
      config: the ``optimizer:`` section.
      steps: the run's steps (the schedule's length unless ``config.decay_steps`` is set).
      params: the whole parameters, before any ZeRO placement: the weight-decay mask
        (`decay_mask`) is decided from their shapes and keys, once, and given to optax as a tree
        of bools. The transformation then takes parameters of this tree structure (or with
        ``rp.ShardedParam`` nodes at its leaves, as ZeRO-3 places them). None when they are not
        known yet (a ``module:function`` job): `decay_mask` then runs on the parameters the
        transformation is given, which ``repl.wrap_optimizer`` gives with their one-device
        shapes under every ``zero_stage``; unwrapped, give it whole parameters.

    Returns:
      ``(tx, schedule)``: the ``optax.GradientTransformation`` (to wrap with
      ``repl.wrap_optimizer``) and ``schedule(step) -> learning rate``.
    """
    import optax

    lr = schedule_fn(config, steps=steps)
    wd = config.weight_decay if config.weight_decay is not None else _DEFAULT_DECAY.get(config.name)
    betas = {k: v for k in ("b1", "b2") if (v := getattr(config, k)) is not None}
    if config.name == "adam":
        tx = optax.adam(lr, **betas)
    elif config.name in _DECAYS:
        make = optax.adamw if config.name == "adamw" else optax.lion
        tx = make(lr, **betas, weight_decay=wd, mask=_mask(params) if wd else None)
    elif config.name == "sgd":
        tx = optax.sgd(lr, momentum=config.momentum)
    else:
        tx = optax.adafactor(lr)
    return tx, lr
