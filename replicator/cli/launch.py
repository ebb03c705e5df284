"""``replicator launch``: the command line of the local launcher, `rp.distributed.launch`.

``replicator launch -n 2 [--devices-per-process 4] [--port P] [--grace S] [--watchdog S]
[--max-restarts N] [--min-processes M] -- python train.py`` (or ``python -m replicator.launch ...``) parses its options here and runs
``rp.distributed.launch``; a bad option is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import replicator as rp


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with errors as one line on stderr and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"replicator launch: {message}\n")


def parser() -> argparse.ArgumentParser:
    """The options of ``replicator launch``.

    >>> args = parser().parse_args(["-n", "2", "--watchdog", "30", "--", "python", "train.py"])
    >>> args.num_processes, args.watchdog, args.cmd
    (2, 30.0, ['--', 'python', 'train.py'])
    """
    p = _OneLineParser(
        prog="replicator launch",
        description="Runs CMD as N local processes of one JAX distributed job, with a "
        "coordinator on 127.0.0.1. Each line of output is prefixed with its rank. The job ends "
        "at its first failure (an exit code, a signal, or --watchdog), naming the rank, with "
        "that rank's exit code (128 + signal if killed; 124 for the watchdog), unless "
        "--max-restarts starts it again. A process's exit code 4, 130 or 143 (replicator "
        "train's nothing to do, and stopped by SIGINT/SIGTERM at a step boundary) is no "
        "failure: the job ends with it. SIGTERM or SIGINT to the launcher is passed on to every "
        "process, and no process outlives the launcher. In the script, call "
        "rp.distributed.initialize() first.",
    )
    p.add_argument("-n", "--num-processes", type=int, required=True, help="processes")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="emulated CPU devices per process (sets jax_num_cpu_devices through initialize)",
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between the SIGTERM passed on from the launcher and SIGKILL (default 10); "
        "after a failure, at most 2",
    )
    p.add_argument(
        "--watchdog",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end the job when a process goes SECONDS without progress "
        "(rp.distributed.heartbeat(), which rp.fit reports each step); default: off",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="after a failure, stop the others and start the job again, up to N times; rp.fit "
        "resumes from the newest checkpoint. A failure that repeats at the same step is not "
        "restarted again (default 0)",
    )
    p.add_argument(
        "--min-processes",
        type=int,
        default=None,
        metavar="M",
        help="on a restart, go on with fewer processes (at least M, a divisor of -n) when some "
        "do not come up; grow back at a checkpoint when they do (default: -n, no resizing)",
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="wait before the first restart, doubled for each next one up to 60 (default 1)",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --min-processes: a process of a restart that has not reached "
        "rp.distributed.initialize by then counts as a lost host (default 60)",
    )
    p.add_argument(
        "--rejoin-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --min-processes: how often to ask a lost host whether it is back (default 60)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``replicator launch ARGS``: parses ``argv``, runs `rp.distributed.launch`.

    Args:
      argv: the arguments after ``launch`` (default: ``sys.argv[1:]``).

    Returns:
      The job's exit code (see `rp.distributed.launch`), or 2 for a bad argument, whose message
      is one line on stderr.
    """
    args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        return rp.distributed.launch(
            cmd,
            num_processes=args.num_processes,
            devices_per_process=args.devices_per_process,
            port=args.port,
            grace=args.grace,
            watchdog=args.watchdog,
            restarts=rp.distributed.Restarts(
                max_restarts=args.max_restarts,
                min_processes=args.min_processes,
                backoff=args.restart_backoff,
                join_timeout=args.join_timeout,
                rejoin_interval=args.rejoin_interval,
            ),
        )
    except ValueError as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
