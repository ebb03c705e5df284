"""Layouts: how a model's training step is spread over N devices, and ladders of them.

A `Layout` fixes the mesh (``data`` x ``stage`` x ``expert`` x ``context`` x ``model``), the
attention over a context axis, the ZeRO stage, the pipeline schedule with its micro-batches,
gradient accumulation and rematerialisation. A `Ladder` holds the layouts of one mesh, ZeRO
stage and schedule that differ only in how much memory they trade for time (accumulation
steps, rematerialisation), in the order the planner tries them: it compiles the fastest first
and stops at the first that fits, since the others take at least as long under the time model
(more FLOPs, or the same FLOPs in smaller pieces with no less communication).
`enumerate_layouts` (`enumeration`) lists the ladders a model's sizes allow.

This module is plain Python: nothing compiled, and no JAX imported but where a remat policy by
activation name is given (`replicator._src.pipeline.remat` checks its names).
"""

from __future__ import annotations

import dataclasses

from replicator._src.core.errors import positive_int
from replicator._src.pipeline import schedules as schedules_lib
from replicator._src.planner.token_axes import ATTENTIONS

SCHEDULES = ("gpipe", "1f1b", "circular", "interleaved", "zerobubble")
# The schedules with virtual stages: ``repeats`` per device, the layers split into stage x repeats.
VIRTUAL = ("circular", "interleaved")
# What each layer keeps for its backward pass, least recompute first: the pipelines' and the
# GPT's remat policies ("none", "dots", "full") as False, "dots", True, and between "dots" and
# full the policies by activation name the planner tries (`remats.NAMED`).
REMATS = (False, "dots", "save_dot_offload_mlpwi_0", "save_dot_except_mlpwi", True)
# What a search tries unless told: the policies every model has.
BASIC_REMATS = (False, "dots", True)
# The policies that keep activations in host memory (no pipeline keeps them there).
OFFLOADING = ("save_dot_offload_mlpwi_0",)
ZERO_STAGES = (0, 1, 2, 3)
# Schedules that run each stage's work under its own lax.cond: a ring's collective-permute must
# be reached by every device, so ring attention over a context axis runs under the others only.
GATED = ("1f1b", "interleaved", "zerobubble")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a training step on ``data * stage * expert * context * model`` devices.

    Attributes:
      data: replicas inside a slice: the batch is split over them.
      dcn_data: slices joined over the data-centre network, each with ``data`` replicas (the
        mesh's ``dcn_data`` axis); 1 for one slice. The other axes stay inside a slice.
      stage: pipeline stages; 1 for no pipeline.
      model: tensor-parallel devices: attention heads and MLP units split over them.
      context: devices that split every sequence (context parallelism); 1 for none.
      expert: devices that split a mixture of experts' experts (and each replica's sequences
        outside them); 1 for none.
      attention: how attention crosses a context axis (``context > 1``): ``"ring"`` (K/V
        blocks passed round) or ``"all_to_all"`` (heads over the axis); None without one.
      zero_stage: 0 (replicated optimizer state), 1, 2 or 3 (ZeRO; 3 also shards parameters).
      schedule: ``"gpipe"``, ``"1f1b"``, ``"circular"``, ``"interleaved"`` or ``"zerobubble"``
        when ``stage > 1``, else None.
      microbatches: the pipeline's micro-batches per replica batch (``stage > 1``).
      repeats: virtual stages per device (``"circular"``; ``"interleaved"``, at least 2).
      accumulate_steps: gradient accumulation micro-steps (no pipeline).
      remat: what each layer keeps for the backward pass: ``False`` (``"none"``) all its
        activations, ``"dots"`` its products' outputs, ``True`` (``"full"``) its input only,
        recomputing the layer.
      hybrid: ZeRO splits over ``data`` only, inside each slice, whole on every one (hybrid
        ZeRO: ``zero_axes=("data",)``); needs ``dcn_data > 1``, ZeRO and no pipeline.

    >>> Layout(data=2, stage=4, schedule="1f1b", microbatches=8, remat=True)
    Layout(data=2 stage=4 1f1b M=8 remat)
    >>> Layout(data=2, stage=4, schedule="interleaved", microbatches=8, repeats=2)
    Layout(data=2 stage=4 interleaved V=2 M=8)
    >>> Layout(data=8, remat="dots")
    Layout(data=8 remat=dots)
    >>> Layout(data=8, zero_stage=3).mesh_shape
    {'data': 8}
    >>> Layout(data=2, context=4)
    Layout(data=2 context=4 ring)
    >>> Layout(data=2, expert=4, zero_stage=1).mesh_shape
    {'data': 2, 'expert': 4}
    >>> Layout(dcn_data=4, data=8, zero_stage=3)
    Layout(dcn_data=4 data=8 zero=3)
    >>> Layout(dcn_data=4, data=8).mesh_shape, Layout(dcn_data=4, data=8).num_devices
    ({'dcn_data': 4, 'data': 8}, 32)
    >>> Layout(dcn_data=4, data=8, zero_stage=3, hybrid=True).zero_shards
    8
    """

    data: int = 1
    stage: int = 1
    model: int = 1
    context: int = 1
    expert: int = 1
    attention: str | None = None
    zero_stage: int = 0
    schedule: str | None = None
    microbatches: int = 1
    repeats: int = 1
    accumulate_steps: int = 1
    remat: bool | str = False
    dcn_data: int = 1
    hybrid: bool = False

    def __post_init__(self) -> None:
        for name in ("data", "dcn_data", "stage", "model", "context", "expert", "microbatches",
                     "repeats", "accumulate_steps"):  # fmt: skip
            positive_int(getattr(self, name), api="Layout", name=name)
        self._check_token_axes()
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"Layout: zero_stage must be 0, 1, 2 or 3; got {self.zero_stage!r}.")
        if self.stage > 1 and self.schedule not in SCHEDULES:
            raise ValueError(
                f"Layout: stage={self.stage} needs a schedule, one of {', '.join(SCHEDULES)}; "
                f"got {self.schedule!r}."
            )
        if self.stage == 1 and (self.schedule is not None or self.microbatches != 1):
            raise ValueError(
                "Layout: schedule and microbatches are for pipelines (stage > 1); use "
                "accumulate_steps to split a replica's batch without one."
            )
        if self.stage > 1 and self.accumulate_steps != 1:
            raise ValueError(
                "Layout: a pipeline splits the batch into its micro-batches; use microbatches, "
                "not accumulate_steps, with stage > 1."
            )
        if self.repeats != 1 and self.schedule not in VIRTUAL:
            raise ValueError(
                f"Layout: repeats (virtual stages) are for the circular and interleaved "
                f"schedules; got repeats={self.repeats} with schedule={self.schedule!r}."
            )
        if self.schedule == "interleaved" and self.repeats < 2:
            raise ValueError(
                f"Layout: the interleaved schedule needs repeats >= 2 (virtual stages per "
                f"device); got repeats={self.repeats}. Use repeats=2, or schedule='1f1b'."
            )
        object.__setattr__(self, "remat", remat_policy(self.remat, "Layout"))
        if self.hybrid and (self.dcn_data == 1 or not self.zero_stage or self.stage > 1):
            raise ValueError(
                f"Layout: hybrid=True splits ZeRO inside each slice: it needs dcn_data > 1, "
                f"zero_stage >= 1 and no pipeline; got dcn_data={self.dcn_data}, "
                f"zero_stage={self.zero_stage}, stage={self.stage}."
            )

    def _check_token_axes(self) -> None:
        """The attention goes with a context axis (ring unless told). What the library cannot
        run (a ring under 1F1B, context with expert) is `enumerate_layouts`' to leave out; a
        `Layout` given to `rp.plan` by hand is compiled and refused with the library's reason."""
        if self.context > 1 and self.attention is None:
            object.__setattr__(self, "attention", "ring")
        if self.context == 1 and self.attention is not None:
            raise ValueError(
                f"Layout: attention={self.attention!r} is how attention crosses a context axis; "
                f"give context > 1 with it, or leave attention=None."
            )
        if self.attention is not None and self.attention not in ATTENTIONS:
            raise ValueError(
                f"Layout: attention must be one of {', '.join(map(repr, ATTENTIONS))}; got "
                f"{self.attention!r}."
            )

    @property
    def num_devices(self) -> int:
        """The devices the layout spans: the product of its axes."""
        return self.dcn_data * self.data * self.stage * self.expert * self.context * self.model

    @property
    def replicas(self) -> int:
        """The data replicas over all slices (``dcn_data x data``): the batch's split, and
        ZeRO's."""
        return self.dcn_data * self.data

    @property
    def zero_shards(self) -> int:
        """The devices ZeRO splits a leaf over: ``data`` (hybrid) or every replica."""
        return self.data if self.hybrid else self.replicas

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh: ``dcn_data`` when larger than 1, ``data`` always, then ``stage``,
        ``expert``, ``context`` and ``model`` (the order `Replicator` lays them out in) when
        larger than 1."""
        shape = {"dcn_data": self.dcn_data} if self.dcn_data > 1 else {}
        shape["data"] = self.data
        for axis in ("stage", "expert", "context", "model"):
            if getattr(self, axis) > 1:
                shape[axis] = getattr(self, axis)
        return shape

    @property
    def kind(self) -> tuple[bool, bool, bool, bool]:
        """Which of ``stage``, ``model``, ``context`` and ``expert`` it has (larger than 1): the
        planner's kinds of layout, which its prices rank less well than layouts of one kind."""
        return tuple(getattr(self, a) > 1 for a in ("stage", "model", "context", "expert"))

    def __str__(self) -> str:
        parts = [f"dcn_data={self.dcn_data}"] if self.dcn_data > 1 else []
        parts.append(f"data={self.data}")
        if self.stage > 1:
            parts.append(f"stage={self.stage} {self.schedule}")
            if self.repeats > 1:
                parts.append(f"V={self.repeats}")
            parts.append(f"M={self.microbatches}")
        if self.expert > 1:
            parts.append(f"expert={self.expert}")
        if self.context > 1:
            parts.append(f"context={self.context} {self.attention}")
        if self.model > 1:
            parts.append(f"model={self.model}")
        if self.zero_stage:
            parts.append(f"zero={self.zero_stage}" + (" hybrid" if self.hybrid else ""))
        if self.accumulate_steps > 1:
            parts.append(f"accum={self.accumulate_steps}")
        if self.remat:
            parts.append("remat" if self.remat is True else f"remat={self.remat}")
        return " ".join(parts)

    def __repr__(self) -> str:
        return f"Layout({self})"

    def to_dict(self) -> dict:
        """The layout's fields as a dict: ``Layout(**layout.to_dict()) == layout``."""
        return dataclasses.asdict(self)


