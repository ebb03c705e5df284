"""The planner's option records: what `enumerate_layouts` splits and tries, and how `plan` times
and prices the layouts.

Each record is a frozen dataclass with defaults, checked and normalised when it is made (a
sequence becomes a tuple, a remat policy's name its value), so that a bad option is refused
where it is written, before anything is enumerated or compiled.

This module is plain Python: no JAX, nothing compiled.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from replicator._src.core.errors import positive_int
from replicator._src.planner.layouts import (
    BASIC_REMATS,
    REMATS,
    SCHEDULES,
    ZERO_STAGES,
    remat_policy,
)
from replicator._src.planner.model_shape import ModelShape
from replicator._src.planner.token_axes import ATTENTIONS, MIN_CONTEXT_SEQ


def _count(record: str, name: str, value: Any, *, zero: bool = False, none: bool = False) -> Any:
    """``value`` if it is an int >= 1 (>= 0 with ``zero``; or None with ``none``), else a
    ValueError naming the record and the field."""
    if value is None and none:
        return None
    least = 0 if zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        tail = " or None" if none else ""
        raise ValueError(f"{record}: {name} must be an int >= {least}{tail}; got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """The sizes of a model and its step that decide how `enumerate_layouts` may split it.

    Attributes:
      global_batch: examples per step, over all replicas: ``data`` must divide it.
      num_layers: the layers a pipeline splits into stages: ``stage`` must divide them.
      num_heads: attention heads: ``model`` must divide them; None: no constraint.
      hidden: MLP hidden units: ``model`` must divide them; None: no constraint.
      seq_len: the tokens of each sequence; None: no context axis.
      d_model: the model's width: a context axis needs ``seq_len >= d_model``; None: no such
        constraint.
      num_experts: the mixture-of-experts blocks' experts: ``expert`` must divide them; 0 for
        a dense model.
      zigzag: the model lays a ring's sequence out in ``2 C`` chunks over a context axis of
        ``C`` devices (the GPT's default), rather than ``C``.

    Raises:
      ValueError: for a size that is not a positive int (``num_experts``: not >= 0).

    >>> ModelSizes(global_batch=16, num_layers=4, num_heads=4).hidden is None
    True
    >>> ModelSizes(global_batch=0, num_layers=4)
    Traceback (most recent call last):
    ValueError: ModelSizes: global_batch must be an int >= 1; got 0.
    """

    global_batch: int
    num_layers: int
    num_heads: int | None = None
    hidden: int | None = None
    seq_len: int | None = None
    d_model: int | None = None
    num_experts: int = 0
    zigzag: bool = True

    def __post_init__(self) -> None:
        for name in ("global_batch", "num_layers"):
            positive_int(getattr(self, name), api="ModelSizes", name=name)
        for name in ("num_heads", "hidden", "seq_len", "d_model"):
            _count("ModelSizes", name, getattr(self, name), none=True)
        if (
            isinstance(self.num_experts, bool)
            or not isinstance(self.num_experts, int)
            or (self.num_experts < 0)
        ):
            raise ValueError(
                f"ModelSizes: num_experts must be an int >= 0 (0 for a dense model); got "
                f"{self.num_experts!r}."
            )


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """What `enumerate_layouts` tries on each mesh.

    The pipeline schedules and their micro-batches, the ZeRO stages, accumulation steps,
    rematerialisation policies, and the attentions over a context axis.

    Attributes:
      schedules: the pipeline schedules to try (`Layout`'s ``schedule``).
      zero_stages: the ZeRO stages to try: 0, 1, 2, 3.
      microbatches: pipeline micro-batch counts to try; None: ``2 stage`` and ``4 stage``
        where the replica batch and the schedule allow them, else the largest that is allowed.
      repeats: the circular and interleaved schedules' virtual stages per device (interleaved:
        at least 2).
      accumulate_steps: accumulation steps to try without a pipeline; None: every power of 2
        that divides the replica batch.
      remat: the rematerialisation policies to try, for every schedule: ``False``
        (``"none"``), ``"dots"``, ``"save_dot_offload_mlpwi_0"`` (not in a pipeline),
        ``"save_dot_except_mlpwi"``, ``True`` (``"full"``); kept in that order (least
        recompute first), whatever the order given. Default: none, dots and full.
      attention: how attention may cross a context axis: ``"ring"``, ``"all_to_all"``.

    Raises:
      ValueError: for an unknown schedule, ZeRO stage, remat policy or attention, an empty
        choice, or the interleaved schedule with fewer than 2 repeats.

    >>> SearchOptions(schedules=["1f1b"], remat=("full", "none")).remat
    (False, True)
    >>> SearchOptions(schedules=("zb",))
    Traceback (most recent call last):
    ValueError: SearchOptions: schedules=['zb']; choose one or more of 'gpipe', '1f1b', \
'circular', 'interleaved', 'zerobubble'.
    """

    schedules: Sequence[str] = SCHEDULES
    zero_stages: Sequence[int] = ZERO_STAGES
    microbatches: Sequence[int] | None = None
    repeats: int = 2
    accumulate_steps: Sequence[int] | None = None
    remat: Sequence[bool | str] = BASIC_REMATS
    attention: Sequence[str] = ATTENTIONS

    def __post_init__(self) -> None:
        api = "SearchOptions"
        for name in ("schedules", "zero_stages", "remat", "attention", "microbatches",
                     "accumulate_steps"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, str | bool | int):  # one choice given bare
                value = (value,)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        positive_int(self.repeats, api=api, name="repeats")
        for name, valid in (
            ("schedules", SCHEDULES),
            ("zero_stages", ZERO_STAGES),
            ("attention", ATTENTIONS),
        ):
            values = getattr(self, name)
            if not values or any(v not in valid for v in values):
                raise ValueError(
                    f"{api}: {name}={list(values)!r}; choose one or more of "
                    f"{', '.join(map(repr, valid))}."
                )
        if "interleaved" in self.schedules and self.repeats < 2:
            raise ValueError(
                f"{api}: the interleaved schedule needs repeats >= 2 (virtual stages per device); "
                f"got repeats={self.repeats}. Use repeats=2 or more, or leave 'interleaved' out "
                f"of schedules."
            )
        asked = {remat_policy(r, api) for r in self.remat}
        if not asked:
            raise ValueError(f"{api}: remat must hold False, 'dots' or True; got [].")
        # the policies by name REMATS does not list (a config's own, other presets): before
        # full remat, which recomputes the most
        others = tuple(sorted(r for r in asked if r not in REMATS))
        order = (*REMATS[:-1], *others, REMATS[-1])
        object.__setattr__(self, "remat", tuple(r for r in order if r in asked))


@dataclasses.dataclass(frozen=True)
class AxisLimits:
    """How large `enumerate_layouts` lets each mesh axis grow, and when it tries a context axis.

    Attributes:
      max_model: the largest ``model`` axis to try (e.g. the devices of one node); None: any.
      max_stage: the largest ``stage`` axis to try; None: any.
      max_context: the largest ``context`` axis to try; None: any.
      max_expert: the largest ``expert`` axis to try; None: any.
      min_context_seq: the shortest ``seq_len`` for which context axes are tried.

    Raises:
      ValueError: for a limit that is not an int >= 1 (or None).

    >>> AxisLimits(max_model=8, max_stage=1).max_context is None
    True
    """

    max_model: int | None = None
    max_stage: int | None = None
    max_context: int | None = None
    max_expert: int | None = None
    min_context_seq: int = MIN_CONTEXT_SEQ

    def __post_init__(self) -> None:
        for name in ("max_model", "max_stage", "max_context", "max_expert"):
            _count("AxisLimits", name, getattr(self, name), none=True)
        _count("AxisLimits", "min_context_seq", self.min_context_seq)


@dataclasses.dataclass(frozen=True)
class TimingOptions:
    """How `plan` models a step's time on its hardware profile, beyond the profile itself.

    Attributes:
      overlap: the share (0 to 1) of the data-axis collectives (and of the gradient reductions
        over the context and expert axes) assumed to run behind compute.
      model_flops: the model's FLOPs per step over all devices, for the MFU; None: no MFU.

    Raises:
      ValueError: for an overlap outside [0, 1], or model FLOPs that are not a number > 0.

    >>> TimingOptions(overlap=0.5).model_flops is None
    True
    >>> TimingOptions(overlap=2)
    Traceback (most recent call last):
    ValueError: TimingOptions: overlap must be between 0 and 1; got 2.
    """

    overlap: float = 0.0
    model_flops: float | None = None

    def __post_init__(self) -> None:
        o = self.overlap
        if isinstance(o, bool) or not isinstance(o, int | float) or not 0 <= o <= 1:
            raise ValueError(f"TimingOptions: overlap must be between 0 and 1; got {o!r}.")
        f = self.model_flops
        if f is not None and (isinstance(f, bool) or not isinstance(f, int | float) or f <= 0):
            raise ValueError(
                f"TimingOptions: model_flops must be a number > 0 (FLOPs per step), or None; "
                f"got {f!r}."
            )

    def as_kwargs(self) -> dict[str, Any]:
        """The options as `cost_model.model_time`'s keyword arguments."""
        return {"overlap": self.overlap, "model_flops": self.model_flops}


@dataclasses.dataclass(frozen=True)
class PricingOptions:
    """Price every layout from formulas before compiling, and compile only the fastest ladders.

    With these, `plan` prices each layout from the model's sizes (state, peak memory, FLOPs,
    collective bytes: microseconds a layout, nothing compiled), drops the ladders whose most
    frugal layout's priced peak is well over the budget, and compiles only the
    ``compile_top`` ladders whose fastest priced layouts model fastest (each kind's fastest
    first); then, while none of them fits, as many more, repriced by what the compiled peaks
    showed (`pricing.ROUNDS` rounds at most).

    Attributes:
      model: the model's sizes (`ModelShape`; ``gpt.model_shape(config, batch)`` for the GPT).
      compile_top: how many ladders to compile in each round.
      skip_slower: once a compiled layout fits, a ladder priced over this many times its
        modelled step is not compiled, and its compile is stopped if it has begun (its layouts
        are listed as skipped, with both times). The prices have been within 3% of the
        compiled programs' times without a pipeline and under them with one, so such a ladder
        would not be chosen. None compiles every ladder of the round.
      time_limit: seconds from the plan's start after which no compile begins, nor one that
        the compiles so far, at their mean length, say would end past them (one begun runs to
        its end). The layouts left are listed as not compiled, with the time gone. Compiles
        go in priced order, so those left are the slowest priced. A full-size TPU program
        takes 1-5 minutes on 2 cores: the default lets `plan` answer in about 5 minutes. None
        compiles every ladder the search reaches.

    Raises:
      ValueError: for a ``model`` that is not a `ModelShape`, ``compile_top`` not an int
        >= 1, ``skip_slower`` not a number >= 1 or None, or ``time_limit`` not a number > 0
        or None.

    >>> shape = ModelShape(num_layers=4, d_model=256, num_heads=8, kv_heads=8, head_dim=32,
    ...                    hidden=1024, vocab=256, seq_len=128, global_batch=32)
    >>> PricingOptions(model=shape).compile_top
    4
    """

    model: ModelShape
    compile_top: int = 4
    skip_slower: float | None = 1.1
    time_limit: float | None = 240.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelShape):
            raise ValueError(
                f"PricingOptions: model must be an rp.planner.ModelShape (gpt.model_shape(config, "
                f"batch) makes one); got {type(self.model).__name__}."
            )
        _count("PricingOptions", "compile_top", self.compile_top)
        skip = self.skip_slower
        if skip is not None and (isinstance(skip, bool) or not isinstance(skip, int | float)
                                 or not skip >= 1):  # fmt: skip
            raise ValueError(
                f"PricingOptions: skip_slower must be a number >= 1 or None; got {skip!r}."
            )
        limit = self.time_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float)
                                  or not limit > 0):  # fmt: skip
            raise ValueError(
                f"PricingOptions: time_limit must be a number of seconds > 0 or None (no "
                f"limit); got {limit!r}."
            )


