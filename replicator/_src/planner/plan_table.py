"""`PlanReport`'s table: the layouts that fit, fastest first, and the rejected with why."""

from __future__ import annotations

from replicator._src.planner import search
from replicator._src.planner.workers import TIME_LIMIT
from replicator._src.report.step_report import format_bytes


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def renderable(r, top: int = 20, *, wide: bool = False):
    """The rich renderable of a `planning.PlanReport` ``r``, its ``top`` rows each: the
    columns to choose a layout by, or with ``wide`` every column (`COLUMNS`, `WIDE_COLUMNS`)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    hw = r.hardware
    budget = format_bytes(r.memory_budget)
    if hw.shared:
        what = (
            f"{hw.peak_flops / 1e12:.4g} TFLOP/s and {hw.ici_bandwidth / 1e9:.4g} GB/s shared by "
            f"all devices"
        )
    else:
        what = (
            f"{hw.peak_flops / 1e12:.4g} TFLOP/s, ICI {hw.ici_bandwidth / 1e9:.4g} GB/s, DCN "
            f"{hw.dcn_bandwidth / 1e9:.4g} GB/s per device, {hw.island_size} devices per island"
        )
    slices = max((c.layout.dcn_data for c in (*r.ranked, *r.rejected)), default=1)
    over = f" ({slices} slices of {r.num_devices // slices})" if slices > 1 else ""
    head = Text(
        f"plan for {r.num_devices} devices{over} of {hw.name} ({what}), {budget} per device; "
        f"collectives on data axes {r.overlap:.0%} hidden behind compute\n"
        f"{len(r.ranked) + len(r.rejected)} layouts: {r.compiled} compiled, {len(r.ranked)} "
        f"fit; {r.seconds:.1f} s with {r.workers or 'no'} worker process(es)"
        + (f"; {r.priced} priced first, in {r.priced_seconds:.1f} s" if r.priced else "")
    )
    title = Text("layouts that fit, fastest first (modelled ms per step)")
    ranked = Table()
    columns = list(WIDE_COLUMNS if wide else COLUMNS)
    if not wide and any(c.time.dcn > 0 for c in r.ranked):  # slices: the network's share
        columns.insert(columns.index("MFU"), "DCN")
    if r.priced and wide:
        columns += PRICED_COLUMNS
    for name in columns:
        ranked.add_column(name, justify="left" if name == "layout" else "right")
    for i, c in enumerate(r.ranked[:top], 1):
        figures = _figures(c)
        ranked.add_row(*(str(i) if name == "#" else figures[name] for name in columns))
    parts = [head, title, ranked]
    if len(r.ranked) > top:
        parts.append(Text(f"... and {len(r.ranked) - top} more that fit (to_json() has all)"))
    if not wide:
        more = ", priced peak and step" if r.priced else ""
        dcn = "" if "DCN" in columns else ", DCN"
        parts.append(Text(f"compute, bubble, ICI{dcn}{more}: table(wide=True) or --wide; every "
                          f"figure: to_json() or --json"))  # fmt: skip
    shown = [c for c in r.rejected if c.outcome.status != search.SKIPPED][:top]
    if shown:
        parts.append(Text("rejected"))
        rejected = Table()
        rejected.add_column("layout")
        rejected.add_column("memory/device", justify="right")
        rejected.add_column("why")
        for c in shown:
            o = c.outcome
            size = c.peak_bytes or o.state_bytes
            rejected.add_row(str(c.layout), "-" if size is None else format_bytes(size),
                             f"{o.status}: {o.reason}" if o.reason else o.status)  # fmt: skip
        parts.append(rejected)
    if notes := _notes(r, len(shown)):
        parts.append(Text("; ".join(notes) + " (to_json() lists each with its reason)"))
    if r.best is not None:
        parts.append(Text(f"best: {r.best}"))
    else:
        parts.append(Text(f"no layout fits {budget} per device", style="bold"))
    return Group(*parts)


def _notes(r, shown: int) -> list[str]:
    """What the table leaves out: the rejected beyond ``shown``, the layouts not compiled."""
    hidden = len([c for c in r.rejected if c.outcome.status != search.SKIPPED]) - shown
    skipped = [c.outcome.reason or "" for c in r.rejected if c.outcome.status == search.SKIPPED]
    late = sum(TIME_LIMIT in why for why in skipped)
    notes = []
    if hidden > 0:
        notes.append(f"{hidden} more rejected")
    if len(skipped) > late:
        notes.append(
            f"{len(skipped) - late} not compiled: a layout of the same ladder that does no more "
            f"work fits, or one that needs less memory does not, or it is priced slower than a "
            f"layout that fits"
        )
    if late:
        notes.append(f"{late} not compiled for {TIME_LIMIT} (priced slower than those compiled; "
                     f"raise time_limit, or --time-limit)")  # fmt: skip
    return notes


# The ranked table's columns: those to choose a layout by, and the wide table's.
COLUMNS = ("#", "layout", "peak/device", "step", "MFU")
WIDE_COLUMNS = ("#", "layout", "peak/device", "step", "compute", "bubble", "ICI", "DCN", "MFU")
PRICED_COLUMNS = ("priced peak", "priced step")  # wide, for a plan that priced first


def _figures(c) -> dict[str, str]:
    """A ranked row's figures by column: the compiled peak, the modelled step and its parts,
    the MFU, and the priced peak and step."""
    t, p = c.time, c.priced
    row = {"layout": str(c.layout), "peak/device": format_bytes(c.peak_bytes),
           "step": _ms(t.total), "MFU": "-" if t.mfu is None else f"{t.mfu:.1%}",
           "compute": _ms(t.compute), "bubble": _ms(t.bubble), "ICI": _ms(t.ici),
           "DCN": _ms(t.dcn)}  # fmt: skip
    row["priced peak"] = "-" if p is None else format_bytes(p.peak_bytes)
    row["priced step"] = "-" if p is None else _ms(c.priced_time.total)
    return row
