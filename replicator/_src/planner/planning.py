"""``rp.plan``: choose a layout for a model, a device count and a memory budget, from compiled
programs.

The planner lists the layouts the model's sizes allow (`enumerate_layouts`), drops those whose
state alone cannot fit (read from the state's shapes, nothing compiled), compiles the others
from shapes with ``Replicator.explain`` (in worker processes with the devices emulated), and
models each one's step time on a hardware profile (`cost_model.model_time`). It needs no cost
model of the program: the compiled program gives its exact per-device memory, FLOPs and
collective bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from replicator._src.core import targets
from replicator._src.planner import pricing as pricing_lib
from replicator._src.planner import search
from replicator._src.planner import workers as workers_lib
from replicator._src.planner.layouts import Ladder, Layout
from replicator._src.planner.options import PricingOptions, TimingOptions, fold_deprecated
from replicator._src.planner.plan_table import renderable as _renderable
from replicator._src.report.cost_model import ModelledTime, model_time
from replicator._src.report.hardware import Hardware, hardware_profile, parse_bytes
from replicator._src.report.step_report import format_bytes
from replicator._src.sharded import kernels


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout's outcome in a plan, with its modelled step time.

    Attributes:
      outcome: what became of the layout (`search.Outcome`): its status (``"fits"``, ``"too
        big"``, ...), the reason, the state's bytes and the compiled program's figures.
      time: the step time modelled from the compiled program (`ModelledTime`); None unless
        compiled.
      priced: the layout's figures from formulas (`Price`); None unless `plan` priced first.
      priced_time: the step time modelled from ``priced``; None unless priced.
    """

    outcome: search.Outcome
    time: ModelledTime | None = None
    priced: pricing_lib.Price | None = None
    priced_time: ModelledTime | None = None

    @property
    def layout(self) -> Layout:
        """The layout."""
        return self.outcome.layout

    @property
    def fits(self) -> bool:
        """Whether it compiled with its peak within the budget."""
        return self.outcome.status == search.FITS

    @property
    def peak_bytes(self) -> int | None:
        """The compiled program's peak bytes per device; None unless compiled."""
        c = self.outcome.compiled
        return None if c is None else c.memory["peak"]

    def to_dict(self) -> dict:
        """Every figure of the candidate as plain data (as `PlanReport.to_json` writes it)."""
        asdict = lambda t: None if t is None else dataclasses.asdict(t)
        return {**self.outcome.to_dict(), "time": asdict(self.time),
                "priced": None if self.priced is None else self.priced.to_dict(),
                "priced_time": asdict(self.priced_time)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """The layouts `plan` tried, ranked by modelled step time, and what became of the others.

    Attributes:
      num_devices: N.
      memory_budget: bytes per device a layout's peak must stay within.
      hardware: the profile the times are modelled on.
      overlap: the share of data-axis collectives (and gradient reductions over the context
        and expert axes: `cost_model.hideable`) assumed hidden behind compute.
      model_flops: the model's FLOPs per step (for the MFU), or None.
      ranked: the layouts that fit, fastest first.
      rejected: the others: too big (compiled or from the state alone), refused, or skipped
        because a layout that comes before it in its ladder (priced faster, or less recomputed) fits.
      seconds: the planning's wall time.
      workers: processes that compiled (0: this process).
      priced: layouts priced from formulas before any compile (0 without ``pricing``).
      priced_seconds: the pricing's wall time.
    """

    num_devices: int
    memory_budget: int
    hardware: Hardware
    overlap: float
    model_flops: float | None
    ranked: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]
    seconds: float
    workers: int
    priced: int = 0
    priced_seconds: float = 0.0

    @property
    def best(self) -> Layout | None:
        """The fastest layout that fits, or None if none does."""
        return self.ranked[0].layout if self.ranked else None

    @property
    def compiled(self) -> int:
        """How many layouts were compiled."""
        return sum(c.outcome.compiled is not None for c in (*self.ranked, *self.rejected))

    def to_json(self) -> str:
        """Every layout with every figure, as JSON: what the table shows, and the rest."""
        return json.dumps(
            {
                "num_devices": self.num_devices,
                "memory_budget": self.memory_budget,
                "hardware": self.hardware.to_dict(),
                "overlap": self.overlap,
                "model_flops": self.model_flops,
                "best": None if self.best is None else self.best.to_dict(),
                "ranked": [c.to_dict() for c in self.ranked],
                "rejected": [c.to_dict() for c in self.rejected],
                "seconds": self.seconds,
                "workers": self.workers,
                "compiled": self.compiled,
                "priced": self.priced,
                "priced_seconds": self.priced_seconds,
            },
            indent=2,
        )

    def table(self, top: int = 20, *, wide: bool = False) -> str:
        """The report as text: the ``top`` fastest layouts that fit, and ``top`` rejected.

        Args:
          top: rows of each table.
          wide: every column (the step's parts: compute, bubble, ICI, DCN; the priced peak
            and step beside the compiled ones), at the width they take; else the columns to
            choose a layout by (peak, step, MFU), in 120 columns.

        Returns:
          The tables, with a header (the devices, the profile, the budget) and the best
          layout's line.
        """
        from rich.console import Console

        buffer = io.StringIO()
        width = 1000 if wide else 120  # wide: as wide as the columns take
        Console(file=buffer, width=width, color_system=None, soft_wrap=False).print(
            _renderable(self, top, wide=wide)
        )
        return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines())

    def __str__(self) -> str:
        return self.table()

    def __rich__(self):
        return _renderable(self)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython / Jupyter
        printer.text(str(self))


