"""Layouts: how a model's training step is spread over N devices, and which ones are worth trying.

A `Layout` fixes the mesh (``data`` x ``stage`` x ``expert`` x ``context`` x ``model``), the
attention over a context axis, the ZeRO stage, the pipeline schedule with its micro-batches,
gradient accumulation and rematerialisation. `enumerate_layouts`
lists the layouts of N devices that the model's sizes allow, grouped into *families*: layouts
that differ only in how much memory they trade for time (accumulation steps, rematerialisation).
Within a family the planner compiles the fastest first and stops at the first that fits, since
the others take at least as long under the time model (more FLOPs, or the same FLOPs in smaller
pieces with no less communication).

This module is plain Python: no JAX, nothing compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from replicator._src.core.errors import positive_int
from replicator._src.pipeline import schedules as schedules_lib
from replicator._src.planner.token_axes import ATTENTIONS, MIN_CONTEXT_SEQ, token_splits

SCHEDULES = ("gpipe", "1f1b", "circular", "interleaved", "zerobubble")
# The schedules with virtual stages: ``repeats`` per device, the layers split into stage x repeats.
VIRTUAL = ("circular", "interleaved")
# What each layer keeps for its backward pass, least recompute first: the pipelines' and the
# GPT's remat policies ("none", "dots", "full"), as False, "dots", True.
REMATS = (False, "dots", True)
ZERO_STAGES = (0, 1, 2, 3)
# Schedules that run each stage's work under its own lax.cond: a ring's collective-permute must
# be reached by every device, so ring attention over a context axis runs under the others only.
GATED = ("1f1b", "interleaved", "zerobubble")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a training step on ``data * stage * expert * context * model`` devices.

    Attributes:
      data: replicas: the batch is split over them.
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

    def __post_init__(self) -> None:
        for name in ("data", "stage", "model", "context", "expert", "microbatches", "repeats",
                     "accumulate_steps"):  # fmt: skip
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
        object.__setattr__(self, "remat", _remat(self.remat, "Layout"))

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
        return self.data * self.stage * self.expert * self.context * self.model

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh: ``data`` always, then ``stage``, ``expert``, ``context`` and ``model``
        (the order `Replicator` lays them out in) when larger than 1."""
        shape = {"data": self.data}
        for axis in ("stage", "expert", "context", "model"):
            if getattr(self, axis) > 1:
                shape[axis] = getattr(self, axis)
        return shape

    def __str__(self) -> str:
        parts = [f"data={self.data}"]
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
            parts.append(f"zero={self.zero_stage}")
        if self.accumulate_steps > 1:
            parts.append(f"accum={self.accumulate_steps}")
        if self.remat:
            parts.append("remat" if self.remat is True else f"remat={self.remat}")
        return " ".join(parts)

    def __repr__(self) -> str:
        return f"Layout({self})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _remat(value: object, api: str) -> bool | str:
    """``False``, ``"dots"`` or ``True`` for a remat setting (the policy names included)."""
    named = {"none": False, "full": True, "dots": "dots", False: False, True: True}
    if isinstance(value, (bool, str)) and value in named:
        return named[value]
    raise ValueError(
        f"{api}: remat must be False ('none'), 'dots' or True ('full'); got {value!r}."
    )


