"""Launcher faults: the time from a rank's failure to the end of the job.

For 2 and 4 processes (1 emulated CPU device each), ``replicator launch`` runs
tests/multiprocess/worker_fault.py, whose processes train a tiny all-reduce step until the last
rank fails after 5 steps in one of four ways: an uncaught exception, ``sys.exit(3)``, SIGKILL, or
stuck (asleep while its peers wait for it in an all-reduce, with ``--watchdog 20``). The worker
writes ``time.time()`` to a file right before it fails; the figure is the launcher's exit time
minus that (minus the 20 s of the watchdog for the stuck rank). Target: <= 5 s each. Each row also
checks the launcher's exit code and the rank its message names.

    python benchmarks/faults.py
    python benchmarks/faults.py --processes 2 --repeats 3 --watchdog 20
"""

import argparse
import datetime
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess" / "worker_fault.py"
# mode -> (what the table calls it, the launcher's expected exit code, the expected message)
FAULTS = {
    "raise": ("exception", 1, "exited with 1"),
    "exit3": ("sys.exit(3)", 3, "exited with 3"),
    "kill": ("SIGKILL", 128 + 9, "was killed by SIGKILL"),
    "stuck": ("stuck", 124, "made no progress"),
}


def one_run(mode: str, n: int, watchdog: float) -> tuple[float, bool]:
    """Seconds from the failure to the launcher's exit (after the watchdog for a stuck rank),
    and whether the exit code and the rank named were right."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "replicator.launch", "-n", str(n)]
        cmd += ["--devices-per-process", "1", "--watchdog", str(watchdog), "--"]
        cmd += [sys.executable, str(WORKER), mode, str(n - 1), tmp]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        ended = time.time()
        failed_at = float((Path(tmp) / "failed_at").read_text())
    _, code, how = FAULTS[mode]
    ok = run.returncode == code and f"replicator launch: rank {n - 1} {how}" in run.stdout
    return ended - failed_at - (watchdog if mode == "stuck" else 0.0), ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--watchdog", type=float, default=20.0)
    args = parser.parse_args()
    print(f"# {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}")
    print()
    print(
        "| fault | processes | seconds to the launcher's exit (max of runs) | code and rank right |"
    )
    print("|---|---|---|---|")
    worst = 0.0
    for mode, (name, _, _) in FAULTS.items():
        for n in args.processes:
            runs = [one_run(mode, n, args.watchdog) for _ in range(args.repeats)]
            seconds = max(s for s, _ in runs)
            worst = max(worst, seconds)
            label = f"{name} (after the {args.watchdog:g} s watchdog)" if mode == "stuck" else name
            ok = "yes" if all(k for _, k in runs) else "NO"
            print(f"| {label} | {n} | {seconds:.2f} | {ok} |", flush=True)
    print()
    print(f"worst: {worst:.2f} s (target <= 5 s)")


if __name__ == "__main__":
    main()