def plan(
    build: Callable[[Layout], tuple] | str,
    /,
    layouts: Sequence[Ladder | Layout],
    *,
    hardware: Hardware | str | dict = "cpu",
    memory: int | str | None = None,
    timing: TimingOptions | None = None,
    pricing: PricingOptions | None = None,
    target: str | targets.Target | None = None,
    workers: int | None = None,
    progress: bool = False,
    **deprecated: Any,
) -> PlanReport:
    """Ranks ``layouts`` by modelled step time among those whose compiled step fits ``memory``.

    For each ladder of layouts (see `enumerate_layouts`): build the job with ``build(layout)``,
    reject the ladder if its state alone exceeds the budget (from shapes: nothing compiled),
    else compile its layouts with ``Replicator.explain`` from the fastest to the most frugal
    until one fits, and model the step time of each compiled layout on ``hardware``
    (`cost_model.model_time`: compute at peak, collective bytes at the bandwidth of the link
    they cross, the pipeline bubble). Equivalent to::

        for ladder in layouts:
            for layout in ladder (fastest first):
                repl, step_fn, state, *args = build(layout)
                report = repl.explain(step_fn, state, *args)
                if report.memory.peak <= memory: keep (layout, model_time(report)); break

    Args:
      build: ``build(layout) -> (repl, step_fn, state, *args)``: the training step of the model
        on ``rp.Replicator(mesh_shape=layout.mesh_shape)`` with the layout's options (over a
        ``context`` axis, its ``attention``: ``GPTConfig(attention=layout.attention)``), its state
        (``repl.abstract(init)``: shapes with shardings, nothing allocated) and its arguments
        (shapes). A module-level function, or ``"module:function"``, so that worker processes
        can import it; ``functools.partial`` of one works too.
      layouts: ladders from `enumerate_layouts`, or single `Layout` objects (each tried alone).
      hardware: a profile (`Hardware`), a built-in name (`HARDWARE_PROFILES`: ``"tpu-v5e"``,
        ``"h100"``, ...; ``"cpu"``: this machine, measured) or a YAML/JSON file
        (`hardware_profile` reads each).
      memory: the budget per device (``"16GiB"`` or bytes); default the profile's memory.
      timing: the time model's options beyond the profile (`TimingOptions`: the share of
        collectives hidden behind compute, the model's FLOPs for the MFU); default none hidden,
        no MFU.
      pricing: price every layout from formulas first and compile only the fastest ladders
        (`PricingOptions`: the model's sizes, how many ladders to compile). Each candidate then
        carries its priced figures beside its compiled ones. Default: every ladder compiled.
      target: a TPU target (``"v5p-16"`` or `rp.targets.tpu_target`): ``build`` makes its
        Replicator on ``rp.tpu_devices(target)``, the layouts compile for that TPU with libtpu
        (in this process by default; in ``workers`` processes when given, each loading libtpu
        with ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``), and ``hardware`` defaults to the target's chip,
        its slice the island.
      workers: processes that compile, each with N emulated CPU devices; 0 compiles here
        (this process must have exactly N devices). Default: here if this process has N
        devices, else ``min(2, cpu_count)``.
      progress: show a progress bar (on a terminal; elsewhere a line per ladder planned).
      **deprecated: ``model_flops=`` and ``overlap=`` (now in ``timing``), ``model=`` and
        ``compile_top=`` (now in ``pricing``): accepted for one release, each with a
        ``DeprecationWarning``.

    Returns:
      A `PlanReport`: print it for the ranked table; ``.best`` is the fastest layout that fits.

    Raises:
      ValueError: for layouts of different device counts, a bad budget or profile,
        ``workers=0`` in a process without N devices, or an old keyword given with its record.
      TypeError: for an unknown keyword.

    Example (``build`` as in the guide, ``docs/guides/explain_and_plan.md``)::

        ladders = rp.planner.enumerate_layouts(
            8, sizes=rp.planner.ModelSizes(global_batch=64, num_layers=4, num_heads=8))
        report = rp.plan(build, ladders, hardware="h100", memory="80GB",
                         pricing=rp.planner.PricingOptions(model=gpt.model_shape(CONFIG, 64)))
        print(report.best)
    """
    start = time.perf_counter()
    if deprecated:
        records = {"timing": (TimingOptions, timing), "pricing": (PricingOptions, pricing)}
        folded = fold_deprecated(
            "rp.plan", deprecated, records, stacklevel=2, optional={"pricing": "model"}
        )
        timing, pricing = folded["timing"], folded["pricing"]
    for name, value, cls in (("timing", timing, TimingOptions),
                             ("pricing", pricing, PricingOptions)):  # fmt: skip
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"rp.plan: {name} must be an rp.planner.{cls.__name__}; got {value!r}.")
    timing = TimingOptions() if timing is None else timing
    ladders = _ladders(layouts)
    (n,) = {lay.num_devices for ladder in ladders for lay in ladder.layouts}
    if target is not None:
        target = targets.tpu_target(target) if isinstance(target, str) else target
        if target.num_devices != n:
            raise ValueError(
                f"rp.plan: the layouts use {n} devices, and target {target.label} has "
                f"{target.num_devices}; enumerate layouts for {target.num_devices}."
            )
        hardware = target if hardware == "cpu" else hardware
    profile = hardware_profile(hardware)
    budget = profile.memory_bytes if memory is None else parse_bytes(memory, "memory")
    if target is not None:  # libtpu's devices, here or in processes of their own
        workers = 0 if workers is None else workers_lib.count(workers, n, here=False)
        if workers:
            os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # each worker loads libtpu too
    else:
        workers = workers_lib.count(workers, n)
    timing_kw = timing.as_kwargs()
    prices, not_compiled, priced_seconds = {}, [], 0.0
    emulated = n if target is None else 1  # a target's workers compile for libtpu's devices
    score = lambda outcome: model_time(outcome.compiled, profile, **timing_kw).total
    skip = None if pricing is None else pricing.skip_slower
    deadline = workers_lib.Deadline(
        None if pricing is None else pricing.time_limit, start,
        workers_lib.say_on_stderr if progress else None,
    )  # fmt: skip
    run = lambda some, price_of=None, peak_of=None: (
        workers_lib.run(build, some, budget, emulated, workers, progress, score, price_of, skip,
                        peak_of, deadline)
        if some else []
    )  # fmt: skip
    if pricing is None:
        outcomes = run(ladders)
    else:
        outcomes, not_compiled, prices, priced_seconds = _priced_rounds(
            run, ladders, pricing.model, budget, profile, timing_kw, pricing.compile_top, progress,
            target is None, deadline,
        )  # fmt: skip
    candidates = _candidates([*outcomes, *not_compiled], prices, profile, timing_kw)
    ranked = sorted((c for c in candidates if c.fits), key=lambda c: c.time.total)
    order = {search.TOO_BIG: 0, search.STATE_TOO_BIG: 1, search.PRICED_TOO_BIG: 2,
             search.ERROR: 3, search.SKIPPED: 4}  # fmt: skip
    rejected = sorted(
        (c for c in candidates if not c.fits),
        key=lambda c: (order[c.outcome.status], -(c.peak_bytes or c.outcome.state_bytes or 0)),
    )
    return PlanReport(
        num_devices=n, memory_budget=budget, hardware=profile, overlap=timing.overlap,
        model_flops=timing.model_flops, ranked=tuple(ranked), rejected=tuple(rejected),
        seconds=time.perf_counter() - start, workers=workers, priced=len(prices),
        priced_seconds=priced_seconds,
    )  # fmt: skip


