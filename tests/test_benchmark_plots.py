"""benchmarks/plots.py: the tables it reads from BENCHMARKS.md and the figures it draws from them.

The expected cells come from a second, naive reading of BENCHMARKS.md in this file (split each
table line on its pipes), and the expected numbers from a naive parse of those cells, so that a
wrong parser, a shifted column or a wrong series in a figure fails here.
"""

import doctest
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKDOWN = ROOT / "BENCHMARKS.md"

_spec = importlib.util.spec_from_file_location("benchmark_plots", ROOT / "benchmarks" / "plots.py")
plots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plots)

# The sections the figures plot: (plots.table's `section`, the start of the raw `## ` heading).
SECTIONS = [
    ("Data-parallel overhead", "Data-parallel overhead ("),
    (
        "Pipeline schedules (benchmarks/pipeline.py)",
        "Pipeline schedules (`benchmarks/pipeline.py`)",
    ),
    ("ZeRO memory", "ZeRO memory"),
    ("Explain timing", "Explain timing"),
    ("Tensor parallelism", "Tensor parallelism"),
    ("Long context", "Long context"),
    ("Many slices", "Many slices"),
]


def raw_tables(heading: str) -> list[tuple[list[str], list[list[str]]]]:
    """The tables under the `## ` heading that starts with `heading`, naively: (header, rows)."""
    text = MARKDOWN.read_text(encoding="utf-8")
    start = text.index("\n## " + heading)
    end = text.find("\n## ", start + 1)
    tables = []
    for block in re.split(r"\n[ \t]*\n", text[start : end if end > 0 else None]):
        lines = [line.strip() for line in block.splitlines() if line.startswith("|")]
        if len(lines) >= 2 and set(lines[1]) <= set("|-: "):
            cells = [
                [c.strip().replace("**", "").replace("`", "").replace("\\|", "|") for c in cut]
                for cut in (re.split(r"(?<!\\)\|", line)[1:-1] for line in lines)
            ]
            tables.append((cells[0], cells[2:]))
    assert tables, heading
    return tables


def raw_column(heading: str, column: str, nth: int = 0, within: str | None = None) -> list[str]:
    """The cells of the `nth` column named `column` in the first table under `heading` with a
    column named `within` (default: `column`)."""
    for header, rows in raw_tables(heading):
        if (within or column) in header:
            index = [i for i, name in enumerate(header) if name == column][nth]
            return [row[index] for row in rows]
    raise AssertionError(f"no {column!r} column under {heading!r}")


def naive(cell: str) -> float:
    """A cell's leading number: "56.12 MiB" 56.12, "1,048,576 (1.000)" 1048576, "1.03x" 1.03."""
    return float(cell.split()[0].replace(",", "").rstrip("x%"))


def values(heading: str, column: str, nth: int = 0, within: str | None = None) -> list[float]:
    return [naive(cell) for cell in raw_column(heading, column, nth, within)]


def bars(ax, label: str) -> list[float]:
    """The heights of the bars labelled `label` in `ax`."""
    found = [c for c in ax.containers if c.get_label() == label]
    assert len(found) == 1, (label, [c.get_label() for c in ax.containers])
    return [float(v) for v in found[0].datavalues]


def line(ax, label: str) -> tuple[list[float], list[float]]:
    """The x and y data of the one line labelled `label` in `ax`."""
    found = [ln for ln in ax.get_lines() if ln.get_label() == label]
    assert len(found) == 1, (label, [ln.get_label() for ln in ax.get_lines()])
    return [float(x) for x in found[0].get_xdata()], [float(y) for y in found[0].get_ydata()]


def close(actual, expected, tol=1e-9):
    return actual == pytest.approx(expected, rel=tol, abs=tol)


