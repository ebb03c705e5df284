"""Where `rp.plan` compiles: in this process, or in worker processes of their own.

A worker process starts with the layouts' number of emulated CPU devices (or loads libtpu for a
TPU target) and searches one task at a time: the ladders that differ only in their ZeRO stage
(`search.search_siblings`). A process that dies takes only its task with it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import time

from replicator._src.planner import progress as progress_lib
from replicator._src.planner import search
from replicator._src.planner.layouts import Ladder, Layout
from replicator._src.report.step_report import format_bytes


def count(workers: int | None, n: int, here: bool = True) -> int:
    """How many worker processes compile: ``workers`` checked (0: this process, which must then
    have ``n`` devices when it compiles ``here``), or by default none where this process has
    ``n`` CPU devices, else ``min(2, cpu_count)``."""
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


class Deadline:
    """The plan's time limit (`PricingOptions.time_limit`): once ``limit`` seconds have passed
    since ``start`` (`time.perf_counter`), or the compiles so far, at their mean length, say the
    next would end past them, no compile begins (one begun runs to its end). ``say`` prints
    a line the first time it stops one."""

    def __init__(self, limit: float | None, start: float, say=None):
        self.limit, self.start, self.say = limit, start, say
        self.seconds: dict = {}  # each compiled layout's compile seconds

    def record(self, outcome) -> None:
        if outcome.compiled is not None and outcome.compiled.compile_seconds:
            self.seconds[outcome.layout] = outcome.compiled.compile_seconds

    def reason(self) -> str | None:
        """Why no compile may begin now, or None."""
        if self.limit is None:
            return None
        gone = time.perf_counter() - self.start
        mean = sum(self.seconds.values()) / len(self.seconds) if self.seconds else 0.0
        if gone + mean <= self.limit:
            return None
        when = (f"{TIME_LIMIT} of {self.limit:g} s: {gone:.0f} s gone"
                + (f", and a compile takes {mean:.0f} s here" if mean else ""))  # fmt: skip
        if self.say is not None:
            self.say(f"planning: {when}; the ladders left are not compiled (raise time_limit, "
                     f"or --time-limit, to compile them)")  # fmt: skip
            self.say = None
        return f"{when} (raise time_limit, or --time-limit, to compile it)"


TIME_LIMIT = "the plan's time limit"
"""How the reason of a layout not compiled for the time limit begins."""


def say_on_stderr(text: str) -> None:
    print(text, file=sys.stderr)


class _Stop:
    """Which ladders need not be compiled any more (`PricingOptions.skip_slower`): those whose
    first layout's price (``price_of(layout)``, seconds), times the least that compiled layouts
    of its kind (`Layout.kind`) have modelled over their prices, is over ``margin`` times the
    fastest compiled layout that fits (``score(outcome)``, seconds) found so far. (Llama 3.1 8B
    on v6e-256: pipelines priced 4.8-5.1 s compiled to 7.1-9.3 s; the layouts without one to
    1.09-1.7 times their prices.)

    And which layouts to try need not compile (`why_not`): those priced slower so, and those
    whose priced peak (``peak_of(layout)``, bytes), times the least that compiled layouts of its
    kind and remat policy have peaked over their prices, is over ``budget``. (Mixtral 8x22B on
    v6e-256: full remat with an ``expert`` axis peaked at 1.21-1.39 times its prices, and three
    such layouts priced at 30.9-33.9 GiB compiled over the 32 GiB, 116-193 s each.)"""

    def __init__(self, price_of, score, margin, peak_of=None, budget=None, deadline=None):
        self.price_of, self.score, self.margin = price_of, score, margin
        self.peak_of, self.budget, self.deadline = peak_of, budget, deadline
        self.best, self.ratios, self.peaks = None, {}, {}

    def record(self, outcomes) -> None:
        for o in outcomes:
            if self.deadline is not None:
                self.deadline.record(o)
            if o.compiled is None or self.price_of is None or self.score is None:
                continue
            seconds, kind = self.score(o), o.layout.kind
            ratio = seconds / self.price_of(o.layout)  # compiled over priced
            self.ratios[kind] = min(self.ratios.get(kind, ratio), ratio)
            if self.peak_of is not None:
                key = (kind, o.layout.remat)
                peak = o.compiled.memory["peak"] / self.peak_of(o.layout)
                self.peaks[key] = min(self.peaks.get(key, peak), peak)
            if o.status == search.FITS and (self.best is None or seconds < self.best[0]):
                self.best = (seconds, o.layout)

    def record_one(self, outcome) -> None:
        self.record([outcome])

    def why_not(self, layout) -> str | None:
        """Why ``layout``, a layout to try, need not compile now: priced over the budget by what
        its kind and remat policy have compiled to, slower than a fit by `reason`, or past the
        time limit (`time_out`); or None."""
        peak = None if self.peak_of is None else self.peaks.get((layout.kind, layout.remat))
        if peak is not None and self.peak_of(layout) * peak > self.budget:
            return (f"its priced peak {format_bytes(self.peak_of(layout))} x {peak:.2f} (the "
                    f"least its kind and remat policy compiled to over their prices) is over "
                    f"{format_bytes(self.budget)}")  # fmt: skip
        return self.reason([Ladder(((layout,),))]) or self.time_out()

    def time_out(self) -> str | None:
        """Why no compile may begin now (`Deadline`), or None."""
        return None if self.deadline is None else self.deadline.reason()

    def reason(self, ladders) -> str | None:
        """Why ``ladders`` need not be compiled, or None."""
        if self.price_of is None or self.best is None or self.margin is None:
            return None
        firsts = [ladder.layouts[0] for ladder in ladders]
        seconds = min(self.price_of(lay) * self.ratios.get(lay.kind, 1.0) for lay in firsts)
        if seconds <= self.margin * self.best[0]:
            return None
        lay = min(firsts, key=self.price_of)
        ratio = self.ratios.get(lay.kind, 1.0)
        times = "" if ratio == 1.0 else f" x {ratio:.2f} (its kind's compiled over priced)"
        return (f"priced {self.price_of(lay) * 1e3:.4g} ms{times}, over {self.margin:g} x the "
                f"{self.best[0] * 1e3:.4g} ms of {self.best[1]}, compiled and fits")  # fmt: skip


def run(
    build,
    ladders,
    budget,
    n,
    workers,
    progress,
    score,
    price_of=None,
    skip_slower=None,
    peak_of=None,
    deadline: Deadline | None = None,
) -> list[search.Outcome]:
    """Every ladder's outcomes, in the order of ``ladders``; siblings (ladders that differ in
    their ZeRO stage only) are searched together, by one process. With ``price_of`` (a
    layout's priced seconds) and ``skip_slower``, a ladder priced over ``skip_slower`` times a
    compiled fit (`_Stop`) is not compiled, and its compile is stopped if it has begun: its
    layouts are skipped. With ``peak_of`` (a layout's priced peak bytes) too, a layout to try
    that what has compiled says will not fit, or be slower, is not compiled
    (`_Stop.why_not`). Past the ``deadline`` (`Deadline`) no compile begins."""  # fmt: skip
    groups: dict[tuple, list[int]] = {}
    for i, ladder in enumerate(ladders):
        groups.setdefault(search.sibling_key(ladder), []).append(i)
    tasks = list(groups.values())
    bar = progress_lib.Progress(len(ladders), progress, score)
    results: list = [None] * len(ladders)
    stop = _Stop(price_of, score, skip_slower, peak_of, budget, deadline)
    try:
        if workers == 0:
            fn = search.resolve(build)
            for task in tasks:
                why = stop.reason([ladders[i] for i in task]) or stop.time_out()
                found = (
                    _skipped(ladders, task, f"not compiled: {why}") if why else
                    search.search_siblings(fn, [ladders[i] for i in task], budget,
                                           stop.record_one, stop.why_not)
                )  # fmt: skip
                for i, outcomes in zip(task, found, strict=True):
                    results[i] = outcomes
                    stop.record(outcomes)
                    bar.advance(ladders[i], outcomes)
        else:
            _in_processes(build, ladders, tasks, budget, n, workers, results, bar, stop)
    finally:
        bar.close()
    return [o for outcomes in results for o in outcomes]


def _skipped(ladders, task: list[int], reason: str, status: str = search.SKIPPED) -> list:
    """Each ladder of ``task``'s outcomes, every layout ``status`` (skipped) for ``reason``."""
    return [[search.Outcome(lay, status, reason) for lay in ladders[i].layouts] for i in task]


def _in_processes(build, ladders, tasks, budget, n, workers, results, bar, stop) -> None:
    """Fills ``results`` from ``workers`` processes with ``n`` emulated CPU devices, each
    searching one task (a list of sibling ladders) at a time. A process that dies (out of
    memory, a check failure in XLA's compiler) on several siblings has each searched again on
    its own; one that dies on one ladder takes only that ladder with it: its layouts are
    errors that say so, and a new process goes on with the others. A task that ``stop`` says
    need not be compiled is not sent, or its process is ended and another started."""
    pool = _Pool(build, ladders, tasks, n, results, bar, stop)
    try:
        for _ in range(min(workers, len(tasks))):
            pool.start()
        while pool.todo or pool.busy:
            while pool.todo and pool.idle:
                t = pool.todo.pop()
                if why := stop.reason(pool.of(t)) or stop.time_out():
                    pool.finish(t, _skipped(ladders, tasks[t], f"not compiled: {why}"))
                    continue
                conn = pool.idle.pop()
                conn.send((pool.of(t), budget))
                pool.busy[conn] = t
            if not pool.busy:
                continue
            procs = pool.procs
            ready = multiprocessing.connection.wait(
                [*pool.busy, *(procs[c].sentinel for c in pool.busy)]
            )
            for conn in list(pool.busy):
                if conn in ready or procs[conn].sentinel in ready:
                    pool.receive(conn)
            pool.stop_needless()
    finally:
        pool.close()


class _Pool:
    """`_in_processes`' worker processes: which are idle, which busy with which task, what
    each task has compiled so far."""

    def __init__(self, build, ladders, tasks, n, results, bar, stop):
        self.build, self.ladders, self.tasks, self.n = build, ladders, tasks, n
        self.results, self.bar, self.stop = results, bar, stop
        self.context = multiprocessing.get_context("spawn")
        self.todo = list(range(len(tasks)))[::-1]
        self.idle: list = []
        self.busy: dict = {}  # connection -> task index
        self.procs: dict = {}  # connection -> process
        self.seen: dict[int, dict] = {}  # each task's layouts compiled so far, as they come
        self.finished = 0

    def of(self, t: int) -> list:
        return [self.ladders[i] for i in self.tasks[t]]

    def start(self) -> None:
        parent, child = self.context.Pipe()
        proc = self.context.Process(
            target=search.worker_main, args=(child, self.n, self.build), daemon=True
        )
        proc.start()
        child.close()
        self.procs[parent] = proc
        self.idle.append(parent)

    def finish(self, t: int, found) -> None:
        for i, outcomes in zip(self.tasks[t], found, strict=True):
            self.results[i] = outcomes
            self.stop.record(outcomes)
            self.bar.advance(self.ladders[i], outcomes)

    def receive(self, conn) -> None:
        """What ``conn``'s worker says: a layout compiled (its task goes on), its task's
        outcomes, or nothing (it died)."""
        t = self.busy[conn]
        try:
            kind, raw = conn.recv()
        except (EOFError, OSError):  # died before it answered
            self.died(conn)
            return
        if kind == "ask":  # a layout to try: compile it?
            conn.send(self.stop.why_not(Layout(**raw)))
            return
        if kind == "compiled":
            outcome = search.outcome_from_dict(raw)
            self.seen.setdefault(t, {})[outcome.layout] = outcome
            self.stop.record([outcome])
            return
        del self.busy[conn]
        self.finished += 1
        self.idle.append(conn)
        self.finish(t, [[search.outcome_from_dict(o) for o in f] for f in raw])

    def died(self, conn) -> None:
        t, proc = self.busy.pop(conn), self.procs.pop(conn)
        proc.join()
        conn.close()
        if self.finished == 0 and proc.exitcode == 1:
            raise RuntimeError(WORKERS_DIED) from None
        if len(self.tasks[t]) > 1:  # siblings: each again on its own, so that only the
            # ladder whose compile ends its process is lost
            for i in self.tasks[t]:
                self.tasks.append([i])
                self.todo.insert(0, len(self.tasks) - 1)
            self.start()
            return
        reason = (
            f"its worker process died (exit code {proc.exitcode}) compiling this ladder: out "
            f"of memory, or the compiler ended it (a failed check in XLA or libtpu)"
        )
        self.finish(t, _skipped(self.ladders, self.tasks[t], reason, search.ERROR))
        if self.todo:
            self.start()

    def stop_needless(self) -> None:
        """Ends the processes compiling a task that a fit found since has made needless; what
        each compiled before is kept."""
        for conn in list(self.busy):
            if why := self.stop.reason(self.of(self.busy[conn])):
                self.procs[conn].kill()
                self.procs.pop(conn).join()
                conn.close()
                t = self.busy.pop(conn)
                kept = self.seen.get(t, {})
                stopped = _skipped(self.ladders, self.tasks[t], f"stopped: {why}")
                self.finish(t, [[kept.get(o.layout, o) for o in f] for f in stopped])
                if self.todo:
                    self.start()

    def close(self) -> None:
        for conn, proc in self.procs.items():
            try:
                conn.send(None)  # done: the worker returns
            except OSError:
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
            conn.close()


WORKERS_DIED = """\
rp.plan: the first worker process failed before planning one ladder of layouts. Workers start \
a fresh Python (multiprocessing's "spawn"), which imports your script again: run it under

    if __name__ == "__main__":
        report = rp.plan(build, layouts, ...)

and make `build` a module-level function (or "module:function"), importable there. Or plan in \
this process with workers=0, if it has the layouts' number of devices."""
