"""A ladder of layouts compiled from the fastest to the most frugal, until one fits.

This is the part of the planner that runs where the devices are: in this process when it has
the layout's devices, or in a worker process started with that many emulated CPU devices. It
builds each layout's job with the user's ``build(layout)``, reads the state's bytes per device
from its shapes (no compile), compiles with ``Replicator.explain`` and returns plain results
that the planning process models and ranks.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from collections.abc import Callable
from typing import Any

from replicator._src.core import targets
from replicator._src.planner.layouts import Ladder, Layout
from replicator._src.report.cost_model import CompiledStep
from replicator._src.report.step_report import format_bytes

TRIES = 3  # layouts compiled at most in each ladder the pricing keeps (`pricing.front_runners`)
# (of up to twice as many it lists: a layout the compiler refuses, quickly, is not counted)

FITS, TOO_BIG, STATE_TOO_BIG, PRICED_TOO_BIG, SKIPPED, ERROR = (
    "fits",
    "too big",
    "state too big",
    "too big (priced)",
    "skipped",
    "error",
)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one layout.

    Attributes:
      layout: the layout.
      status: ``"fits"`` (compiled, peak within the budget), ``"too big"`` (compiled, over
        it), ``"state too big"`` (its state alone is over the budget: not compiled),
        ``"skipped"`` (not compiled: see ``reason``) or ``"error"`` (the build or the library
        refused it: see ``reason``).
      reason: why it was rejected or skipped, in words.
      state_bytes: the state's bytes per device, from its shapes and shardings (None if not
        built).
      compiled: the compiled program's figures (None if not compiled).
    """

    layout: Layout
    status: str
    reason: str = ""
    state_bytes: int | None = None
    compiled: CompiledStep | None = None

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.to_dict(),
            "status": self.status,
            "reason": self.reason,
            "state_bytes": self.state_bytes,
            "compiled": None if self.compiled is None else self.compiled.to_dict(),
        }


def resolve(build: Callable | str) -> Callable:
    """``build`` itself, or the function a ``"module:function"`` string names."""
    if callable(build):
        return build
    module, _, name = str(build).partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"rp.plan: build={build!r} names no importable function ({e}); give a function, or "
            f"'module:function' importable in a fresh process."
        ) from e