# --- table ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("section", "heading"), SECTIONS, ids=[s[0] for s in SECTIONS])
def test_table_returns_the_cells_of_the_markdown(section, heading):
    raw = raw_tables(heading)
    for index, (header, rows) in enumerate(raw):
        parsed = plots.table(section, index)
        assert [list(row.values()) for row in parsed] == rows, (section, index)
        for row in parsed:  # the keys are the header cells, a repeated one numbered
            assert [re.sub(r"\.\d+$", "", key) for key in row] == header
            assert len(set(row)) == len(header)
    with pytest.raises(ValueError, match=re.escape(section)):
        plots.table(section, len(raw))


def test_table_rows_agree_with_their_own_totals_and_ratios():
    """Columns land under the right keys: each row's figures agree with the row's own totals."""
    for row in plots.table("ZeRO memory"):
        parts = plots.number(row["params"]) + plots.number(row["grads"])
        total = parts + plots.number(row["Adam state"])
        assert total == pytest.approx(plots.number(row["total"]), abs=0.002), row
        ratio = plots.number(row["total"]) / plots.number(row["formula"])
        assert ratio == pytest.approx(plots.number(row["total/formula"]), abs=0.001), row
    overhead = plots.table("Data-parallel overhead")
    assert overhead
    for row in overhead:
        ratio = plots.number(row["replicator ms"]) / plots.number(row["hand-written ms"])
        key = "ratio of medians (bootstrap 95% CI)"
        assert ratio == pytest.approx(plots.number(row[key]), abs=0.005), row
        low, high = plots.interval(row[key])
        assert low <= plots.number(row[key]) <= high
    tensor = plots.table("Tensor parallelism")
    assert [row["T"] for row in tensor] == raw_column("Tensor parallelism", "T")
    for row in tensor:  # the three "formula" columns, each after its own measured column
        assert row["params"] == row["formula"]
        assert row["grads"] == row["formula.1"]
        assert row["Adam"] == row["formula.2"]


def test_table_reads_sections_subsections_and_cells(tmp_path):
    path = tmp_path / "bench.md"
    path.write_text(
        "# Title\n\n## First (`a.py`)\n\ntext\n\n| a | **b** | a |\n|---|:-:|---|\n"
        "| `x\\|y` | **1.5** | 2 |\n| 3 |\n\n```\n| not | a |\n|---|---|\n| table | here |\n```\n\n"
        "### Sub\n\n| c |\n|---|\n| 7 |\n\n## Second\n\n| d |\n|---|\n| 9 |\n",
        encoding="utf-8",
    )
    assert plots.table("First (a.py)", path=path) == [
        {"a": "x|y", "b": "1.5", "a.1": "2"},
        {"a": "3", "b": "", "a.1": ""},
    ]
    assert plots.table("First (`a.py`)", 1, path=path) == [{"c": "7"}]  # the subsection's
    assert plots.table("Sub", path=path) == [{"c": "7"}]
    assert plots.table("Second", path=path) == [{"d": "9"}]
    with pytest.raises(ValueError, match="'First'.*2 table"):
        plots.table("First", 2, path=path)


def test_table_on_a_missing_section_names_it():
    with pytest.raises(KeyError, match="No such benchmark"):
        plots.table("No such benchmark")


# --- number --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        ("1.03x", 1.03),
        ("4.2 MiB", 4.2),
        ("3.586e8", 3.586e8),
        ("3.406e+09", 3.406e9),
        ("12,345", 12345.0),
        ("1,048,576", 1048576.0),
        ("27 %", 27.0),
        ("27.4%", 27.4),
        ("-0.55 MiB", -0.55),
        ("30.1 ms", 30.1),
        (".5", 0.5),
        ("**1.012** [0.992, 1.054]", 1.012),
        ("3,145,728 (1.000)", 3145728.0),
        ("`0.404`", 0.404),
    ],
)
def test_number_parses_the_cell_forms(cell, expected):
    assert plots.number(cell) == expected


@pytest.mark.parametrize("cell", ["-", "", "none", "1.0 2.0", "12,34", "x1", "5.5 (a) b"])
def test_number_refuses_what_is_not_one_number(cell):
    with pytest.raises(ValueError, match="not a number"):
        plots.number(cell)


