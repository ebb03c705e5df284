"""Figures of the benchmarks, drawn from the tables of BENCHMARKS.md.

Nothing is rerun: every figure reads the Markdown tables that ``BENCHMARKS.md`` publishes (what
the scripts in ``benchmarks/`` printed, with their commands and dates) and plots their cells, so
the figures always show the published numbers. Where a table gives an ideal or a formula (the
ZeRO paper's memory, a pipeline schedule's work limit, Megatron's bytes, ``1/C`` of one device's
memory and FLOPs), it is drawn beside the measured value.

    python benchmarks/plots.py --out /tmp/plots     # one PNG per figure, in FIGURES' order

``table(section, index)`` reads any table of the file as rows keyed by its header cells and
``number(cell)`` parses a cell, for figures of one's own. Needs matplotlib (the ``plot`` extra).
"""

import argparse
import pathlib
import re
import textwrap

from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator, ScalarFormatter, StrMethodFormatter

BENCHMARKS_MD = pathlib.Path(__file__).resolve().parents[1] / "BENCHMARKS.md"

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_RULE = re.compile(r"^\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?$")
_PIPE = re.compile(r"(?<!\\)\|")
_NUMBER = re.compile(
    r"^(?P<value>[-+]?(?:\d{1,3}(?:,\d{3})+|\d+|(?=\.\d))(?:\.\d+)?(?:[eE][-+]?\d+)?)"
    r"\s*(?P<unit>[A-Za-zµ%/]+)?\s*(?P<note>\(.*\)|\[.*\])?$"
)
_INTERVAL = re.compile(r"\[\s*([^,\]]+?)\s*,\s*([^\]]+?)\s*\]")

IDEAL = {"color": "white", "edgecolor": "0.3", "hatch": "///"}  # the style of an ideal's bar
HOLLOW = {"markerfacecolor": "none", "markeredgewidth": 1.5}  # a marker that shows one below it


# --- reading BENCHMARKS.md -----------------------------------------------------------------------


def _clean(text: str) -> str:
    """A cell or heading without its Markdown: backticks, bold and escaped pipes."""
    return text.replace("\\|", "|").replace("**", "").replace("`", "").strip()


def _unfenced(lines: list[str]) -> list[str]:
    """The lines with the contents of fenced code blocks blanked out."""
    out, fenced = [], False
    for line in lines:
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def _section(section: str, path) -> list[str]:
    """The lines under the first heading that starts with ``section``, up to the next heading of
    the same or a higher level."""
    lines = _unfenced(pathlib.Path(path).read_text(encoding="utf-8").splitlines())
    start = level = None
    headings = []
    for i, line in enumerate(lines):
        match = _HEADING.match(line)
        if not match:
            continue
        depth, text = len(match[1]), match[2]
        headings.append(_clean(text))
        if start is None and (text.startswith(section) or _clean(text).startswith(section)):
            start, level = i + 1, depth
        elif start is not None and depth <= level:
            return lines[start:i]
    if start is None:
        raise KeyError(
            f"no section {section!r} in {path}: no heading starts with it "
            f"(the headings: {'; '.join(headings)})"
        )
    return lines[start:]


def _cells(line: str) -> list[str]:
    line = line.strip()
    line = line[1:] if line.startswith("|") else line
    line = line[:-1] if line.endswith("|") and not line.endswith("\\|") else line
    return [_clean(cell) for cell in _PIPE.split(line)]


def _unique(header: list[str]) -> list[str]:
    """Header cells, a repeated one numbered from its second time: formula, formula.1, ..."""
    seen: dict[str, int] = {}
    out = []
    for name in header:
        out.append(f"{name}.{seen[name]}" if name in seen else name)
        seen[name] = seen.get(name, 0) + 1
    return out