def state_bytes_per_device(state: Any) -> int:
    """The bytes one device holds of ``state``: each leaf's shard, from its shape and sharding."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(state):
        shape = tuple(np.shape(leaf))
        itemsize = np.dtype(leaf.dtype).itemsize
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * itemsize
    return int(total)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class _Searcher:
    def __init__(self, build: Callable, budget: int, compiled: Callable | None = None,
                 ask: Callable | None = None):  # fmt: skip
        self.build = build
        self.budget = budget
        self.outcomes: dict[Layout, Outcome] = {}
        self.compiled = compiled  # told each compiled layout's outcome as it comes
        self.ask = ask  # ask(layout): why a layout to try alone need not compile, or None

    def job(self, layout: Layout):
        out = self.build(layout)
        if not isinstance(out, tuple) or len(out) < 3:
            raise TypeError(
                f"rp.plan: build(layout) must return (repl, step_fn, state, *args); got "
                f"{type(out).__name__}."
            )
        repl, step_fn, state, *args = out
        mesh = {k: v for k, v in repl.mesh.shape.items() if v > 1 or k == "data"}
        want = {k: v for k, v in layout.mesh_shape.items() if v > 1 or k == "data"}
        if mesh != want:
            raise ValueError(
                f"rp.plan: build({layout}) made a Replicator on mesh {dict(repl.mesh.shape)}; "
                f"use Replicator(mesh_shape=layout.mesh_shape)."
            )
        return repl, step_fn, state, args

    def compile(self, layout: Layout) -> Outcome:
        if layout in self.outcomes:
            return self.outcomes[layout]
        start = time.perf_counter()
        size = None
        try:
            repl, step_fn, state, args = self.job(layout)
            size = state_bytes_per_device(state)
            report = repl.explain(step_fn, state, *args, stage_costs=False)
        except Exception as e:  # the library's refusal, or the user's build failing
            short = getattr(e, "shortfall", None) or targets.hbm_shortfall(e)  # the TPU's
            outcome = (
                Outcome(layout, ERROR, _first_line(e)) if short is None
                else Outcome(layout, TOO_BIG, f"the TPU compiler: {short}", size)
            )  # fmt: skip
        else:
            compiled = dataclasses.replace(
                CompiledStep.from_report(report), compile_seconds=time.perf_counter() - start
            )
            peak = compiled.memory["peak"]
            fits = peak <= self.budget
            reason = "" if fits else f"compiled peak {format_bytes(peak)} per device"
            outcome = Outcome(layout, FITS if fits else TOO_BIG, reason, size, compiled)
            if self.compiled is not None:
                self.compiled(outcome)
        self.outcomes[layout] = outcome
        return outcome

    def state_size(self, layout: Layout) -> int | Exception:
        """The bytes per device of ``layout``'s state (built from shapes), or the error."""
        try:
            _, _, state, _ = self.job(layout)
            return state_bytes_per_device(state)
        except Exception as e:
            return e

    def ladder(self, ladder: Ladder) -> list[Outcome]:
        """The outcome of each layout of ``ladder``: its state's size read once, then its groups
        searched in order, each by bisection, stopping where an earlier group's fit does less
        work."""
        layouts = ladder.layouts
        size = self.state_size(layouts[0])
        if isinstance(size, Exception):
            reason = _first_line(size)
            return [Outcome(lay, ERROR, reason) for lay in layouts]
        if size > self.budget:
            reason = f"its state alone is {format_bytes(size)} per device"
            return [Outcome(lay, STATE_TOO_BIG, reason, size) for lay in layouts]
        skipped: dict[Layout, str] = {}
        found: Layout | None = None  # the first fitting layout of an earlier group
        for group in ladder.groups:
            built = [lay for lay in layouts if lay in self.outcomes
                     and self.outcomes[lay].status != ERROR]  # fmt: skip
            if ladder.tries is not None and len(built) >= ladder.tries:
                for lay in group:
                    skipped[lay] = f"not tried: {len(built)} layouts of its ladder compiled"
                continue
            if found is not None:
                # A ladder's groups come fastest first (by price where the layouts were
                # priced, else least recomputed first): only fewer accumulation steps than
                # the earlier fit can be faster.
                limit = found.accumulate_steps
                for lay in group:
                    if lay.accumulate_steps >= limit:
                        skipped[lay] = f"{found} fits and comes first in its ladder"
                group = tuple(lay for lay in group if lay.accumulate_steps < limit)
                if not group:
                    continue
            if len(group) == 1 and self.ask is not None and (why := self.ask(group[0])):
                skipped[group[0]] = f"not compiled: {why}"  # what compiled since says so
                continue
            fit = self._first_fit(group, skipped)
            if fit is not None and found is None:
                found = fit
        out = []
        for lay in layouts:
            if lay in self.outcomes:
                out.append(dataclasses.replace(self.outcomes[lay], state_bytes=size))
            else:
                out.append(Outcome(lay, SKIPPED, skipped.get(lay, "not needed"), size))
        return out

    def _first_fit(self, group: tuple[Layout, ...], skipped: dict) -> Layout | None:
        """The first layout of ``group`` that fits (memory falls along the group), by bisection;
        None if even the last does not fit."""
        last = self.compile(group[-1])
        if last.status != FITS:
            for lay in group[:-1]:
                skipped[lay] = f"needs more memory than {group[-1]}, which does not fit"
            return None
        lo, hi = 0, len(group) - 1  # group[hi] fits
        while lo < hi:
            mid = (lo + hi) // 2
            if self.compile(group[mid]).status == FITS:
                hi = mid
            else:
                lo = mid + 1
        for i, lay in enumerate(group):
            if lay in self.outcomes:
                continue
            if i < hi:
                skipped[lay] = "needs more memory than a layout of its ladder that does not fit"
            else:
                skipped[lay] = f"{group[hi]} fits with fewer accumulation steps"
        return group[hi]


def sibling_key(ladder: Ladder) -> tuple:
    """Ladders with one key differ only in their ZeRO stage: `search_siblings` takes them
    together."""
    lay = ladder.layouts[0]
    return (lay.dcn_data, lay.data, lay.stage, lay.model, lay.context, lay.expert, lay.attention,
            lay.schedule, lay.microbatches, lay.repeats, lay.hybrid)  # fmt: skip