def test_interval_and_the_docstring_examples():
    assert plots.interval("**1.012** [0.992, 1.054]") == (0.992, 1.054)
    with pytest.raises(ValueError):
        plots.interval("1.012")
    assert doctest.testmod(plots).failed == 0


# --- figures -------------------------------------------------------------------------------------


def test_figures_are_named_and_ordered():
    assert list(plots.FIGURES) == [
        "dp_overhead",
        "pipeline_schedules",
        "zero_memory",
        "explain_timing",
        "tensor_parallel",
        "long_context",
        "many_slices",
    ]


@pytest.fixture(scope="module")
def figures():
    return {name: draw() for name, draw in plots.FIGURES.items()}


@pytest.mark.parametrize(
    ("name", "script"),
    [
        ("dp_overhead", "dp_overhead.py"),
        ("pipeline_schedules", "pipeline.py"),
        ("zero_memory", "zero.py"),
        ("explain_timing", "explain.py"),
        ("tensor_parallel", "tensor.py"),
        ("long_context", "context.py"),
        ("many_slices", "slices.py"),
    ],
)
def test_each_figure_names_its_script_and_labels_its_axes(figures, name, script):
    fig = figures[name]
    assert f"benchmarks/{script}" in fig.get_suptitle()
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), (name, ax)
        assert ax.get_legend() is not None


def test_dp_overhead_plots_the_table(figures):
    heading = "Data-parallel overhead ("
    left, right = figures["dp_overhead"].axes
    assert close(bars(left, "repl.run"), values(heading, "replicator ms"))
    assert close(bars(left, "hand-written jit(shard_map)"), values(heading, "hand-written ms"))
    cells = raw_column(heading, "ratio of medians (bootstrap 95% CI)")
    (errorbar,) = right.containers
    assert close(list(errorbar.lines[0].get_ydata()), [naive(c) for c in cells])
    segments = errorbar.lines[2][0].get_segments()
    for cell, segment in zip(cells, segments, strict=True):
        low, high = (float(v) for v in re.search(r"\[(.*), (.*)\]", cell).groups())
        assert close([segment[0][1], segment[1][1]], [low, high], 1e-12)


def test_pipeline_schedules_plots_the_table(figures):
    heading = "Pipeline schedules (`benchmarks/pipeline.py`)"
    left, right = figures["pipeline_schedules"].axes
    limits = raw_column(heading, "its limit")
    keep = [cell != "-" for cell in limits]
    assert sum(keep) >= 4
    measured = [v for v, k in zip(raw_column(heading, "vs its sequential"), keep) if k]
    assert close(bars(left, "measured"), [naive(c) for c in measured])
    expected = [naive(c) for c, k in zip(limits, keep) if k]
    assert close(bars(left, "limit: its work / sequential work"), expected)
    assert close(bars(right, "M = 8"), values(heading, "M=8"))
    assert close(bars(right, "M = 32"), values(heading, "M=32"))


def test_zero_memory_plots_the_table(figures):
    left, right = figures["zero_memory"].axes
    for label, column in [
        ("measured: parameters", "params"),
        ("measured: gradients", "grads"),
        ("measured: Adam state", "Adam state"),
        ("paper's formula", "formula"),
    ]:
        assert close(bars(left, label), values("ZeRO memory", column)), label
    (adam,) = [c for c in left.containers if c.get_label() == "measured: Adam state"]
    tops = [bar.get_y() + bar.get_height() for bar in adam]  # stacked on the other two
    assert tops == pytest.approx(values("ZeRO memory", "total"), abs=0.002)
    for label in ["all-reduce", "reduce-scatter", "all-gather"]:
        assert close(bars(right, label), values("ZeRO memory", label)), label
    assert close(bars(right, "volume (an all-reduce counts 2x)"), values("ZeRO memory", "volume"))


