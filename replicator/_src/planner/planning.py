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
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
from collections.abc import Callable, Sequence

from replicator._src.core import targets
from replicator._src.planner import pricing, search
from replicator._src.planner import progress as progress_lib
from replicator._src.planner.layouts import Ladder, Layout
from replicator._src.planner.plan_table import renderable as _renderable
from replicator._src.report.cost_model import ModelledTime, model_time
from replicator._src.report.hardware import Hardware, hardware_profile, parse_bytes
from replicator._src.sharded import kernels


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout's outcome (`search.Outcome`) with its modelled time (None unless compiled)."""

    outcome: search.Outcome
    time: ModelledTime | None = None
    priced: pricing.Price | None = None
    priced_time: ModelledTime | None = None

    @property
    def layout(self) -> Layout:
        return self.outcome.layout

    @property
    def fits(self) -> bool:
        return self.outcome.status == search.FITS

    @property
    def peak_bytes(self) -> int | None:
        c = self.outcome.compiled
        return None if c is None else c.memory["peak"]

    def to_dict(self) -> dict:
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
        because a layout of the same family that does less work fits.
      seconds: the planning's wall time.
      workers: processes that compiled (0: this process).
      priced: layouts priced from formulas before any compile (0 without ``model``).
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
                "priced": self.priced,
                "priced_seconds": self.priced_seconds,
            },
            indent=2,
        )

    def table(self, top: int = 20) -> str:
        """The report as text: the ``top`` fastest layouts that fit, and ``top`` rejected."""
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=130, color_system=None, soft_wrap=False).print(
            _renderable(self, top)
        )
        return buffer.getvalue().rstrip()

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
    model_flops: float | None = None,
    overlap: float = 0.0,
    workers: int | None = None,
    progress: bool = False,
    target: str | targets.Target | None = None,
    model: pricing.ModelShape | None = None,
    compile_top: int = 4,
) -> PlanReport:
    """Ranks ``layouts`` by modelled step time among those whose compiled step fits ``memory``.

    For each family of layouts (see `enumerate_layouts`): build the job with ``build(layout)``,
    reject the family if its state alone exceeds the budget (from shapes: nothing compiled),
    else compile its layouts with ``Replicator.explain`` from the fastest to the most frugal
    until one fits, and model the step time of each compiled layout on ``hardware``
    (`cost_model.model_time`: compute at peak, collective bytes at the bandwidth of the link
    they cross, the pipeline bubble). Equivalent to::

        for family in layouts:
            for layout in family (fastest first):
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
      layouts: families from `enumerate_layouts`, or single `Layout` objects (each tried alone).
      hardware: a profile (`Hardware`), a built-in name (``"tpu-v5e"``, ``"h100"``, ...,
        ``"cpu"``: this machine, measured) or a YAML/JSON file.
      memory: the budget per device (``"16GiB"`` or bytes); default the profile's memory.
      model_flops: the model's FLOPs per step over all devices, for the MFU column.
      overlap: the share (0 to 1) of the data-axis collectives (and gradient reductions over
        the context and expert axes) assumed to run behind compute.
      workers: processes that compile, each with N emulated CPU devices; 0 compiles here
        (this process must have exactly N devices). Default: here if this process has N
        devices, else ``min(2, cpu_count)``.
      progress: show a progress bar (on a terminal; elsewhere a line per family planned).
      target: a TPU target (``"v5p-16"`` or `rp.targets.tpu_target`): ``build`` makes its Replicator on
        ``rp.tpu_devices(target)``, the layouts compile for that TPU with libtpu (in this
        process by default; in ``workers`` processes when given, each loading libtpu with
        ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``), and ``hardware`` defaults to the target's chip,
        its slice the island.
      model: the model's sizes (`pricing.ModelShape`; ``gpt.model_shape(config, batch)``):
        then every layout is first priced from formulas, in microseconds and without
        compiling (state, peak memory, FLOPs, collective bytes), a family is dropped where
        even its most frugal layout's priced peak is well over ``memory``
        (`pricing.MARGIN`), and only
        the ``compile_top`` families whose fastest priced layouts model fastest (each kind's
        fastest first: `pricing.front_runners`) are compiled and ranked by their programs. Each candidate carries its priced figures beside its
        compiled ones. Without ``model`` every family is compiled.
      compile_top: how many families to compile, with ``model``: the fastest by their priced
        time, then as many more while none of them fits (`pricing.ROUNDS` rounds at most).

    Returns:
      A `PlanReport`: print it for the ranked table; ``.best`` is the fastest layout that fits.

    Raises:
      ValueError: for layouts of different device counts, a bad budget or profile, or
        ``workers=0`` in a process without N devices.
    """
    start = time.perf_counter()
    families = [f if isinstance(f, Ladder) else Ladder(((f,),)) for f in layouts]
    if not families:
        raise ValueError(
            "rp.plan: layouts is empty; pass rp.planner.enumerate_layouts(...)'s families."
        )
    for f in families:
        if not isinstance(f, Ladder) or not all(isinstance(x, Layout) for x in f.layouts):
            raise ValueError(
                f"rp.plan: layouts must hold rp.planner.Layout or families from rp.planner.enumerate_layouts; "
                f"got {f!r}."
            )
    sizes = {lay.num_devices for f in families for lay in f.layouts}
    if len(sizes) != 1:
        raise ValueError(
            f"rp.plan: the layouts use {sorted(sizes)} devices; plan one device count at a time."
        )
    (n,) = sizes
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
    if not 0 <= overlap <= 1:
        raise ValueError(f"rp.plan: overlap must be between 0 and 1; got {overlap!r}.")
    if target is not None:  # libtpu's devices, here or in processes of their own
        workers = 0 if workers is None else _workers(workers, n, here=False)
        if workers:
            os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # each worker loads libtpu too
    else:
        workers = _workers(workers, n)
    timing = dict(overlap=overlap, model_flops=model_flops)
    prices, not_compiled, priced_seconds = {}, [], 0.0
    emulated = n if target is None else 1  # a target's workers compile for libtpu's devices
    score = lambda outcome: model_time(outcome.compiled, profile, **timing).total
    run = lambda fams: _run(build, fams, budget, emulated, workers, progress, score) if fams else []
    if model is None:
        outcomes = run(families)
    else:
        if isinstance(compile_top, bool) or not isinstance(compile_top, int) or compile_top < 1:
            raise ValueError(f"rp.plan: compile_top must be an int >= 1; got {compile_top!r}.")
        outcomes, not_compiled, prices, priced_seconds = _priced_rounds(
            run, families, model, budget, profile, timing, compile_top, progress, target is None
        )
    candidates = _candidates([*outcomes, *not_compiled], prices, profile, timing)
    ranked = sorted((c for c in candidates if c.fits), key=lambda c: c.time.total)
    order = {search.TOO_BIG: 0, search.STATE_TOO_BIG: 1, search.PRICED_TOO_BIG: 2,
             search.ERROR: 3, search.SKIPPED: 4}  # fmt: skip
    rejected = sorted(
        (c for c in candidates if not c.fits),
        key=lambda c: (order[c.outcome.status], -(c.peak_bytes or c.outcome.state_bytes or 0)),
    )
    return PlanReport(
        num_devices=n, memory_budget=budget, hardware=profile, overlap=overlap,
        model_flops=model_flops, ranked=tuple(ranked), rejected=tuple(rejected),
        seconds=time.perf_counter() - start, workers=workers, priced=len(prices),
        priced_seconds=priced_seconds,
    )  # fmt: skip


