"""Where `rp.plan` compiles: in this process, or in worker processes of their own.

A worker process starts with the layouts' number of emulated CPU devices (or loads libtpu for a
TPU target) and searches one task at a time: the ladders that differ only in their ZeRO stage
(`search.search_siblings`). A process that dies takes only its task with it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os

from replicator._src.planner import progress as progress_lib
from replicator._src.planner import search


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


class _Stop:
    """Which ladders need not be compiled any more (`PricingOptions.skip_slower`): those whose
    first layout's price (``price_of(layout)``, seconds), times the least that compiled layouts
    of its kind (`Layout.kind`) have modelled over their prices, is over ``margin`` times the
    fastest compiled layout that fits (``score(outcome)``, seconds) found so far. (Llama 3.1 8B
    on v6e-256: pipelines priced 4.8-5.1 s compiled to 7.1-9.3 s; the layouts without one to
    1.09-1.7 times their prices.)"""

    def __init__(self, price_of, score, margin):
        self.price_of, self.score, self.margin = price_of, score, margin
        self.best, self.ratios = None, {}

    def record(self, outcomes) -> None:
        if self.price_of is None or self.score is None:
            return
        for o in outcomes:
            if o.compiled is None:
                continue
            seconds, kind = self.score(o), o.layout.kind
            self.ratios[kind] = min(self.ratios.get(kind, seconds), seconds / self.price_of(o.layout))  # fmt: skip
            if o.status == search.FITS and (self.best is None or seconds < self.best[0]):
                self.best = (seconds, o.layout)

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
    build, ladders, budget, n, workers, progress, score, price_of=None, skip_slower=None
) -> list[search.Outcome]:
    """Every ladder's outcomes, in the order of ``ladders``; siblings (ladders that differ in
    their ZeRO stage only) are searched together, by one process. With ``price_of`` (a
    layout's priced seconds) and ``skip_slower``, a ladder priced over ``skip_slower`` times a
    compiled fit (`_Stop`) is not compiled, and its compile is stopped if it has begun: its
    layouts are skipped."""
    groups: dict[tuple, list[int]] = {}
    for i, ladder in enumerate(ladders):
        groups.setdefault(search.sibling_key(ladder), []).append(i)
    tasks = list(groups.values())
    bar = progress_lib.Progress(len(ladders), progress, score)
    results: list = [None] * len(ladders)
    stop = _Stop(price_of, score, skip_slower)
    try:
        if workers == 0:
            fn = search.resolve(build)
            for task in tasks:
                why = stop.reason([ladders[i] for i in task])
                found = (
                    _skipped(ladders, task, f"not compiled: {why}") if why else
                    search.search_siblings(fn, [ladders[i] for i in task], budget)
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


def _skipped(ladders, task: list[int], reason: str) -> list[list[search.Outcome]]:
    return [[search.Outcome(lay, search.SKIPPED, reason) for lay in ladders[i].layouts]
            for i in task]  # fmt: skip


def _in_processes(build, ladders, tasks, budget, n, workers, results, bar, stop) -> None:
    """Fills ``results`` from ``workers`` processes with ``n`` emulated CPU devices, each
    searching one task (a list of sibling ladders) at a time. A process that dies (out of
    memory, a check failure in XLA's compiler) on several siblings has each searched again on
    its own; one that dies on one ladder takes only that ladder with it: its layouts are
    errors that say so, and a new process goes on with the others. A task that ``stop`` says
    need not be compiled is not sent, or its process is ended and another started."""
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

    seen: dict[int, dict] = {}  # each task's layouts compiled so far, as they come

    def finish(t: int, found) -> None:
        for i, outcomes in zip(tasks[t], found, strict=True):
            results[i] = outcomes
            stop.record(outcomes)
            bar.advance(ladders[i], outcomes)

    try:
        for _ in range(min(workers, len(tasks))):
            start()
        while todo or busy:
            while todo and idle:
                t = todo.pop()
                if why := stop.reason([ladders[i] for i in tasks[t]]):
                    finish(t, _skipped(ladders, tasks[t], f"not compiled: {why}"))
                    continue
                conn = idle.pop()
                conn.send(([ladders[i] for i in tasks[t]], budget))
                busy[conn] = t
            if not busy:
                continue
            ready = multiprocessing.connection.wait([*busy, *(procs[c].sentinel for c in busy)])
            for conn in list(busy):
                proc, t = procs[conn], busy[conn]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                try:
                    kind, raw = conn.recv()
                    if kind == "compiled":  # one layout of the task: the task goes on
                        outcome = search.outcome_from_dict(raw)
                        seen.setdefault(t, {})[outcome.layout] = outcome
                        stop.record([outcome])
                        continue
                    del busy[conn]
                    found = [[search.outcome_from_dict(o) for o in f] for f in raw]
                    finished += 1
                    idle.append(conn)
                except (EOFError, OSError):  # died before it answered
                    del busy[conn]
                    proc.join()
                    conn.close()
                    del procs[conn]
                    if finished == 0 and proc.exitcode == 1:
                        raise RuntimeError(WORKERS_DIED) from None
                    if len(tasks[t]) > 1:  # siblings: each again on its own, so that only
                        # the ladder whose compile ends its process is lost
                        for i in tasks[t]:
                            tasks.append([i])
                            todo.insert(0, len(tasks) - 1)
                        start()
                        continue
                    reason = (
                        f"its worker process died (exit code {proc.exitcode}) compiling this "
                        f"ladder: out of memory, or the compiler ended it (a failed check in XLA or "
                        f"libtpu)"
                    )
                    found = [[search.Outcome(lay, search.ERROR, reason)
                              for lay in ladders[i].layouts] for i in tasks[t]]  # fmt: skip
                    if todo:
                        start()
                finish(t, found)
            for conn in list(busy):  # compiles a fit found since has made needless
                if why := stop.reason([ladders[i] for i in tasks[busy[conn]]]):
                    procs[conn].kill()
                    procs.pop(conn).join()
                    conn.close()
                    t = busy.pop(conn)
                    kept = seen.get(t, {})  # what it compiled before: kept
                    finish(t, [[kept.get(lay) or search.Outcome(lay, search.SKIPPED, f"stopped: {why}")
                                for lay in ladders[i].layouts] for i in tasks[t]])  # fmt: skip
                    if todo:
                        start()
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
rp.plan: the first worker process failed before planning one ladder of layouts. Workers start \
a fresh Python (multiprocessing's "spawn"), which imports your script again: run it under

    if __name__ == "__main__":
        report = rp.plan(build, layouts, ...)

and make `build` a module-level function (or "module:function"), importable there. Or plan in \
this process with workers=0, if it has the layouts' number of devices."""