def table(section: str, index: int = 0, path=BENCHMARKS_MD) -> list[dict[str, str]]:
    """The ``index``-th table under the heading of ``BENCHMARKS.md`` (or ``path``) that starts
    with ``section``.

    The section runs from the first heading whose text starts with ``section`` (as written, or
    without its backticks: ``"Pipeline schedules (benchmarks/pipeline.py)"``) to the next heading
    of the same or a higher level, so a ``##`` section's tables include those of its ``###``
    subsections. Each row is a dict keyed by the header cells, in the table's order; cells and
    keys are stripped of backticks, bold and escaped pipes (``\\|``). A header cell that repeats
    is numbered from its second time (``formula``, ``formula.1``, ...). Raises ``KeyError`` when no
    heading starts with ``section`` and ``ValueError`` when the section has no ``index``-th table,
    both naming the section.
    """
    _, tables = _read(section, path)
    if not -len(tables) <= index < len(tables):
        raise ValueError(
            f"section {section!r} of {path} has {len(tables)} table(s): no table {index}"
        )
    return tables[index]


def _read(section: str, path) -> tuple[list[list[str]], list[list[dict[str, str]]]]:
    """The header and the rows of every table of a section."""
    lines = _section(section, path)
    headers, tables, i = [], [], 0
    while i < len(lines) - 1:
        if not (lines[i].lstrip().startswith("|") and _RULE.match(lines[i + 1].strip())):
            i += 1
            continue
        header, rows, i = _unique(_cells(lines[i])), [], i + 2
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            cells = _cells(lines[i])
            rows.append(dict(zip(header, cells + [""] * (len(header) - len(cells)))))
            i += 1
        headers.append(header)
        tables.append(rows)
    return headers, tables


def _rows(section: str, column: str, path) -> list[dict[str, str]]:
    """The rows of the first table of a section with a header cell that starts with ``column``,
    that cell renamed ``column`` (so that a figure survives a longer header)."""
    headers, tables = _read(section, path)
    for header, rows in zip(headers, tables):
        key = next((name for name in header if name.startswith(column)), None)
        if key is not None:
            return [{**row, column: row[key]} for row in rows]
    raise ValueError(f"section {section!r} of {path} has no table with a {column!r} column")


def number(cell: str) -> float:
    """The number a table cell gives, as a float, in the unit the cell or its header writes.

    Units are dropped, not converted: ``"4.2 MiB"`` is 4.2 (MiB, as the axis says), ``"1.03x"``
    is 1.03, ``"27 %"`` is 27.0 (not 0.27), ``"30.1 ms"`` is 30.1. Thousands separators and
    exponents are read (``"12,345"``, ``"3.586e8"``, ``"3.09e+07"``); Markdown bold and
    backticks are ignored, and so is a remark in brackets or parentheses after the number (the
    interval of ``"1.012 [0.992, 1.054]"``, see :func:`interval`; the ratio of
    ``"1,048,576 (1.000)"``). Anything else (``"-"``, ``"none"``, two numbers) is a
    ``ValueError``.

        >>> [number(c) for c in ["1.03x", "4.2 MiB", "3.586e8", "12,345", "27 %", "**1.000**"]]
        [1.03, 4.2, 358600000.0, 12345.0, 27.0, 1.0]
    """
    match = _NUMBER.match(_clean(cell))
    if match is None:
        raise ValueError(f"not a number: {cell!r}")
    return float(match["value"].replace(",", ""))


def interval(cell: str) -> tuple[float, float]:
    """The interval ``[low, high]`` written in a cell, e.g. the bootstrap 95% interval of
    ``"**1.012** [0.992, 1.054]"``: ``(0.992, 1.054)``. ``ValueError`` if it has none."""
    match = _INTERVAL.search(_clean(cell))
    if match is None:
        raise ValueError(f"no interval [low, high] in {cell!r}")
    return number(match[1]), number(match[2])


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [number(row[key]) for row in rows]


# --- drawing -------------------------------------------------------------------------------------


def _figure(title: str, ncols: int, width: float, height: float = 4.4):
    """A figure of ``ncols`` panels side by side under ``title``."""
    fig = Figure(figsize=(width, height), layout="constrained")
    fig.suptitle(title, fontsize="large")
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _bars(ax, labels: list[str], series: list[tuple[str, list[float], dict]], wrap: int = 14):
    """Grouped bars: one group per label (its lines wrapped at ``wrap`` characters), one bar per
    (name, values, style) of ``series``."""
    width = 0.8 / len(series)
    for k, (name, values, style) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width, label=name, **style)
    ticks = ["\n".join(textwrap.fill(line, wrap) for line in label.split("\n")) for label in labels]
    ax.set_xticks(range(len(labels)), ticks)