def _priced_rounds(run, families, model, budget, profile, timing, top, progress, on_cpu):
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
    ranked, dropped, prices = pricing.front_runners(families, model, budget, profile, timing)
    seconds = time.perf_counter() - t0
    if progress:
        print(f"planning: priced {len(prices)} layouts in {seconds:.1f} s: {len(dropped)} "
              f"cannot fit, the others in {len(ranked)} families", file=sys.stderr)  # fmt: skip
    reprice = lambda rest, scale: pricing.front_runners(
        rest, model, budget, profile, timing, scale=scale, prices=prices
    )
    outcomes, more = _rounds(run, ranked, reprice, top, prices, progress)
    return outcomes, dropped + more, prices, seconds


def _rounds(run, ranked, reprice, top: int, prices, progress: bool):
    """``(outcomes compiled, outcomes not compiled)``: the ``top`` fastest priced families of
    ``ranked`` compiled, then, while none fits, the next ``top`` (`pricing.ROUNDS` rounds at
    most), repriced with the compiled programs' peaks: ``reprice(families, scale)`` ranks them
    again with each priced peak times the largest ratio of a compiled peak to its price."""
    outcomes: list[search.Outcome] = []
    dropped: list[search.Outcome] = []
    compiled: list = []  # the families compiled, as ranked
    scale = 1.0
    say = (lambda text: print(f"planning: {text}", file=sys.stderr)) if progress else None
    for _ in range(pricing.ROUNDS):
        batch, ranked = ranked[:top], ranked[top:]
        if not batch:
            break
        if say:
            say(f"compiling the {len(batch)} fastest families that may fit" if not compiled else
                f"none of the {len(compiled)} families compiled fits (peaks up to {scale:.2f}x "
                f"their prices); compiling the next {len(batch)}, repriced")  # fmt: skip
        got = run(pricing.to_compile(batch))
        outcomes += got
        compiled += batch
        if any(o.status == search.FITS for o in outcomes):
            break
        ratios = [o.compiled.memory["peak"] / prices[o.layout].peak_bytes
                  for o in got if o.compiled is not None]  # fmt: skip
        scale = max([scale, *ratios])
        ranked, more, _ = reprice([f for _, f, _ in ranked], scale)
        dropped += more
    return outcomes, dropped + pricing.not_compiled([*compiled, *ranked], len(compiled), prices)