def remat_policy(value: object, api: str) -> bool | str:
    """``False``, ``"dots"``, a policy by activation name or ``True`` for a remat setting (the
    policy names included).

    A policy by name is a preset's name (MaxText's, `replicator._src.pipeline.remat.PRESETS`)
    or a config's own choice per activation, a mapping ``{activation: "save" | "offload" |
    "recompute"}`` or the same written ``"activation=action,..."``, which becomes that string
    with its names sorted and the recomputed ones left out (`by_name`).

    >>> remat_policy({"query_proj": "offload", "decoder_layer_input": "offload"}, "f")
    'decoder_layer_input=offload,query_proj=offload'
    """
    named = {"none": False, "full": True, False: False, True: True,
             **{r: r for r in REMATS if isinstance(r, str)}}  # fmt: skip
    if isinstance(value, (bool, str)) and value in named:
        return named[value]
    if isinstance(value, (str, dict)):
        from replicator._src.pipeline import remat as remat_lib  # its names and actions

        if isinstance(value, str) and value in remat_lib.PRESETS:
            return value
        if isinstance(value, dict) or "=" in value:
            return by_name(value, api)
    raise ValueError(
        f"{api}: remat must be False ('none'), 'dots', "
        f"{', '.join(repr(r) for r in REMATS if isinstance(r, str) and r != 'dots')}, another "
        f"preset, a mapping {{activation: action}} or True ('full'); got {value!r}."
    )