def _log2(ax, axis: str = "x", ticks: list[float] | None = None):
    """A base-2 log axis with plain numbers (at ``ticks`` if given) and no minor ticks."""
    getattr(ax, f"set_{axis}scale")("log", base=2)
    scale = getattr(ax, f"{axis}axis")
    if ticks is not None:
        getattr(ax, f"set_{axis}ticks")(ticks, [f"{t:g}" for t in ticks])
    else:
        scale.set_major_formatter(StrMethodFormatter("{x:g}"))
    scale.set_minor_locator(NullLocator())


def _headroom(ax, factor: float):
    """Raise the top of a linear y axis to ``factor`` times its height, for the legend."""
    low, high = ax.get_ylim()
    ax.set_ylim(low, low + factor * (high - low))


def _groups(rows: list[dict[str, str]], key: str) -> dict[str, list[dict[str, str]]]:
    """The rows grouped by the cell ``key``, groups in their first row's order."""
    out: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        out.setdefault(row[key], []).append(row)
    return out


# --- the figures ---------------------------------------------------------------------------------


def dp_overhead(path=BENCHMARKS_MD) -> Figure:
    """Data-parallel overhead (``benchmarks/dp_overhead.py``): per-step time of ``repl.run`` and
    of the hand-written ``jit(shard_map)`` step, and their ratio of medians with its bootstrap 95%
    interval, per command."""
    rows = _rows("Data-parallel overhead", "ratio of medians", path)
    prefix = "python benchmarks/dp_overhead.py"
    labels = [row["command"].removeprefix(prefix).strip() or "default" for row in rows]
    fig, (left, right) = _figure(
        "Data-parallel overhead, replicator vs hand-written (benchmarks/dp_overhead.py)", 2, 11
    )
    _bars(
        left,
        labels,
        [
            ("repl.run", _column(rows, "replicator ms"), {"color": "C0"}),
            ("hand-written jit(shard_map)", _column(rows, "hand-written ms"), {"color": "C7"}),
        ],
        wrap=18,
    )
    left.set(xlabel="command options", ylabel="time per step (ms)", title="Step time")
    _headroom(left, 1.25)
    left.legend(loc="upper right")
    ratios = _column(rows, "ratio of medians")
    bounds = [interval(row["ratio of medians"]) for row in rows]
    errors = [[r - lo for r, (lo, _) in zip(ratios, bounds)]]
    errors.append([hi - r for r, (_, hi) in zip(ratios, bounds)])
    label = "ratio of medians, bootstrap 95% interval"
    right.errorbar(range(len(rows)), ratios, yerr=errors, fmt="o", capsize=6, label=label)
    right.axhline(1.0, color="0.4", linestyle="--", label="parity (1.0)")
    right.set_xticks(range(len(rows)), [textwrap.fill(label, 18) for label in labels])
    right.set_xlim(-0.5, len(rows) - 0.5)
    right.set(xlabel="command options", ylabel="repl.run / hand-written (ratio of medians)")
    right.set_title("Overhead ratio")
    _headroom(right, 1.3)
    right.legend(loc="upper right")
    return fig