def _candidates(outcomes, prices, profile, timing) -> list[Candidate]:
    """Each outcome with its modelled time, compiled and priced."""
    out = []
    for o in outcomes:
        t = None if o.compiled is None else model_time(o.compiled, profile, **timing)
        p = prices.get(o.layout)
        out.append(
            Candidate(o, t, p, None if p is None else model_time(p.step(), profile, **timing))
        )
    return out


def _workers(workers: int | None, n: int, here: bool = True) -> int:
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"rp.plan: workers must be an int >= 0; got {workers!r}.")
        if workers == 0 and here:
            import jax

            if jax.device_count() != n:
                raise ValueError(
                    f"rp.plan: workers=0 compiles in this process, which has "
                    f"{jax.device_count()} devices, not the layouts' {n}; use workers=1 or more "
                    f"(processes with {n} emulated CPU devices)."
                )
        return workers
    import jax

    if jax.device_count() == n and jax.devices()[0].platform == "cpu":
        return 0
    return max(1, min(2, os.cpu_count() or 1))


def _run(build, families, budget, n, workers, progress, score) -> list[search.Outcome]:
    """Every family's outcomes, in the order of ``families``; siblings (families that differ in
    their ZeRO stage only) are searched together, by one process."""
    groups: dict[tuple, list[int]] = {}
    for i, family in enumerate(families):
        groups.setdefault(search.sibling_key(family), []).append(i)
    tasks = list(groups.values())
    bar = progress_lib.Progress(len(families), progress, score)
    results: list = [None] * len(families)
    try:
        if workers == 0:
            fn = search.resolve(build)
            for task in tasks:
                found = search.search_siblings(fn, [families[i] for i in task], budget)
                for i, outcomes in zip(task, found, strict=True):
                    results[i] = outcomes
                    bar.advance(families[i], outcomes)
        else:
            _in_workers(build, families, tasks, budget, n, workers, results, bar)
    finally:
        bar.close()
    return [o for family in results for o in family]


def _in_workers(build, families, tasks, budget, n, workers, results, bar) -> None:
    """Fills ``results`` from ``workers`` processes with ``n`` emulated CPU devices, each
    searching one task (a list of sibling families) at a time. A process that dies (out of
    memory, a check failure in XLA's compiler) takes only its task with it: those families are
    errors that say so, and a new process goes on with the others."""
    context = multiprocessing.get_context("spawn")
    todo = list(range(len(tasks)))[::-1]
    idle: list = []
    busy: dict = {}  # connection -> task index
    procs: dict = {}  # connection -> process
    finished = 0

    def start():
        parent, child = context.Pipe()
        proc = context.Process(target=search.worker_main, args=(child, n, build), daemon=True)
        proc.start()
        child.close()
        procs[parent] = proc
        idle.append(parent)

    try:
        for _ in range(min(workers, len(tasks))):
            start()
        while todo or busy:
            while todo and idle:
                conn = idle.pop()
                t = todo.pop()
                conn.send(([families[i] for i in tasks[t]], budget))
                busy[conn] = t
            ready = multiprocessing.connection.wait([*busy, *(procs[c].sentinel for c in busy)])
            for conn in list(busy):
                proc, t = procs[conn], busy[conn]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                del busy[conn]
                try:
                    found = [[search.outcome_from_dict(o) for o in f] for f in conn.recv()]
                    finished += 1
                    idle.append(conn)
                except (EOFError, OSError):  # died before it answered
                    proc.join()
                    conn.close()
                    del procs[conn]
                    if finished == 0 and proc.exitcode == 1:
                        raise RuntimeError(WORKERS_DIED) from None
                    reason = (
                        f"its worker process died (exit code {proc.exitcode}) compiling this "
                        f"family: out of memory, or a crash in XLA's CPU compiler"
                    )
                    found = [[search.Outcome(lay, search.ERROR, reason)
                              for lay in families[i].layouts] for i in tasks[t]]  # fmt: skip
                    if todo:
                        start()
                for i, outcomes in zip(tasks[t], found, strict=True):
                    results[i] = outcomes
                    bar.advance(families[i], outcomes)
    finally:
        for conn, proc in procs.items():
            try:
                conn.send(None)  # done: the worker returns
            except OSError:
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
            conn.close()


WORKERS_DIED = """\
rp.plan: the first worker process failed before planning one family of layouts. Workers start \
a fresh Python (multiprocessing's "spawn"), which imports your script again: run it under

    if __name__ == "__main__":
        report = rp.plan(build, layouts, ...)

and make `build` a module-level function (or "module:function"), importable there. Or plan in \
this process with workers=0, if it has the layouts' number of devices."""