def search_siblings(
    build: Callable,
    ladders: list[Ladder],
    budget: int,
    compiled: Callable | None = None,
    ask: Callable | None = None,
) -> list[list[Outcome]]:
    """The outcomes of ladders that differ only in their ZeRO stage, searched from the highest
    stage (the least memory) down. Once a stage has no layout that fits, the lower stages need
    more memory for every layout (replicated state or gradients where it shards them), so they
    are not compiled: only their state's size is read. ``compiled(outcome)`` is told each
    compiled layout's outcome as it comes; ``ask(layout)``, before a layout to try alone
    compiles, says why it need not (`workers._Stop.why_not`), or None."""  # fmt: skip
    searcher = _Searcher(build, budget, compiled, ask)
    order = sorted(range(len(ladders)), key=lambda i: -ladders[i].layouts[0].zero_stage)
    out: list = [None] * len(ladders)
    evidence: Layout | None = None  # a frugal sibling that does not fit
    for i in order:
        ladder = ladders[i]
        if evidence is None:
            out[i] = searcher.ladder(ladder)
            statuses = {o.status for o in out[i]}
            if FITS not in statuses and statuses <= {TOO_BIG, STATE_TOO_BIG, SKIPPED}:
                evidence = ladder.groups[-1][-1]
            continue
        size = searcher.state_size(ladder.layouts[0])
        if isinstance(size, Exception):
            reason = _first_line(size)
            out[i] = [Outcome(lay, ERROR, reason) for lay in ladder.layouts]
        elif size > budget:
            reason = f"its state alone is {format_bytes(size)} per device"
            out[i] = [Outcome(lay, STATE_TOO_BIG, reason, size) for lay in ladder.layouts]
        else:
            reason = (
                f"needs more memory than {evidence} (ZeRO-{evidence.zero_stage} shards more), "
                f"which does not fit"
            )
            out[i] = [Outcome(lay, SKIPPED, reason, size) for lay in ladder.layouts]
    return out


def outcome_from_dict(raw: dict) -> Outcome:
    compiled = raw["compiled"]
    return Outcome(
        layout=Layout(**raw["layout"]),
        status=raw["status"],
        reason=raw["reason"],
        state_bytes=raw["state_bytes"],
        compiled=None if compiled is None else CompiledStep.from_dict(compiled),
    )


def worker_main(conn, num_devices: int, build) -> None:
    """A planning worker process: ``num_devices`` emulated CPU devices (set before JAX starts),
    then ``(ladders, budget)`` tasks from ``conn`` (siblings: `search_siblings`) searched and
    answered until None comes: ``("compiled", outcome)`` for each layout compiled as it comes,
    ``("ask", layout)`` before a layout to try alone compiles (answered with why it need not,
    or None), then ``("done", outcomes)``."""
    import jax

    jax.config.update("jax_num_cpu_devices", int(num_devices))
    jax.config.update("jax_platforms", "cpu")
    build = resolve(build)

    def ask(layout: Layout) -> str | None:  # the planning process answers at once
        conn.send(("ask", layout.to_dict()))
        return conn.recv()

    while (task := conn.recv()) is not None:
        ladders, budget = task
        found = search_siblings(
            build, ladders, budget, lambda o: conn.send(("compiled", o.to_dict())), ask
        )
        conn.send(("done", [[o.to_dict() for o in outcomes] for outcomes in found]))
    conn.close()


def to_compile(ranked) -> list[Ladder]:
    """The ladders of ``ranked`` (`pricing.front_runners`) as the search compiles them: each layout
    to try in a group of its own, so it compiles them in turn and stops at the first that
    fits."""
    return [Ladder(tuple((lay,) for lay in tries), TRIES) for _, _, tries in ranked]


def not_compiled(ranked, compiled: int, prices, late: str | None = None) -> list:
    """The outcomes of the layouts the search did not compile: those not tried in the first
    ``compiled`` ladders of ``ranked``, and every layout of the others (for ``late``, the time
    limit's reason, if that ended the search)."""
    out = []
    for i, (seconds, ladder, tries) in enumerate(ranked):
        if i < compiled:
            reason = f"not tried: {tries[0]} and up to {TRIES - 1} more of its ladder were"
        elif late:
            reason = f"not compiled: {late}"
        else:
            reason = (f"priced slower than the {compiled} ladders compiled "
                      f"({seconds * 1e3:.4g} ms modelled)")  # fmt: skip
        out += [Outcome(lay, SKIPPED, reason, int(prices[lay].state_bytes))
                for lay in ladder.layouts if i >= compiled or lay not in tries]  # fmt: skip
    return out