def divisors(n: int) -> list[int]:
    """``n``'s divisors in increasing order.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(
    num_devices: int,
    *,
    global_batch: int,
    num_layers: int,
    num_heads: int | None = None,
    hidden: int | None = None,
    schedules: Sequence[str] = SCHEDULES,
    zero_stages: Sequence[int] = ZERO_STAGES,
    microbatches: Sequence[int] | None = None,
    repeats: int = 2,
    accumulate_steps: Sequence[int] | None = None,
    remat: Sequence[bool | str] = REMATS,
    max_model: int | None = None,
    max_stage: int | None = None,
    seq_len: int | None = None,
    d_model: int | None = None,
    attention: Sequence[str] = ATTENTIONS,
    zigzag: bool = True,
    min_context_seq: int = MIN_CONTEXT_SEQ,
    max_context: int | None = None,
    num_experts: int = 0,
    max_expert: int | None = None,
) -> list[Ladder]:
    """The layouts of ``num_devices`` devices that a model's sizes allow, in families.

    Every ``data x stage x expert x context x model = num_devices`` split is tried where
    ``model`` divides ``num_heads`` and ``hidden``, ``stage`` (times ``repeats`` for the
    circular and interleaved schedules) divides ``num_layers``, and ``data`` divides
    ``global_batch``. A pipeline's micro-batches must divide the replica's batch and satisfy the
    schedule (1F1B, ZeroBubble and circular need at least ``stage`` of them; interleaved a
    multiple of ``stage``). ZeRO-2 differs from ZeRO-1 only with gradient accumulation, so it is
    listed only with ``accumulate_steps > 1``.

    **Context axes** (sequence splits) are tried for a model whose sequences are long enough
    to matter: ``seq_len`` at least ``min_context_seq`` tokens (512 by default) and at least
    ``d_model`` (when given). Per layer a sequence's activations grow as ``seq_len x d_model``
    and its weights as ``12 d_model^2``, and attention's share of the FLOPs is about ``seq_len
    / 6 d_model``: below that length splitting the weights (``model``, ZeRO) or the batch
    saves as much for less communication, and the sequence split is not worth its compiles.
    Then every ``context`` ``C >= 2`` that divides ``num_devices`` and ``seq_len``, up to
    ``max_context``, with at least ``token_axes.MIN_CONTEXT_CHUNK`` (64) tokens per device, is
    tried with each ``attention`` the model allows: ``"ring"`` where ``seq_len`` divides into
    ``2 C`` chunks (``C`` without ``zigzag``), under no pipeline or the GPipe and circular
    schedules only (the others run each stage under its own cond, where a ring cannot);
    ``"all_to_all"`` where the heads of each ``model`` device divide by ``C``.

    **Expert axes** are tried for a mixture-of-experts model (``num_experts > 0``): every
    ``expert`` that divides ``num_experts`` and ``num_devices`` (1 included), up to
    ``max_expert``, where each micro-batch of a replica divides by it (the axis splits the
    replica's sequences). Such a model gets no pipeline (it has no stage layout) and no context
    axis (the library runs context and expert axes not together); a dense model gets no expert
    axis.

    A `Ladder` holds the layouts of one mesh, ZeRO stage, schedule and micro-batch count that
    trade memory for time, fastest first: without rematerialisation, then recomputing what the
    products' outputs do not keep (``"dots"``), then whole layers (more FLOPs each time);
    within each, fewer accumulation steps, then more (the same FLOPs in smaller pieces, no less
    communication, and less memory). The planner takes the first that fits.

    Args:
      num_devices: N.
      global_batch: examples per step, over all replicas.
      num_layers: the layers a pipeline splits into stages.
      num_heads: attention heads (``model`` must divide them); None: no constraint.
      hidden: MLP hidden units (``model`` must divide them); None: no constraint.
      schedules: the pipeline schedules to try.
      zero_stages: the ZeRO stages to try.
      microbatches: pipeline micro-batch counts to try; default ``2 stage`` and ``4 stage``
        where the replica batch and the schedule allow them, else the largest that is allowed.
      repeats: the circular and interleaved schedules' virtual stages per device
        (interleaved: at least 2).
      accumulate_steps: accumulation steps to try without a pipeline; default every power of
        2 that divides the replica batch.
      remat: the rematerialisation policies to try, for every schedule: ``False`` (none),
        ``"dots"``, ``True`` (full).
      max_model: the largest ``model`` axis to try (e.g. the devices of one node).
      max_stage: the largest ``stage`` axis to try.
      seq_len: the tokens of each sequence; None: no context axis.
      d_model: the model's width: context axes need ``seq_len >= d_model``; None: no such
        constraint.
      attention: how attention may cross a context axis: ``"ring"``, ``"all_to_all"``.
      zigzag: the model lays a ring's sequence out in ``2 C`` chunks (the GPT's default).
      min_context_seq: the shortest ``seq_len`` for which context axes are tried.
      max_context: the largest ``context`` axis to try.
      num_experts: the mixture-of-experts blocks' experts; 0 for a dense model.
      max_expert: the largest ``expert`` axis to try.

    Returns:
      The families, each with at least one layout.

    >>> families = enumerate_layouts(8, global_batch=16, num_layers=4, num_heads=4)
    >>> [str(group[0]) for group in families[0].groups]
    ['data=8', 'data=8 remat=dots', 'data=8 remat']
    >>> len(families), sum(len(f.layouts) for f in families)
    (114, 405)
    >>> long = enumerate_layouts(8, global_batch=16, num_layers=4, num_heads=4, seq_len=512,
    ...                          schedules=("1f1b",), zero_stages=(1,), max_model=1)
    >>> sorted({(lay.context, lay.attention, lay.schedule) for f in long for lay in f.layouts
    ...         if lay.context > 1}, key=str)  # 4 heads: no all_to_all over 8; no ring in 1F1B
    [(2, 'all_to_all', '1f1b'), (2, 'all_to_all', None), (2, 'ring', None), \
(4, 'all_to_all', '1f1b'), (4, 'all_to_all', None), (4, 'ring', None), (8, 'ring', None)]
    """
    api = "enumerate_layouts"
    n = positive_int(num_devices, api=api, name="num_devices")
    batch = positive_int(global_batch, api=api, name="global_batch")
    layers = positive_int(num_layers, api=api, name="num_layers")
    rematerialise = _check_choices(api, schedules, zero_stages, repeats, remat)
    splits = token_splits(
        api, n, seq_len=seq_len, attention=attention, zigzag=zigzag,
        min_context_seq=max(min_context_seq, d_model or 0), max_context=max_context,
        num_experts=num_experts, max_expert=max_expert,
    )  # fmt: skip
    families: list[Ladder] = []
    for expert, context, attn in splits:
        rest = n // (expert * context)
        for model in divisors(rest):
            if max_model is not None and model > max_model:
                continue
            if any(size is not None and size % model for size in (num_heads, hidden)):
                continue
            if attn == "all_to_all" and num_heads is not None and (num_heads // model) % context:
                continue
            for stage in divisors(rest // model):
                if (max_stage is not None and stage > max_stage) or layers % stage:
                    continue
                if stage > 1 and num_experts:  # the mixture-of-experts GPT has no pipeline
                    continue
                data = rest // (model * stage)
                if batch % data or (batch // data) % expert:
                    continue
                per_replica = batch // data
                mesh = dict(data=data, stage=stage, model=model, context=context, expert=expert,
                            attention=attn)  # fmt: skip
                if stage == 1:
                    families += _plain_families(
                        mesh, per_replica, accumulate_steps, zero_stages, rematerialise
                    )
                    continue
                families += _pipeline_families(
                    mesh, layers, per_replica, schedules, microbatches, repeats, zero_stages,
                    rematerialise,
                )  # fmt: skip
    return families


def _pipeline_families(
    mesh: dict, layers: int, per_replica: int, schedules: Sequence[str],
    microbatches: Sequence[int] | None, repeats: int, zero_stages: Sequence[int],
    rematerialise: Sequence[bool | str],
) -> list[Ladder]:  # fmt: skip
    """The families of a pipelined mesh: one per schedule (no ring attention under a schedule
    of per-stage conds), micro-batch count and ZeRO stage, its layouts the remat policies."""
    gated = GATED if mesh["attention"] == "ring" else ()
    families = []
    for schedule in (s for s in schedules if s not in gated):
        v = repeats if schedule in VIRTUAL else 1
        if layers % (mesh["stage"] * v):
            continue
        for m in _microbatch_options(schedule, mesh["stage"], per_replica, microbatches, v):
            for zero in zero_stages:
                if zero == 2:  # no accumulation in a pipeline: ZeRO-1's program
                    continue
                groups = tuple(
                    (Layout(**mesh, zero_stage=zero, schedule=schedule, microbatches=m,
                            repeats=v, remat=r),)
                    for r in rematerialise
                )  # fmt: skip
                families.append(Ladder(groups))
    return families


def _plain_families(
    mesh: dict, per_replica: int, accumulate_steps: Sequence[int] | None,
    zero_stages: Sequence[int], rematerialise: Sequence[bool | str],
) -> list[Ladder]:  # fmt: skip
    """The families of a mesh without a pipeline: one per ZeRO stage, its layouts the
    accumulation steps (each micro-batch of a replica divisible by the expert axis) under each
    remat policy."""
    accums = accumulate_steps
    if accums is None:
        accums = [2**i for i in range(per_replica.bit_length())]
    expert = mesh["expert"]
    accums = sorted({a for a in accums if a >= 1 and per_replica % a == 0
                     and (per_replica // a) % expert == 0})  # fmt: skip
    families = []
    for zero in zero_stages:
        steps = [a for a in accums if a > 1] if zero == 2 else accums
        groups = tuple(
            tuple(Layout(**mesh, zero_stage=zero, accumulate_steps=a, remat=r) for a in steps)
            for r in rematerialise
        )
        if steps:
            families.append(Ladder(groups))
    return families


def _check_choices(
    api: str, schedules: Sequence[str], zero_stages: Sequence[int], repeats: int,
    remat: Sequence[bool | str],
) -> list[bool | str]:  # fmt: skip
    """Refuses unknown schedules, ZeRO stages and remat policies, and an interleaved schedule
    with fewer than 2 repeats; the remat policies asked for, in `REMATS` order."""
    positive_int(repeats, api=api, name="repeats")
    for name, values, valid in (
        ("schedules", schedules, SCHEDULES),
        ("zero_stages", zero_stages, ZERO_STAGES),
    ):
        bad = [v for v in values if v not in valid]
        if bad or not values:
            raise ValueError(
                f"{api}: {name}={list(values)!r}; choose one or more of "
                f"{', '.join(map(repr, valid))}."
            )
    if "interleaved" in schedules and repeats < 2:
        raise ValueError(
            f"{api}: the interleaved schedule needs repeats >= 2 (virtual stages per device); got "
            f"repeats={repeats}. Use repeats=2 or more, or leave 'interleaved' out of schedules."
        )
    asked = {_remat(r, api) for r in remat}
    rematerialise = [r for r in REMATS if r in asked]
    if not rematerialise:
        raise ValueError(f"{api}: remat must hold False, 'dots' or True; got {list(remat)!r}.")
    return rematerialise


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Layouts that differ only in what they trade memory for, in the order to try them.

    ``groups`` are tried in order (no rematerialisation, then rematerialisation); inside a group
    each layout needs no more memory than the one before it (more accumulation steps), so the
    first that fits is found by bisection.
    """

    groups: tuple[tuple[Layout, ...], ...]

    @property
    def layouts(self) -> list[Layout]:
        return [layout for group in self.groups for layout in group]

    def __str__(self) -> str:
        return str(self.groups[0][0])


