"""`PlanReport`'s table: the layouts that fit, fastest first, and the rejected with why."""

from __future__ import annotations

from replicator._src.planner import search
from replicator._src.report.step_report import format_bytes


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def renderable(r, top: int = 20):
    """The rich renderable of a `planning.PlanReport` ``r``, its ``top`` rows each."""
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
    head = Text(
        f"plan for {r.num_devices} devices of {hw.name} ({what}), {budget} per device; "
        f"collectives on data axes {r.overlap:.0%} hidden behind compute\n"
        f"{len(r.ranked) + len(r.rejected)} layouts: {r.compiled} compiled, {len(r.ranked)} "
        f"fit; {r.seconds:.1f} s with {r.workers or 'no'} worker process(es)"
        + (f"; {r.priced} priced first, in {r.priced_seconds:.1f} s" if r.priced else "")
    )
    ranked = Table(title="layouts that fit, fastest first (modelled ms per step)",
                   title_justify="left")  # fmt: skip
    columns = ["#", "layout", "peak/device", "step", "compute", "bubble", "ICI", "DCN", "MFU"]
    if r.priced:
        columns += ["priced peak", "priced step"]
    for name in columns:
        ranked.add_column(name, justify="left" if name == "layout" else "right")
    for i, c in enumerate(r.ranked[:top], 1):
        ranked.add_row(str(i), str(c.layout), *_figures(c, r.priced))
    parts = [head, ranked]
    if len(r.ranked) > top:
        parts.append(Text(f"... and {len(r.ranked) - top} more that fit (to_json() has all)"))
    shown = [c for c in r.rejected if c.outcome.status != search.SKIPPED][:top]
    if shown:
        rejected = Table(title="rejected", title_justify="left")
        rejected.add_column("layout")
        rejected.add_column("memory/device", justify="right")
        rejected.add_column("why")
        for c in shown:
            o = c.outcome
            size = c.peak_bytes or o.state_bytes
            rejected.add_row(str(c.layout), "-" if size is None else format_bytes(size),
                             f"{o.status}: {o.reason}" if o.reason else o.status)  # fmt: skip
        parts.append(rejected)
    hidden = len([c for c in r.rejected if c.outcome.status != search.SKIPPED]) - len(shown)
    skipped = sum(c.outcome.status == search.SKIPPED for c in r.rejected)
    notes = []
    if hidden > 0:
        notes.append(f"{hidden} more rejected")
    if skipped:
        notes.append(
            f"{skipped} not compiled: a layout of the same family that does no more work fits, "
            f"or one that needs less memory does not"
        )
    if notes:
        parts.append(Text("; ".join(notes) + " (to_json() lists each with its reason)"))
    if r.best is not None:
        parts.append(Text(f"best: {r.best}"))
    else:
        parts.append(Text(f"no layout fits {budget} per device", style="bold"))
    return Group(*parts)


def _figures(c, priced: bool) -> list[str]:
    """A ranked row's figures: the compiled peak and modelled times, and the priced ones."""
    t = c.time
    row = [format_bytes(c.peak_bytes), _ms(t.total), _ms(t.compute), _ms(t.bubble), _ms(t.ici),
           _ms(t.dcn), "-" if t.mfu is None else f"{t.mfu:.1%}"]  # fmt: skip
    if priced:  # the formulas' figures beside the program's
        p = c.priced
        row += ["-", "-"] if p is None else [format_bytes(p.peak_bytes), _ms(c.priced_time.total)]
    return row