def _ladders(layouts: Sequence[Ladder | Layout]) -> list[Ladder]:
    """``layouts`` as ladders (a `Layout` a ladder of one), all of one device count."""
    ladders = [x if isinstance(x, Ladder) else Ladder(((x,),)) for x in layouts]
    if not ladders:
        raise ValueError(
            "rp.plan: layouts is empty; pass rp.planner.enumerate_layouts(...)'s ladders."
        )
    for ladder in ladders:
        if not all(isinstance(x, Layout) for x in ladder.layouts):
            raise ValueError(
                f"rp.plan: layouts must hold rp.planner.Layout or ladders from "
                f"rp.planner.enumerate_layouts; got {ladder!r}."
            )
    sizes = {lay.num_devices for ladder in ladders for lay in ladder.layouts}
    if len(sizes) != 1:
        raise ValueError(
            f"rp.plan: the layouts use {sorted(sizes)} devices; plan one device count at a time."
        )
    return ladders


def _priced_rounds(run, ladders, model, budget, profile, timing, top, progress, on_cpu,
                   deadline=None):  # fmt: skip
    """Every layout priced, then `_rounds`: ``(outcomes compiled, not compiled, prices,
    seconds to price)``. The layouts compile for XLA:CPU without a target, which carries bf16
    work in fp32: their activations are priced in fp32 (``on_cpu``). For a TPU, attention
    is priced on the kernel it compiles to (`kernels.choose`: splash where its tiles fit)."""
    if on_cpu and model.compute_bytes < 4:
        model = dataclasses.replace(model, compute_bytes=4)
    tpu_kernel = lambda: kernels.choose(
        seqs=(model.seq_len,), dtype="bfloat16", head_dim=model.head_dim, platform="tpu"
    )
    if not on_cpu and model.attention == "blockwise" and tpu_kernel() == "splash":
        model = dataclasses.replace(model, attention="splash")
    t0 = time.perf_counter()
    ranked, dropped, prices = pricing_lib.front_runners(ladders, model, budget, profile, timing)
    seconds = time.perf_counter() - t0
    if progress:
        print(f"planning: priced {len(prices)} layouts in {seconds:.1f} s: {len(dropped)} "
              f"cannot fit, the others in {len(ranked)} ladders", file=sys.stderr)  # fmt: skip
    reprice = lambda rest, scale: pricing_lib.front_runners(
        rest, model, budget, profile, timing, scale=scale, prices=prices
    )
    seconds_of = functools.cache(
        lambda lay: model_time(prices[lay].step(), profile, **timing).total
    )
    peak_of = lambda lay: prices[lay].peak_bytes
    outcomes, more = _rounds(lambda some: run(some, seconds_of, peak_of), ranked, reprice, top,
                             prices, progress, deadline)  # fmt: skip
    return outcomes, dropped + more, prices, seconds


