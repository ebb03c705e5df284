"""`enumerate_layouts`: the ladders of layouts of N devices that a model's sizes allow.

Every ``data x stage x expert x context x model`` split of the devices that the sizes allow,
each with the ZeRO stages, schedules, micro-batch counts, accumulation steps and remat policies
asked for, grouped into `Ladder`s: the layouts of one mesh, ZeRO stage, schedule and micro-batch
count that trade memory for time, fastest first.

This module is plain Python: no JAX, nothing compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from replicator._src.core.errors import positive_int
from replicator._src.planner.layouts import (
    GATED,
    VIRTUAL,
    Ladder,
    Layout,
    offloads,
    schedule_of,
)
from replicator._src.planner.options import AxisLimits, ModelSizes, SearchOptions, fold_deprecated
from replicator._src.planner.token_axes import token_splits


def divisors(n: int) -> list[int]:
    """``n``'s divisors in increasing order.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(
    num_devices: int,
    *,
    sizes: ModelSizes | None = None,
    search: SearchOptions | None = None,
    limits: AxisLimits | None = None,
    slices: int = 1,
    **deprecated: Any,
) -> list[Ladder]:
    """The layouts of ``num_devices`` devices that a model's sizes allow, as ladders.

    Every ``data x stage x expert x context x model = num_devices`` split is tried where
    ``model`` divides ``sizes.num_heads`` and ``sizes.hidden``, ``stage`` (times ``repeats``
    for the circular and interleaved schedules) divides ``sizes.num_layers``, and ``data``
    divides ``sizes.global_batch``. A pipeline's micro-batches must divide the replica's batch
    and satisfy the schedule (1F1B, ZeroBubble and circular need at least ``stage`` of them;
    interleaved a multiple of ``stage``). ZeRO-2 differs from ZeRO-1 only with gradient
    accumulation, so it is listed only with ``accumulate_steps > 1``.

    **Context axes** (sequence splits) are tried for a model whose sequences are long enough
    to matter: ``seq_len`` at least ``limits.min_context_seq`` tokens (512 by default) and at
    least ``d_model`` (when given). Per layer a sequence's activations grow as ``seq_len x
    d_model`` and its weights as ``12 d_model^2``, and attention's share of the FLOPs is about
    ``seq_len / 6 d_model``: below that length splitting the weights (``model``, ZeRO) or the
    batch saves as much for less communication, and the sequence split is not worth its
    compiles. Then every ``context`` ``C >= 2`` that divides ``num_devices`` and ``seq_len``,
    up to ``limits.max_context``, with at least ``token_axes.MIN_CONTEXT_CHUNK`` (64) tokens per
    device, is tried with each ``search.attention`` the model allows: ``"ring"`` where
    ``seq_len`` divides into ``2 C`` chunks (``C`` without ``zigzag``), under no pipeline or the
    GPipe and circular schedules only (the others run each stage under its own cond, where a
    ring cannot); ``"all_to_all"`` where the heads of each ``model`` device divide by ``C``.

    **Expert axes** are tried for a mixture-of-experts model (``num_experts > 0``): every
    ``expert`` that divides ``num_experts`` and ``num_devices`` (1 included), up to
    ``limits.max_expert``, where each micro-batch of a replica divides by it (the axis splits
    the replica's sequences). Such a model gets no pipeline (it has no stage layout) and no
    context axis (the library runs context and expert axes not together); a dense model gets
    no expert axis.

    A `Ladder` holds the layouts of one mesh, ZeRO stage, schedule and micro-batch count that
    trade memory for time, fastest first: without rematerialisation, then recomputing what the
    products' outputs do not keep (``"dots"``), then whole layers (more FLOPs each time);
    within each, fewer accumulation steps, then more (the same FLOPs in smaller pieces, no less
    communication, and less memory). The planner takes the first that fits.

    **Slices** (``slices > 1``: N devices in that many slices joined over the data-centre
    network) put the replicas across them: every layout has ``dcn_data = slices`` (the mesh's
    axis across slices), and the rest is laid out as above on the ``N / slices`` devices of a
    slice, with ``global_batch / slices`` sequences. ZeRO then shards over the replicas of every
    slice, as the library's data axes do; and each ladder with ZeRO and no pipeline comes again
    as hybrid ZeRO (``Layout.hybrid``: split inside each slice, whole on every one), which
    holds more a device and sends only the reduced gradients' mean across the slices.

    Args:
      num_devices: N (over all slices).
      sizes: the model's sizes that constrain the splits (`ModelSizes`).
      search: what to try on each mesh (`SearchOptions`); default every schedule, ZeRO stage,
        remat policy and attention.
      limits: the largest axes to try, and the shortest sequence for a context axis
        (`AxisLimits`); default no limit, 512 tokens.
      slices: the slices the N devices are in (each ``N / slices`` devices); default 1.
      **deprecated: the records' fields given as keywords (``global_batch=16``,
        ``max_model=8``, ...): accepted for one release, each with a ``DeprecationWarning``
        that names its record.

    Returns:
      The ladders, each with at least one layout.

    Raises:
      TypeError: without ``sizes``, or for a keyword no record has.
      ValueError: for a device count that is not an int >= 1, slices that do not divide it or
        the global batch, or an old keyword given with its record.

    >>> ladders = enumerate_layouts(8, sizes=ModelSizes(global_batch=16, num_layers=4,
    ...                                                 num_heads=4))
    >>> [str(group[0]) for group in ladders[0].groups]
    ['data=8', 'data=8 remat=dots', 'data=8 remat']
    >>> len(ladders), sum(len(ladder.layouts) for ladder in ladders)
    (114, 405)
    >>> long = enumerate_layouts(
    ...     8, sizes=ModelSizes(global_batch=16, num_layers=4, num_heads=4, seq_len=512),
    ...     search=SearchOptions(schedules=("1f1b",), zero_stages=(1,)),
    ...     limits=AxisLimits(max_model=1))
    >>> # 4 heads: no all_to_all over 8 devices; no ring under 1F1B
    >>> sorted({(lay.context, lay.attention, lay.schedule) for ladder in long
    ...         for lay in ladder.layouts if lay.context > 1}, key=str)
    [(2, 'all_to_all', '1f1b'), (2, 'all_to_all', None), (2, 'ring', None), \
(4, 'all_to_all', '1f1b'), (4, 'all_to_all', None), (4, 'ring', None), (8, 'ring', None)]
    """
    api = "enumerate_layouts"
    if deprecated:
        records = {"sizes": (ModelSizes, sizes), "search": (SearchOptions, search),
                   "limits": (AxisLimits, limits)}  # fmt: skip
        folded = fold_deprecated(api, deprecated, records, stacklevel=2)
        sizes, search, limits = folded["sizes"], folded["search"], folded["limits"]
    if sizes is None:
        raise TypeError(
            f"{api}() missing the keyword argument 'sizes': the model's sizes, e.g. "
            f"sizes=rp.planner.ModelSizes(global_batch=64, num_layers=24, num_heads=16)."
        )
    for name, value, cls in (("sizes", sizes, ModelSizes), ("search", search, SearchOptions),
                             ("limits", limits, AxisLimits)):  # fmt: skip
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{api}: {name} must be an rp.planner.{cls.__name__}; got {value!r}.")
    search = SearchOptions() if search is None else search
    limits = AxisLimits() if limits is None else limits
    n = positive_int(num_devices, api=api, name="num_devices")
    s = positive_int(slices, api=api, name="slices")
    if s == 1:
        return _ladders(n, sizes, search, limits)
    if n % s or sizes.global_batch % s:
        raise ValueError(
            f"{api}: {s} slices must divide num_devices={n} and the global batch "
            f"({sizes.global_batch} sequences): each slice holds as many devices and replicas; "
            f"give a global batch that is a multiple of {s}."
        )
    one = dataclasses.replace(sizes, global_batch=sizes.global_batch // s)
    out = []
    for ladder in _ladders(n // s, one, search, limits):
        for hybrid in (False, True):  # ZeRO over every slice, or inside each (hybrid)
            first = ladder.layouts[0]
            if hybrid and (not first.zero_stage or first.stage > 1):
                continue
            out.append(Ladder(tuple(
                tuple(dataclasses.replace(lay, dcn_data=s, hybrid=hybrid) for lay in group)
                for group in ladder.groups
            )))  # fmt: skip
    return out


def _ladders(n: int, sizes: ModelSizes, search: SearchOptions, limits: AxisLimits) -> list[Ladder]:
    """`enumerate_layouts`' ladders, its options checked."""
    splits = token_splits(
        n, seq_len=sizes.seq_len, attention=search.attention, zigzag=sizes.zigzag,
        min_context_seq=max(limits.min_context_seq, sizes.d_model or 0),
        max_context=limits.max_context, num_experts=sizes.num_experts,
        max_expert=limits.max_expert,
    )  # fmt: skip
    heads, batch, layers = sizes.num_heads, sizes.global_batch, sizes.num_layers
    ladders: list[Ladder] = []
    for expert, context, attn in splits:
        rest = n // (expert * context)
        for model in divisors(rest):
            if limits.max_model is not None and model > limits.max_model:
                continue
            if any(size is not None and size % model for size in (heads, sizes.hidden)):
                continue
            if attn == "all_to_all" and heads is not None and (heads // model) % context:
                continue
            for stage in divisors(rest // model):
                if (limits.max_stage is not None and stage > limits.max_stage) or layers % stage:
                    continue
                if stage > 1 and sizes.num_experts:  # the mixture-of-experts GPT: no pipeline
                    continue
                data = rest // (model * stage)
                if batch % data or (batch // data) % expert:
                    continue
                mesh = dict(data=data, stage=stage, model=model, context=context, expert=expert,
                            attention=attn)  # fmt: skip
                if stage == 1:
                    ladders += _plain_ladders(mesh, batch // data, search)
                else:
                    ladders += _pipeline_ladders(mesh, layers, batch // data, search)
    return ladders


def _pipeline_ladders(
    mesh: dict, layers: int, per_replica: int, search: SearchOptions
) -> list[Ladder]:
    """The ladders of a pipelined mesh: one per schedule (no ring attention under a schedule
    of per-stage conds), micro-batch count and ZeRO stage, its layouts the remat policies."""
    gated = GATED if mesh["attention"] == "ring" else ()
    ladders = []
    for schedule in (s for s in search.schedules if s not in gated):
        v = search.repeats if schedule in VIRTUAL else 1
        if layers % (mesh["stage"] * v):
            continue
        for m in _microbatch_options(schedule, mesh["stage"], per_replica, search.microbatches, v):
            for zero in search.zero_stages:
                if zero == 2:  # no accumulation in a pipeline: ZeRO-1's program
                    continue
                groups = tuple(
                    (Layout(**mesh, zero_stage=zero, schedule=schedule, microbatches=m,
                            repeats=v, remat=r),)
                    for r in search.remat
                    if not offloads(r)  # a pipeline keeps its residuals on the device
                )  # fmt: skip
                ladders.append(Ladder(groups))
    return ladders


def _plain_ladders(mesh: dict, per_replica: int, search: SearchOptions) -> list[Ladder]:
    """The ladders of a mesh without a pipeline: one per ZeRO stage, its layouts the
    accumulation steps (each micro-batch of a replica divisible by the expert axis) under each
    remat policy."""
    accums: Iterable[int] | None = search.accumulate_steps
    if accums is None:
        accums = [2**i for i in range(per_replica.bit_length())]
    expert = mesh["expert"]
    accums = sorted({a for a in accums if a >= 1 and per_replica % a == 0
                     and (per_replica // a) % expert == 0})  # fmt: skip
    ladders = []
    for zero in search.zero_stages:
        steps = [a for a in accums if a > 1] if zero == 2 else accums
        groups = tuple(
            tuple(Layout(**mesh, zero_stage=zero, accumulate_steps=a, remat=r) for a in steps)
            for r in search.remat
        )
        if steps:
            ladders.append(Ladder(groups))
    return ladders


def _microbatch_options(
    schedule: str, stage: int, per_replica: int, microbatches: Sequence[int] | None, v: int
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