def by_name(value: dict | str, api: str) -> str | bool:
    """A policy per activation as the planner keeps it: ``"name=save|offload,..."``, sorted by
    name, the recomputed activations left out (True, full remat, if that leaves none)."""
    from replicator._src.pipeline import remat as remat_lib

    if isinstance(value, str):
        pairs = [part.split("=", 1) for part in value.split(",") if part]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"{api}: remat {value!r}: write activation=action,...")
        value = dict(pairs)
    policy = remat_lib.as_remat(value, api)  # checks each name and action
    return str(policy) if policy.actions else True


def actions_of(remat: str) -> dict[str, str]:
    """``{activation: "save" | "offload"}`` of a policy kept as `by_name` writes it."""
    return dict(part.split("=", 1) for part in remat.split(",") if part)


def offloads(remat: object) -> bool:
    """Whether the policy keeps activations in host memory (no pipeline does)."""
    if not isinstance(remat, str) or remat == "dots":
        return False
    if remat in OFFLOADING or "=offload" in remat:
        return True
    from replicator._src.pipeline import remat as remat_lib

    return bool(remat_lib.PRESETS.get(remat, ((), ()))[1])


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Layouts that differ only in what they trade memory for, in the order to try them.

    The planner climbs a ladder from its fastest layout to its most frugal and stops at the
    first that fits: the layouts after it take at least as long under the time model.
    `enumerate_layouts` makes the ladders of a model; a `Layout` given to `plan` alone is a
    ladder of one.

    Attributes:
      groups: the layouts, in groups tried in order (no rematerialisation, then ``"dots"``,
        then full); inside a group each layout needs no more memory than the one before it
        (more accumulation steps), so the first that fits is found by bisection.
      tries: with a number, the search stops once that many of its layouts have compiled (a
        layout the compiler refuses does not count); None tries every group.

    >>> ladder = Ladder(((Layout(data=8), Layout(data=8, accumulate_steps=2)),
    ...                  (Layout(data=8, remat=True),)))
    >>> str(ladder), len(ladder.layouts)
    ('data=8', 3)
    """

    groups: tuple[tuple[Layout, ...], ...]
    tries: int | None = None

    @property
    def layouts(self) -> list[Layout]:
        """Every layout of the ladder, in the order it is tried."""
        return [layout for group in self.groups for layout in group]

    def __str__(self) -> str:
        return str(self.groups[0][0])


def chunks_at(layout: Layout, moe_chunks: int, loss_chunks: int) -> tuple[int, int]:
    """A config's ``moe_chunks`` and ``loss_chunks`` on ``layout``: with accumulation, each
    micro-batch in as many fewer chunks (at least 1), so that a chunk holds what the config's
    does. The planner prices and builds a layout with them, and writes them in its config.

    >>> chunks_at(Layout(data=8, accumulate_steps=2), 4, 8), chunks_at(Layout(data=8), 4, 8)
    ((2, 4), (4, 8))
    """
    steps = layout.accumulate_steps if layout.stage == 1 else 1
    return max(1, moe_chunks // steps), max(1, loss_chunks // steps)


def schedule_of(name: str, repeats: int = 1) -> schedules_lib.Schedule:
    """The schedule a layout names (`SCHEDULES`), with ``repeats`` virtual stages for the
    circular and interleaved ones.

    >>> schedule_of("interleaved", 2)
    Interleaved1F1B(repeats=2)
    """
    cls = type(schedules_lib.get(name))
    return cls(repeats=repeats) if name in VIRTUAL else cls()
