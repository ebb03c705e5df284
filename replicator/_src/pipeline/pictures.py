"""Pictures of pipeline schedules: an ASCII grid of ticks, a Gantt chart to scale, a PNG.

`render` draws a `schedules.Timetable` one column per tick; with ``costs`` (`timing.StageCosts`) it
draws the ticks to scale on a common time axis instead, each tick as long as its modelled
duration (`timing.step_time`) and each pass as long as it takes.
"""

from __future__ import annotations

import math

import numpy as np

from replicator._src.pipeline import timing
from replicator._src.pipeline.schedules import Schedule, Timetable, get

_PHASES = "FBW"


def _label(kind: str, i: int, r: int, repeats: int) -> str:
    if i < 0:
        return ""
    if repeats == 1:
        return f"{kind}{i}"
    return f"{kind}{i}{chr(ord('a') + r)}" if repeats <= 26 else f"{kind}{i}.{r}"


def _passes(plan: Timetable) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(table, repeat)`` ``[C, K]`` of the F, B and W phases of each column, as run."""
    cf, cfr, cb, cbr, cw = timing.columns(plan)
    return [(cf, cfr), (cb, cbr), (cw, np.zeros_like(cw))]


def _cell(passes, c: int, s: int, v: int) -> list[str]:
    """The labels of the passes stage ``s`` runs in column ``c``, in phase order."""
    return [_label(p, int(t[c, s]), int(r[c, s]), v) for p, (t, r) in zip(_PHASES, passes)]


def _split(plan: Timetable) -> bool:
    return bool((plan.wgt >= 0).any())


def _summary(plan: Timetable) -> str:
    k, m, v, t = plan.num_stages, plan.num_microbatches, plan.repeats, plan.num_ticks
    costs = "(f=1, b=1, w=1)" if _split(plan) else "(f=1, b=2)"
    return (
        f"schedule={plan.schedule} K={k} M={m} V={v} ticks={t} "
        f"bubble={plan.bubble_fraction():.4f} {costs}"
    )


def _legend(plan: Timetable, scaled: bool = False) -> str:
    text = "legend: F3 = forward of micro-batch 3, B3 = its backward, . = idle (bubble)"
    if _split(plan):
        text = (
            "legend: F3 = forward of micro-batch 3, B3 = its input-gradient pass, W3 = its "
            "weight-gradient pass, . = idle (bubble)"
        )
    if 1 < plan.repeats <= 26:
        text += "; the letter is the repeat (a = virtual stage 0 of the device, b = 1, ...)"
    elif plan.repeats > 26:
        text += "; the number after the dot is the repeat (virtual stage of the device)"
    if scaled:
        return text + "; [F3--] spans the pass's modelled time, a tick lasts as its busiest stage"
    if _split(plan):
        return text + "; F5B1W0 = passes of 5, 1 and 0 in the same tick, in that order"
    if (plan.bwd >= 0).any():
        return text + "; F5B1 = forward of 5 and backward of 1 in the same tick"
    t = plan.num_ticks
    return text + f"; ticks 0-{t - 1} forward, {t}-{2 * t - 1} backward (the forward replayed)"


def _modelled(plan: Timetable, st: timing.StepTime) -> str:
    return (
        f"modelled: time={st.time:.6g} {st.unit}, bubble={st.bubble_fraction:.4f}, "
        f"work per device=[{', '.join(f'{w:.6g}' for w in st.work)}], "
        f"dataflow_time={st.dataflow_time:.6g} "
        f"(without tick barriers)"
    )


def render(
    schedule_or_plan: Timetable | Schedule | str,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    *,
    path: str | None = None,
    width: int | None = None,
    costs: timing.StageCosts | None = None,
) -> str:
    """A picture of a schedule: an ASCII grid, and optionally a PNG drawn with matplotlib.

    One row per stage, one column per tick. A cell shows ``F3`` (forward of micro-batch 3),
    ``B3`` (its backward; ZeroBubble's input-gradient pass), ``W3`` (ZeroBubble's
    weight-gradient pass), ``F5B1`` or ``F5B1W0`` (several passes in one tick, in that order)
    and, for Circular, the repeat as a letter (``F3b``: repeat 1); ``.`` is idle. GPipe and
    Circular show the forward ticks followed by the backward (the forward ticks mirrored). A
    legend and a summary line with the modelled bubble (equal costs) follow.

    With ``costs`` the ticks are drawn to scale: a Gantt chart on a common time axis in which
    each tick is as wide as its modelled duration (its busiest stage's passes, see
    `timing.step_time`) and each pass, ``[F3--]``, as wide as its cost; a line with the
    modelled time and bubble follows.

    Args:
      schedule_or_plan: a :class:`Timetable`, or a schedule (object or name) with the sizes.
      num_stages: K, when a schedule is given.
      num_microbatches: M, when a schedule is given.
      path: if given, also save a PNG there (needs ``pip install "replicator[plot]"``).
      width: wrap the picture into blocks at most this many characters wide (each block
        repeats the stage labels and tick header). ``None``: one block, no wrapping.
      costs: each logical stage's costs (`timing.StageCosts`): draw the ticks to scale.

    Returns:
      The ASCII picture.

    >>> print(render("gpipe", 2, 2))
    tick     0  1  2  3  4  5
    stage 0  F0 F1 .  .  B1 B0
    stage 1  .  F0 F1 B1 B0 .
    legend: F3 = forward of micro-batch 3, B3 = its backward, . = idle (bubble); ticks 0-2 forward, 3-5 backward (the forward replayed)
    schedule=gpipe K=2 M=2 V=1 ticks=3 bubble=0.3333 (f=1, b=2)
    >>> from replicator._src.pipeline.timing import StageCosts
    >>> print(render("1f1b", 2, 2, costs=StageCosts.equal(2)))
    tick     0   1           2           3
    stage 0  [F0][F1]........[B0    ]....[B1    ]
    stage 1  ....[F0][B0    ][F1][B1    ]........
    legend: F3 = forward of micro-batch 3, B3 = its backward, . = idle (bubble); [F3--] spans the pass's modelled time, a tick lasts as its busiest stage
    schedule=1f1b K=2 M=2 V=1 ticks=4 bubble=0.3333 (f=1, b=2)
    modelled: time=9 units, bubble=0.3333, work per device=[6, 6], dataflow_time=9 (without tick barriers)
    """
    plan = _plan(schedule_or_plan, num_stages, num_microbatches)
    if costs is None:
        text = _grid(plan, width)
        step = None
    else:
        step = timing.step_time(plan, costs)
        text = _gantt(plan, step, width) + "\n" + _modelled(plan, step)
    if path is not None:
        _draw_png(plan, path, step)
    return text


def _plan(schedule_or_plan, num_stages, num_microbatches) -> Timetable:
    if isinstance(schedule_or_plan, Timetable):
        plan = schedule_or_plan
        for name, want in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
            if want is not None and want != getattr(plan, name):
                raise ValueError(
                    f"render: {name}={want} does not match the plan's "
                    f"{getattr(plan, name)}; omit it when passing a Timetable."
                )
        return plan
    if num_stages is None or num_microbatches is None:
        raise ValueError(
            "render: pass num_stages and num_microbatches with a schedule, "
            "e.g. render('1f1b', 4, 8), or pass a Timetable."
        )
    return get(schedule_or_plan).timetable(num_stages, num_microbatches)


def _blocks(header: str, rows: list[str], lw: int, per: int, cuts=None) -> str:
    """``rows`` (and the header) wrapped into blocks of at most ``per`` characters after the
    labels, cut at the last of ``cuts`` (character positions; default: every one) that fits."""
    n = max(len(header), *(len(r) for r in rows), 1)
    cuts = sorted({*(range(n) if cuts is None else cuts), n})
    out, lo = [], 0
    while lo < n:
        fits = [x for x in cuts if lo < x <= lo + per]
        hi = fits[-1] if fits else lo + per
        lines = ["tick".ljust(lw) + "  " + header[lo:hi]]
        lines += [f"stage {s}".ljust(lw) + "  " + r[lo:hi] for s, r in enumerate(rows)]
        out.append("\n".join(line.rstrip() for line in lines))
        lo = hi
    return "\n\n".join(out)


def _grid(plan: Timetable, width: int | None) -> str:
    passes, v = _passes(plan), plan.repeats
    ncol = passes[0][0].shape[0]
    cells = [
        ["".join(_cell(passes, c, s, v)) or "." for c in range(ncol)]
        for s in range(plan.num_stages)
    ]
    cw = max(len(str(ncol - 1)), *(len(x) for row in cells for x in row))
    lw = len(f"stage {plan.num_stages - 1}")
    per = ncol if width is None else max(1, (width - lw - 1) // (cw + 1))
    header = " ".join(str(c).ljust(cw) for c in range(ncol)) + " "
    rows = [" ".join(x.ljust(cw) for x in row) + " " for row in cells]
    text = _blocks(header, rows, lw, per * (cw + 1))
    return text + "\n" + _legend(plan) + "\n" + _summary(plan)


def _scale(plan: Timetable, step: timing.StepTime) -> float:
    """Characters per cost unit: the shortest pass fits ``[label]``, within a sane width."""
    passes, v = _passes(plan), plan.repeats
    ncol, k = passes[0][0].shape[0], plan.num_stages
    longest = max(len(x) for c in range(ncol) for s in range(k) for x in _cell(passes, c, s, v))
    times = step.phase_times[step.phase_times > 0]
    scale = (longest + 2) / times.min()
    return min(scale, 8 * ncol * (longest + 2) / step.time)


def _gantt(plan: Timetable, step: timing.StepTime, width: int | None) -> str:
    passes, v, k = _passes(plan), plan.repeats, plan.num_stages
    scale = _scale(plan, step)

    def at(x: float) -> int:
        return math.floor(x * scale + 0.5)

    total = at(step.time)
    lw = len(f"stage {k - 1}")
    per = total + 8 if width is None else max(1, width - lw - 2)
    rows = [["."] * total for _ in range(k)]
    header = [" "] * (total + 8)
    for c, t0 in enumerate(step.start):
        if step.tick_times[c] <= 0:
            continue
        mark = str(c)
        x = at(t0)
        if all(ch == " " for ch in header[max(x - 1, 0) : x + len(mark)]):
            header[x : x + len(mark)] = mark
        for s in range(k):
            t = t0
            for p, label in enumerate(_cell(passes, c, s, v)):
                d = step.phase_times[p, c, s]
                if label and d > 0:
                    a, b = at(t), max(at(t + d), at(t) + 1)
                    rows[s][a:b] = _box(label, b - a)
                t += d
    cuts = [at(t0) for t0 in step.start]
    text = _blocks("".join(header), ["".join(r)[:total] for r in rows], lw, per, cuts)
    return text + "\n" + _legend(plan, scaled=True) + "\n" + _summary(plan)


def _box(label: str, n: int) -> str:
    """``label`` in ``n`` characters: ``[F3--]``, cut to ``[F3`` or ``F3`` when short."""
    if n >= len(label) + 2:
        return "[" + label.ljust(n - 2, " " if n - 2 <= len(label) + 4 else "-") + "]"
    return ("[" + label)[:n] if n > len(label) else label[:n]


def _draw_png(plan: Timetable, path: str, step: timing.StepTime | None) -> None:
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise ImportError(
            'render(path=...) draws with matplotlib: pip install "replicator[plot]"'
        ) from e
    passes, k = _passes(plan), plan.num_stages
    ncol = passes[0][0].shape[0]
    span = ncol if step is None else step.time
    boxes = [
        box for c in range(ncol) for s in range(k) for box in _png_boxes(plan, passes, c, s, step)
    ]
    # A tick's passes share its cell: the rows grow with them, so that their digits keep the
    # size of a whole cell's.
    parts = max(n for *_, n in boxes)
    fig = Figure(figsize=(min(2 + 0.45 * ncol, 60), 1.2 + 0.55 * k * max(1.0, 0.75 * parts)))
    ax = fig.add_subplot()
    maps = [matplotlib.colormaps[n] for n in ("Blues", "Oranges", "Greens")]
    for box in boxes:
        _draw_box(ax, Rectangle, maps, plan, box)
    if not (plan.bwd >= 0).any():
        x = plan.num_ticks if step is None else step.start[plan.num_ticks]
        ax.axvline(x - 0.025 * span / ncol, color="black", linewidth=1)
    ax.set_xlim(0, span)
    ax.set_ylim(k, 0)
    ax.set_yticks(np.arange(k) + 0.475, [f"stage {s}" for s in range(k)])
    what = "blue: forward, orange: backward, " + ("green: W, " if _split(plan) else "")
    if step is None:
        ax.set_xticks(np.arange(ncol) + 0.475, [str(c) for c in range(ncol)], fontsize=8)
        ax.set_xlabel(f"tick ({what}grey: idle)")
        ax.set_title(_summary(plan), fontsize=9)
    else:
        ax.set_xlabel(f"modelled time, {step.unit} ({what}white: idle)")
        ax.set_title(_summary(plan) + "\n" + _modelled(plan, step), fontsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.tight_layout()
    where = ax.get_position()  # the axes in the figure, once laid out: points per data unit
    points = (
        72 * where.width * fig.get_figwidth() / span,
        72 * where.height * fig.get_figheight() / k,
    )
    for box in boxes:
        _draw_label(ax, plan, box, points)
    fig.savefig(path, dpi=120)


def _png_boxes(plan: Timetable, passes, c: int, s: int, step: timing.StepTime | None) -> list:
    """``(phase, i, r, x, y, w, h, parts)`` of the boxes of stage ``s`` in column ``c``."""
    parts = [(p, int(t[c, s]), int(r[c, s])) for p, (t, r) in enumerate(passes) if t[c, s] >= 0]
    if step is None:
        if not parts:
            return [(-1, 0, 0, c, s, 0.95, 0.95, 1)]
        h = 0.95 / len(parts)
        return [(p, i, r, c, s + n * h, 0.95, h, len(parts)) for n, (p, i, r) in enumerate(parts)]
    out, x = [], step.start[c]
    for p, i, r in parts:
        d = step.phase_times[p, c, s]
        out.append((p, i, r, x, s, d, 0.95, 1))
        x += d
    return out


def _shade(plan: Timetable, i: int, r: int) -> float:
    """The colour of micro-batch ``i`` in repeat ``r``: later ones darker."""
    m, v = plan.num_microbatches, plan.repeats
    return 0.3 + 0.5 * (r * m + i) / max(v * m - 1, 1)


def _draw_box(ax, rectangle, maps, plan: Timetable, box) -> None:
    p, i, r, x, y, w, h, _ = box
    if p < 0:
        ax.add_patch(rectangle((x, y), w, h, color="#eeeeee"))
        return
    color = maps[p](_shade(plan, i, r))
    ax.add_patch(rectangle((x, y), w, h, color=color, linewidth=0.3, ec="white"))


def _draw_label(ax, plan: Timetable, box, points: tuple[float, float]) -> None:
    """The micro-batch (and repeat) of ``box`` in its middle, as large as the box allows (at
    most 9 points): as wide as it is, and about half as tall; none where it would be smaller
    than 4 points (a pass drawn to scale that is too short)."""
    p, i, r, x, y, w, h, _ = box
    if p < 0:
        return
    text = _label(_PHASES[p], i, r, plan.repeats)[1:]
    width, height = w * points[0], h * points[1]
    size = min(9.0, 0.55 * height, 0.9 * width / (0.62 * len(text) + 0.3))
    if size < 4:
        return
    ax.text(
        x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size,
        color="white" if _shade(plan, i, r) > 0.6 else "black",
    )  # fmt: skip
