"""`rp.plan`'s progress: a bar on a terminal, a line per ladder planned elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from replicator._src.planner import search
from replicator._src.planner.layouts import Ladder


class Progress:
    """A bar on a terminal; elsewhere (a log file, a notebook's captured stderr) one line per
    ladder planned: the count and the time so far, the layouts compiled, and the best layout so
    far with its modelled time (``score(outcome)``, seconds).

    >>> import io, contextlib
    >>> from replicator._src.planner.layouts import Layout
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     p = Progress(2, True, score=lambda o: 0.25)
    ...     lay = Layout(data=8)
    ...     p.advance(Ladder(((lay,),)), [search.Outcome(lay, search.FITS, compiled=object())])
    >>> print(err.getvalue().splitlines()[-1].split(") ", 1)[1])
    1 compiled: data=8; best so far data=8, 250 ms
    """

    def __init__(self, total: int, show: bool, score: Callable | None = None):
        self.bar, self.lines, self.total, self.done = None, False, total, 0
        self.score, self.compiled, self.best = score, 0, None
        self.start = time.perf_counter()
        if show and sys.stderr.isatty():
            from rich.progress import Progress as Bar

            self.bar = Bar(transient=True)
            self.task = self.bar.add_task("planning: compiling ladders of layouts", total=total)
            self.bar.start()
        elif show:
            self.lines = True
            print(f"planning: {total} ladders of layouts to compile", file=sys.stderr, flush=True)

    def advance(self, ladder: Ladder, outcomes=()) -> None:
        """One more ``ladder`` planned, with its ``outcomes``."""
        self.done += 1
        self.compiled += sum(o.compiled is not None for o in outcomes)
        for o in outcomes:
            if o.status == search.FITS and self.score is not None:
                seconds = self.score(o)
                if self.best is None or seconds < self.best[0]:
                    self.best = (seconds, o.layout)
        best = "" if self.best is None else (
            f"; best so far {self.best[1]}, {self.best[0] * 1e3:.4g} ms")  # fmt: skip
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"planned {ladder}{best}")
        elif self.lines:
            took = time.perf_counter() - self.start
            line = f"planned {self.done}/{self.total} ({took:.0f} s) {self.compiled} compiled: "
            print(f"{line}{ladder}{best}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