def test_explain_timing_plots_the_table(figures):
    left, right = figures["explain_timing"].axes
    devices = values("Explain timing", "devices")
    for kind, column in [("wall", "wall s"), ("compile", "compile s")]:
        points = []
        for ln in left.get_lines():
            if ln.get_label().endswith(f": {kind}"):
                points += list(zip(map(float, ln.get_xdata()), map(float, ln.get_ydata())))
        assert sorted(points) == sorted(zip(devices, values("Explain timing", column))), kind
    measured = values("Explain timing", "arguments GiB/device")
    assert close(bars(right, "measured arguments"), measured)
    assert close(bars(right, "paper's formula"), values("Explain timing", "paper GiB/device"))


def test_tensor_parallel_plots_the_table(figures):
    heading = "Tensor parallelism"
    left, right = figures["tensor_parallel"].axes
    sizes = values(heading, "T")
    for nth, (name, column) in enumerate(
        [("parameters", "params"), ("gradients", "grads"), ("Adam state", "Adam")]
    ):
        assert line(left, f"{name}: measured") == (sizes, values(heading, column))
        assert line(left, f"{name}: formula") == (sizes, values(heading, "formula", nth))
    assert close(bars(right, "measured"), values(heading, "KiB per layer"))
    assert close(bars(right, "Megatron's count"), values(heading, "Megatron KiB"))


def test_long_context_plots_the_table(figures):
    heading = "Long context"
    left, middle, right = figures["long_context"].axes
    memory = list(zip(raw_column(heading, "attention"), raw_column(heading, "C")))
    per_sequence = values(heading, "per sequence")
    for attention in ["ring", "all_to_all"]:
        rows = [(naive(c), v) for (a, c), v in zip(memory, per_sequence) if a == attention]
        sizes, measured = [c for c, _ in rows], [v for _, v in rows]
        assert line(left, f"{attention}: measured") == (sizes, measured)
        one = measured[sizes.index(1.0)]
        xs, ideal = line(left, f"{attention}: ideal, C=1 / C")
        assert xs == sizes and close(ideal, [one / c for c in sizes])
    xs, ys = line(middle, "measured (ring and all-to-all)")
    assert xs == values(heading, "C", within="FLOPs")
    assert close([y * 1e9 for y in ys], values(heading, "FLOPs"))
    _, ideal = line(middle, "ideal, C=1 / C")
    assert close([y * 1e9 * c for y, c in zip(ideal, xs)], [values(heading, "FLOPs")[0]] * len(xs))
    within = "forward bytes"
    attentions = raw_column(heading, "attention", within=within)
    sizes = values(heading, "C", within=within)
    assert {"ring", "all_to_all"} <= set(attentions)
    for way, nth in [("forward", 0), ("backward", 1)]:
        sent = values(heading, f"{way} bytes")
        formula = values(heading, "formula", nth, within=within)
        for attention in ["ring", "all_to_all"]:
            mine = [i for i, a in enumerate(attentions) if a == attention]
            xs, ys = line(right, f"{attention} {way}")
            assert xs == [sizes[i] for i in mine]
            assert close([y * 2**20 for y in ys], [sent[i] for i in mine])
            _, ideal = line(right, f"_formula: {attention} {way}")
            assert close([y * 2**20 for y in ideal], [formula[i] for i in mine])


def test_many_slices_plots_the_table(figures):
    heading = "Many slices"
    left, right = figures["many_slices"].axes
    within = "slices"
    runs, targets = raw_column(heading, "run", within=within), raw_column(heading, "target")
    slices, mfu, dcn = (values(heading, c, within=within) for c in ("slices", "MFU", "DCN"))
    assert len(set(runs)) == 2 and max(slices) == 8
    for run in dict.fromkeys(runs):
        mine = [i for i, r in enumerate(runs) if r == run]
        label = f"{run} on {targets[mine[0]]}"
        assert line(left, label) == ([slices[i] for i in mine], [mfu[i] for i in mine])
        assert line(right, label) == ([slices[i] for i in mine], [dcn[i] for i in mine])


def test_main_writes_the_pngs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plots, "FIGURES", {"zero_memory": plots.zero_memory})
    (written,) = plots.main(["--out", str(tmp_path / "plots")])
    assert written == tmp_path / "plots" / "zero_memory.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert written.stat().st_size > 10_000
    assert capsys.readouterr().out.strip() == str(written)