def pipeline_schedules(path=BENCHMARKS_MD) -> Figure:
    """Pipeline schedules on 4 devices (``benchmarks/pipeline.py``): each schedule's step time
    over its sequential baseline beside the schedule's work limit, and the peak temporary memory
    of the compiled step at M = 8 and M = 32 micro-batches."""
    section = "Pipeline schedules (benchmarks/pipeline.py)"
    steps = [row for row in _rows(section, "its limit", path) if row["its limit"] != "-"]
    memory = _rows(section, "growth", path)
    fig, (left, right) = _figure(
        "Pipeline schedules on 4 emulated devices (benchmarks/pipeline.py)", 2, 11
    )
    _bars(
        left,
        [row["run"] for row in steps],
        [
            ("measured", _column(steps, "vs its sequential"), {"color": "C0"}),
            ("limit: its work / sequential work", _column(steps, "its limit"), IDEAL),
        ],
    )
    left.set(xlabel="schedule", ylabel="step time / its sequential step (ratio)")
    left.set_title("Step time against the schedule's limit")
    _headroom(left, 1.25)
    left.legend(loc="upper left", ncols=2)
    _bars(
        right,
        [row["schedule"] for row in memory],
        [
            ("M = 8", _column(memory, "M=8"), {"color": "C1"}),
            ("M = 32", _column(memory, "M=32"), {"color": "C3"}),
        ],
        wrap=14,
    )
    right.set(xlabel="schedule", ylabel="peak temporary memory (MiB)")
    right.set_title("Memory over the number of micro-batches M")
    right.legend(loc="upper right")
    return fig


