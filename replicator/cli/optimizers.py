"""The ``optimizer:`` section of a run config: the optax transformation and its schedule.

``optimizer: {name: adamw, schedule: cosine, warmup_steps: 20, weight_decay: 0.01}``; the peak
learning rate stays the top-level ``learning_rate``. ``optimizer: adam`` (a name alone) is
short for ``{name: adam}``.

Weight decay (``adamw``, ``lion``) skips biases and normalisation parameters: a leaf is decayed
unless one of its keys ends in ``bias``, is ``b`` or ``scale``, or names a norm (``norm``,
``ln...``). The rule reads the keys of the parameter tree, never the shapes, so it gives the same
mask on ZeRO's flat slices as on the whole leaves: the update is exact under every
``zero_stage``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

NAMES = ("adam", "adamw", "sgd", "lion", "adafactor")
SCHEDULES = ("constant", "cosine", "linear")
_DECAYS = ("adamw", "lion")
_DEFAULT_DECAY = {"adamw": 1e-4, "lion": 1e-3}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adam"  # "adam", "adamw", "sgd", "lion" or "adafactor"
    schedule: str = "constant"  # "constant", "cosine" (to end_factor) or "linear" (to end_factor)
    warmup_steps: int = 0  # linear warmup from 0 to learning_rate, then the schedule
    end_factor: float = 0.0  # cosine and linear: the last step's rate, x learning_rate
    decay_steps: int | None = None  # the schedule's length (default: the run's steps)
    weight_decay: float | None = None  # adamw, lion (default: optax's, 1e-4 and 1e-3)
    momentum: float | None = None  # sgd only: heavy-ball momentum
    ema_decay: float | None = None  # keep ema = d * ema + (1 - d) * params in the state

    def __post_init__(self) -> None:
        where = "OptimizerConfig: "
        if self.name not in NAMES:
            raise ValueError(
                f"{where}name={self.name!r} is not an optimizer; use one of "
                f"{', '.join(map(repr, NAMES))}."
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"{where}schedule={self.schedule!r} is not a schedule; use one of "
                f"{', '.join(map(repr, SCHEDULES))}."
            )
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise ValueError(f"{where}warmup_steps must be an int >= 0; got {self.warmup_steps!r}.")
        if self.warmup_steps < 0:
            raise ValueError(f"{where}warmup_steps must be an int >= 0; got {self.warmup_steps!r}.")
        if self.decay_steps is not None and (
            isinstance(self.decay_steps, bool)
            or not isinstance(self.decay_steps, int)
            or self.decay_steps < 1
        ):
            raise ValueError(f"{where}decay_steps must be an int >= 1; got {self.decay_steps!r}.")
        if not 0 <= self.end_factor <= 1:
            raise ValueError(f"{where}end_factor must be in [0, 1]; got {self.end_factor!r}.")
        if self.weight_decay is not None and self.name not in _DECAYS:
            raise ValueError(
                f"{where}weight_decay is for 'adamw' and 'lion'; optimizer.name={self.name!r} "
                f"has none. Use optimizer.name=adamw, or drop weight_decay."
            )
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ValueError(f"{where}weight_decay must be >= 0; got {self.weight_decay!r}.")
        if self.ema_decay is not None and not 0 <= self.ema_decay < 1:
            raise ValueError(f"{where}ema_decay must be in [0, 1); got {self.ema_decay!r}.")
        if self.momentum is not None and (self.name != "sgd" or not 0 <= self.momentum < 1):
            raise ValueError(
                f"{where}momentum is for optimizer.name='sgd', in [0, 1); got "
                f"momentum={self.momentum!r} with name={self.name!r}."
            )


def schedule_fn(config: OptimizerConfig, learning_rate: float, steps: int) -> Callable:
    """The learning rate at each step (an optax schedule) over ``config.decay_steps`` steps, or
    over the run's ``steps``; past its end the rate stays at its last value."""
    import optax

    steps = config.decay_steps or steps
    peak, warm = learning_rate, min(config.warmup_steps, steps)
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


def decays(path) -> bool:
    """Whether weight decay applies to the leaf at ``path`` (see the module docstring)."""
    names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
    names = [n for n in names if n]
    if not names:
        return True
    return not (
        any(n.endswith("bias") or n in ("b", "scale", "norm") for n in names)
        or any(n.startswith("ln") for n in names)
    )


def decay_mask(params):
    """The weight-decay mask of ``params``, from their keys only (exact on ZeRO slices)."""
    import jax

    return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def make(config: OptimizerConfig, learning_rate: float, steps: int):
    """``(tx, schedule)``: the optax transformation the section describes, and its schedule."""
    import optax

    lr = schedule_fn(config, learning_rate, steps)
    wd = config.weight_decay if config.weight_decay is not None else _DEFAULT_DECAY.get(config.name)
    if config.name == "adam":
        tx = optax.adam(lr)
    elif config.name == "adamw":
        tx = optax.adamw(lr, weight_decay=wd, mask=decay_mask)
    elif config.name == "lion":
        tx = optax.lion(lr, weight_decay=wd, mask=decay_mask)
    elif config.name == "sgd":
        tx = optax.sgd(lr, momentum=config.momentum)
    else:
        tx = optax.adafactor(lr)
    return tx, lr