def _rounds(run, ranked, reprice, top: int, prices, progress: bool, deadline=None):
    """``(outcomes compiled, outcomes not compiled)``: the ``top`` fastest priced ladders of
    ``ranked`` compiled, then, while none fits, the next ``top`` (`pricing_lib.ROUNDS` rounds at
    most, none past the ``deadline``), repriced with the compiled programs' peaks:
    ``reprice(ladders, scale)`` ranks them again with each priced peak times the largest ratio
    of a compiled peak to its price."""
    outcomes: list[search.Outcome] = []
    dropped: list[search.Outcome] = []
    compiled: list = []  # the ladders compiled, as ranked
    scale = 1.0
    say = (lambda text: print(f"planning: {text}", file=sys.stderr)) if progress else None
    late = None  # why the rounds stopped for the time limit
    for _ in range(pricing_lib.ROUNDS):
        batch, ranked = ranked[:top], ranked[top:]
        if compiled and deadline is not None and (late := deadline.reason()):
            ranked = batch + ranked
            break
        if not batch:
            break
        if say:
            say(f"compiling the {len(batch)} fastest ladders that may fit" if not compiled else
                f"none of the {len(compiled)} ladders compiled fits (peaks up to {scale:.2f}x "
                f"their prices); compiling the next {len(batch)}, repriced")  # fmt: skip
        got = run(search.to_compile(batch))
        outcomes += got
        compiled += batch
        if any(o.status == search.FITS for o in outcomes):
            break
        ratios = [o.compiled.memory["peak"] / prices[o.layout].peak_bytes
                  for o in got if o.compiled is not None]  # fmt: skip
        scale = max([scale, *ratios])
        ranked, more, _ = reprice([ladder for _, ladder, _ in ranked], scale)
        dropped += more
    left = search.not_compiled([*compiled, *ranked], len(compiled), prices, late)
    return outcomes, dropped + left


def _candidates(outcomes, prices, profile, timing) -> list[Candidate]:
    """Each outcome with its modelled time, compiled and priced."""
    out = []
    for o in outcomes:
        host = 0 if o.compiled is None else o.compiled.memory.get("host", 0)
        if o.status == search.FITS and host > (profile.host_memory_bytes or host):
            why = f"offloads {format_bytes(host)} per device, over the host's memory"
            o = dataclasses.replace(o, status=search.TOO_BIG, reason=why)
        t = None if o.compiled is None else model_time(o.compiled, profile, **timing)
        p = prices.get(o.layout)
        out.append(
            Candidate(o, t, p, None if p is None else model_time(p.step(), profile, **timing))
        )
    return out