def fold_deprecated(
    api: str,
    old: dict[str, Any],
    records: dict[str, tuple[type, Any]],
    *,
    stacklevel: int,
    optional: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The option records of a call that may still pass their fields as keywords.

    Each keyword of ``old`` that is a field of one of ``records``' classes goes into that
    record, with a ``DeprecationWarning`` naming the new spelling, attributed to the caller
    ``stacklevel`` frames up; any other keyword is a ``TypeError``, as Python's own.

    Args:
      api: the function's name in the messages, e.g. ``"enumerate_layouts"``.
      old: the keywords the call passed beyond its signature.
      records: each parameter's name mapped to ``(record class, the record given or None)``.
      stacklevel: ``warnings.warn``'s, from this function to the caller's line.
      optional: for a parameter whose record the old keywords ask for only with one field
        set, that field: with ``{"pricing": "model"}``, ``model=None`` (or ``compile_top=``
        alone) asks for no pricing and makes no `PricingOptions`.

    Returns:
      Each parameter's record: the one given, one made of the old keywords, or None.

    Raises:
      TypeError: for a keyword that no record has.
      ValueError: for an old keyword given together with its record.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     got = fold_deprecated("f", {"overlap": 0.5}, {"timing": (TimingOptions, None)},
    ...                           stacklevel=1)
    >>> got["timing"].overlap, str(caught[0].message)
    (0.5, 'f(overlap=...) is deprecated and will be removed in the next release; use \
timing=rp.planner.TimingOptions(overlap=...).')
    """
    owner = {f.name: param for param, (cls, _) in records.items()
             for f in dataclasses.fields(cls)}  # fmt: skip
    for key in old:  # refused before any warning
        if key not in owner:
            raise TypeError(f"{api}() got an unexpected keyword argument {key!r}")
    spelling = {key: f"{owner[key]}=rp.planner.{records[owner[key]][0].__name__}({key}=...)"
                for key in old}  # fmt: skip
    for key in old:
        param = owner[key]
        if records[param][1] is not None:
            raise ValueError(
                f"{api}: {key}= is the old spelling of {spelling[key]}, and {param}= is given "
                f"too; give {key} in {param}= only."
            )
    fields: dict[str, dict[str, Any]] = {}
    for key, value in old.items():
        param, new = owner[key], spelling[key]
        warnings.warn(
            f"{api}({key}=...) is deprecated and will be removed in the next release; use {new}.",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )
        fields.setdefault(param, {})[key] = value
    out = {param: given for param, (_, given) in records.items()}
    for param, values in fields.items():
        needed = (optional or {}).get(param)
        if needed is None or values.get(needed) is not None:
            out[param] = records[param][0](**values)
    return out