def schedule_of(name: str, repeats: int = 1) -> schedules_lib.Schedule:
    """The schedule a layout names (`SCHEDULES`), with ``repeats`` virtual stages for the
    circular and interleaved ones.

    >>> schedule_of("interleaved", 2)
    Interleaved1F1B(repeats=2)
    """
    cls = type(schedules_lib.get(name))
    return cls(repeats=repeats) if name in VIRTUAL else cls()


def _microbatch_options(
    schedule: str, stage: int, per_replica: int, microbatches: Iterable[int] | None, v: int
) -> list[int]:
    """The micro-batch counts to try: ``microbatches``, or ``2 stage`` and ``4 stage`` (the
    bubble falls with M and, for 1F1B, so does the memory), else the largest M the replica
    batch and the schedule allow; each must divide the replica batch and suit the schedule."""
    sched = schedule_of(schedule, v)

    def valid(m: int) -> bool:
        if m < 1 or per_replica % m:
            return False
        try:
            sched.timetable(stage, m)
        except ValueError:  # the schedule's own rule (e.g. 1F1B needs M >= K)
            return False
        return True

    if microbatches is not None:
        return sorted({int(m) for m in microbatches if valid(int(m))})
    wanted = [m for m in (2 * stage, 4 * stage) if valid(m)]
    if wanted:
        return wanted
    fallback = [m for m in range(per_replica, 0, -1) if valid(m)]
    return fallback[:1]