def zero_memory(path=BENCHMARKS_MD) -> Figure:
    """ZeRO memory and communication (``benchmarks/zero.py``): per-device parameters, gradients
    and Adam state of stages 0-3 stacked beside the paper's formula, and the collective bytes per
    device per step by kind."""
    memory = _rows("ZeRO memory", "total/formula", path)
    comms = _rows("ZeRO memory", "reduce-scatter", path)
    fig, (left, right) = _figure(
        "ZeRO stages 0-3 on 8 devices, per device (benchmarks/zero.py)", 2, 11
    )
    stages = [row["stage"] for row in memory]
    xs = [i - 0.2 for i in range(len(stages))]
    bottom = [0.0] * len(stages)
    for name, key, color in [
        ("parameters", "params", "C0"),
        ("gradients", "grads", "C1"),
        ("Adam state", "Adam state", "C2"),
    ]:
        values = _column(memory, key)
        left.bar(xs, values, 0.4, bottom=bottom, label=f"measured: {name}", color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    formula = _column(memory, "formula")
    left.bar([i + 0.2 for i in range(len(stages))], formula, 0.4, label="paper's formula", **IDEAL)
    left.set_xticks(range(len(stages)), stages)
    left.set(xlabel="ZeRO stage", ylabel="memory per device (MiB)")
    left.set_title("Model state: measured vs the paper's formula")
    left.legend(loc="upper right")
    _bars(
        right,
        [row["stage"] for row in comms],
        [
            ("all-reduce", _column(comms, "all-reduce"), {"color": "C4"}),
            ("reduce-scatter", _column(comms, "reduce-scatter"), {"color": "C5"}),
            ("all-gather", _column(comms, "all-gather"), {"color": "C6"}),
            ("volume (an all-reduce counts 2x)", _column(comms, "volume"), {"color": "0.35"}),
        ],
    )
    right.set(xlabel="ZeRO stage", ylabel="collective bytes per device per step (MiB)")
    right.set_title("Communication, from the optimized HLO")
    right.legend(loc="upper left")
    return fig


def explain_timing(path=BENCHMARKS_MD) -> Figure:
    """Explain timing (``benchmarks/explain.py``): wall and compile time of ``replicator
    explain`` against the emulated device count, and the per-device arguments of a
    7.5e9-parameter model planned from shapes under ZeRO 0-3 beside the paper's formula."""
    runs = _rows("Explain timing", "wall s", path)
    plans = _rows("Explain timing", "paper GiB/device", path)
    fig, (left, right) = _figure("replicator explain (benchmarks/explain.py)", 2, 11)
    configs = _groups(
        [
            {**row, "config": re.sub(r".*configs/(\S+)\.yaml.*", r"\1", row["command"])}
            for row in runs
        ],
        "config",
    )
    for k, (config, group) in enumerate(configs.items()):
        devices = _column(group, "devices")
        wall, compile_ = _column(group, "wall s"), _column(group, "compile s")
        left.plot(devices, wall, "o", color=f"C{k}", markersize=8, label=f"{config}: wall")
        left.plot(
            devices,
            compile_,
            "s",
            color=f"C{k}",
            markersize=8,
            label=f"{config}: compile",
            **HOLLOW,
        )
    _log2(left, "x", sorted(set(_column(runs, "devices"))))
    left.set_ylim(0, 1.5 * max(_column(runs, "wall s")))
    left.set(xlabel="emulated devices (log scale)", ylabel="time per command (s)")
    left.set_title("Planning time against the mesh size")
    left.legend(loc="upper left", ncols=3, fontsize="small")
    _bars(
        right,
        [f"ZeRO-{row['ZeRO stage']}" for row in plans],
        [
            ("measured arguments", _column(plans, "arguments GiB/device"), {"color": "C0"}),
            ("paper's formula", _column(plans, "paper GiB/device"), IDEAL),
        ],
    )
    right.set_yscale("log")
    right.yaxis.set_major_formatter(ScalarFormatter())
    for bars, key in zip(right.containers, ["arguments GiB/device", "paper GiB/device"]):
        right.bar_label(bars, [row[key] for row in plans], fontsize="small", padding=2)
    _headroom(right, 1.1)
    right.set(xlabel="ZeRO stage", ylabel="parameters and optimizer state per device (GiB)")
    right.set_title("A 7.5e9-parameter model planned from shapes")
    right.legend(loc="upper right")
    return fig


def tensor_parallel(path=BENCHMARKS_MD) -> Figure:
    """Tensor parallelism (``benchmarks/tensor.py``): the GPT's per-device parameters, gradients
    and Adam state over the ``model`` size T against their formulas, and the ``model``-axis
    all-reduce bytes per layer against Megatron's count."""
    memory = _rows("Tensor parallelism", "measured/formula", path)
    comms = _rows("Tensor parallelism", "Megatron KiB", path)
    fig, (left, right) = _figure("Tensor parallelism, the GPT (benchmarks/tensor.py)", 2, 11)
    sizes = _column(memory, "T")
    for name, key, formula, style in [
        ("parameters", "params", "formula", {"color": "C0", "marker": "o", "markersize": 10}),
        ("gradients", "grads", "formula.1", {"color": "C1", "marker": "x", "markersize": 9}),
        ("Adam state", "Adam", "formula.2", {"color": "C2", "marker": "o", "markersize": 8}),
    ]:
        ideal = _column(memory, formula)
        left.plot(sizes, ideal, "--", color=style["color"], label=f"{name}: formula")
        left.plot(sizes, _column(memory, key), linestyle="none", label=f"{name}: measured", **style)
    _log2(left, "x", sizes)
    left.set(xlabel="model-axis size T (log scale)", ylabel="memory per device (KiB)")
    left.set_title("Memory against the formulas")
    left.legend(loc="upper right", fontsize="small")
    _bars(
        right,
        [f"{re.sub(r'^GPT[ ,]*|[()]', '', row['layout'])}\nT={row['T']}" for row in comms],
        [
            ("measured", _column(comms, "KiB per layer"), {"color": "C0"}),
            ("Megatron's count", _column(comms, "Megatron KiB"), IDEAL),
        ],
        wrap=12,
    )
    right.set(xlabel="layout", ylabel="model-axis all-reduce bytes per layer (KiB)")
    right.set_title("Communication against Megatron's")
    right.legend(loc="upper left")
    return fig


def long_context(path=BENCHMARKS_MD) -> Figure:
    """Long context (``benchmarks/context.py``): activation memory per sequence and FLOPs per
    device over the context size C against one device's over C, and the bytes each device sends
    on the ``context`` axis against the formula, for ring and all-to-all attention."""
    memory = _groups(_rows("Long context", "per sequence", path), "attention")
    flops = _rows("Long context", "FLOPs", path)
    comms = _groups(_rows("Long context", "forward bytes", path), "attention")
    fig, (left, middle, right) = _figure(
        "Long context over C devices (benchmarks/context.py)", 3, 15, 4.6
    )
    for k, (attention, rows) in enumerate(memory.items()):
        sizes, values = _column(rows, "C"), _column(rows, "per sequence")
        one = values[sizes.index(1.0)]
        ideal = [one / c for c in sizes]
        left.plot(sizes, ideal, "--", color=f"C{k}", label=f"{attention}: ideal, C=1 / C")
        left.plot(sizes, values, "o", color=f"C{k}", label=f"{attention}: measured")
    sizes, values = _column(flops, "C"), [v / 1e9 for v in _column(flops, "FLOPs")]
    one = values[sizes.index(1.0)]
    middle.plot(sizes, [one / c for c in sizes], "--", color="0.4", label="ideal, C=1 / C")
    middle.plot(sizes, values, "o", color="C2", label="measured (ring and all-to-all)")
    left.set(ylabel="activation memory per sequence (MiB)", title="Activation memory")
    middle.set(ylabel="FLOPs per device per step (GFLOP)", title="Compute")
    ways = [
        ("forward", "forward bytes", "formula", {"marker": "o", "markersize": 6}),
        ("backward", "backward bytes", "formula.1", {"marker": "s", "markersize": 11, **HOLLOW}),
    ]
    for k, (attention, rows) in enumerate(comms.items()):
        sizes = _column(rows, "C")
        for way, key, formula, marker in ways:
            mib = [v / 2**20 for v in _column(rows, key)]
            ideal = [v / 2**20 for v in _column(rows, formula)]
            right.plot(sizes, ideal, ":", color=f"C{k}", label=f"_formula: {attention} {way}")
            style = {"color": f"C{k}", "linestyle": "none", **marker}
            right.plot(sizes, mib, label=f"{attention} {way}", **style)
    right.plot([], [], ":", color="0.3", label="formula")
    right.set(title="Communication", ylabel="context-axis bytes per device per step (MiB)")
    _headroom(right, 1.5)
    first = [next(iter(memory.values())), flops, next(iter(comms.values()))]
    for ax, rows in zip((left, middle, right), first):
        _log2(ax, "x", sorted(set(_column(rows, "C"))))
        ax.set_xlabel("context-axis size C (log scale)")
    for ax in (left, middle):
        _log2(ax, "y")
    left.legend(loc="upper right", fontsize="small")
    middle.legend(loc="upper right", fontsize="small")
    right.legend(loc="upper left", fontsize="small", ncols=2)
    return fig


def many_slices(path=BENCHMARKS_MD) -> Figure:
    """Many slices (``benchmarks/slices.py``): each run's MFU and its time on the data-centre
    network a step, against the slices it spans (weak scaling: the same sequences a chip)."""
    runs = _groups(_rows("Many slices", "slices", path), "run")
    fig, (left, right) = _figure("Many slices: TPU programs compiled here (benchmarks/slices.py)",
                                 2, 11, 4.4)  # fmt: skip
    for k, (run, rows) in enumerate(runs.items()):
        slices = _column(rows, "slices")
        label = f"{run} on {rows[0]['target']}"
        left.plot(slices, _column(rows, "MFU"), "o-", color=f"C{k}", label=label)
        right.plot(slices, _column(rows, "DCN"), "o-", color=f"C{k}", label=label)
    left.set(title="MFU (the step's roofline)", ylabel="MFU (%)")
    right.set(title="DCN a step, before overlap", ylabel="ms a step on the data-centre network")
    every = sorted({s for rows in runs.values() for s in _column(rows, "slices")})
    for ax in (left, right):
        _log2(ax, "x", every)
        ax.set_xlabel("slices (log scale)")
        _headroom(ax, 1.3)
        ax.legend(loc="upper left", fontsize="small")
    return fig


FIGURES = {
    "dp_overhead": dp_overhead,
    "pipeline_schedules": pipeline_schedules,
    "zero_memory": zero_memory,
    "explain_timing": explain_timing,
    "tensor_parallel": tensor_parallel,
    "long_context": long_context,
    "many_slices": many_slices,
}


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
    """Write every figure of ``FIGURES`` as ``OUT/<name>.png`` and print the paths."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="directory for the PNGs")
    parser.add_argument(
        "--benchmarks", type=pathlib.Path, default=BENCHMARKS_MD, help="the Markdown to read"
    )
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        target = args.out / f"{name}.png"
        draw(args.benchmarks).savefig(target, dpi=110, bbox_inches="tight")
        print(target)
        written.append(target)
    return written


if __name__ == "__main__":
    main()
