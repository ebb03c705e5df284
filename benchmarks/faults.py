"""Launcher faults: the time from a rank's failure to the end of the job, and to the first step
after a restart.

Part ``end``:
For 2 and 4 processes (1 emulated CPU device each), ``replicator launch`` runs
tests/multiprocess/worker_fault.py, whose processes train a tiny all-reduce step until the last
rank fails after 5 steps in one of four ways: an uncaught exception, ``sys.exit(3)``, SIGKILL, or
stuck (asleep while its peers wait for it in an all-reduce, with ``--watchdog 20``). The worker
writes ``time.time()`` to a file right before it fails; the figure is the launcher's exit time
minus that (minus the 20 s of the watchdog for the stuck rank). Target: <= 5 s each. Each row also
checks the launcher's exit code and the rank its message names.

Part ``restarts`` (``replicator launch --max-restarts``): tests/faults/worker_heal.py (an MLP
with Adam under ZeRO-1, 2 emulated devices per process, checkpoints every 5 steps) runs 40 steps
while a random rank is SIGKILLed at a random step, ``--kills`` times in one run (seeded; at
distinct steps). For each failure: the seconds from the kill to the first step after the restart
(the last rank to start it, and to end it: compiled and run), with ``--restart-backoff 0`` (the default backoff adds 1 s, then
2 s, ...), and the steps lost (run again: from the checkpoint to the failed step). The last row
loses a host for good with ``-n 4 --min-processes 2``. Each run's final parameters are compared
with an uninterrupted run's: bitwise on the same processes, to 1e-5 after the resize.

    python benchmarks/faults.py
    python benchmarks/faults.py --part end --processes 2 --repeats 3 --watchdog 20
    python benchmarks/faults.py --part restarts --kills 3 --seed 0
"""

import argparse
import datetime
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess" / "worker_fault.py"
HEAL = ROOT / "tests" / "faults" / "worker_heal.py"
STEPS = 40
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


def random_faults(seed: int, n: int, kills: int) -> list[dict]:
    """``kills`` SIGKILLs of random ranks at distinct random steps of a ``STEPS``-step run."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(3, STEPS), kills))
    return [{"step": s, "rank": rng.randrange(n), "how": "kill"} for s in steps]


def heal(directory: Path, n: int, faults: list[dict], extra=()) -> tuple[int, str]:
    directory.mkdir(parents=True)
    (directory / "faults.json").write_text(json.dumps(faults))
    cmd = [sys.executable, "-m", "replicator.launch", "-n", str(n), "--devices-per-process", "2"]
    cmd += ["--restart-backoff", "0", *extra, "--", sys.executable, str(HEAL), str(directory)]
    run = subprocess.run([*cmd, str(STEPS)], capture_output=True, text=True, timeout=900)
    return run.returncode, run.stdout + run.stderr


def recoveries(directory: Path) -> list[tuple]:
    """(failed step, rank, seconds to the start of the first step after the restart, seconds
    to its end, steps lost) per fault."""
    lines = (directory / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    out = []
    for fault in (e for e in events if e["kind"] == "fault"):
        later = [e for e in events if e["time"] > fault["time"]]
        starts = [e for e in later if e["kind"] == "first_step"]
        ends = [e for e in later if e["kind"] == "first_step_done"]
        if not starts or not ends:
            continue
        first = [e for e in starts if e["step"] == starts[0]["step"]]
        done = [e for e in ends if e["step"] == ends[0]["step"]]
        start = max(e["time"] for e in first) - fault["time"]
        end = max(e["time"] for e in done) - fault["time"]
        out.append((fault["step"], fault["rank"], start, end, fault["step"] - first[0]["step"]))
    return out


def same(a: Path, b: Path, exact: bool) -> bool:
    with np.load(a / "params.npz") as x, np.load(b / "params.npz") as y:
        if exact:
            return all(np.array_equal(x[k], y[k]) for k in x.files)
        return all(np.allclose(x[k], y[k], rtol=1e-5, atol=1e-6) for k in x.files)


def restarts(processes: list[int], kills: int, seed: int) -> None:
    print(
        "| processes | failure | seconds to the first step after the restart: its start | "
        "its end (compiled and run) | steps lost |"
    )
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        verdicts = []
        for n in processes:
            assert heal(tmp / f"plain{n}", n, [])[0] == 0
            faults = random_faults(seed + n, n, kills)
            code, out = heal(tmp / f"healed{n}", n, faults, ["--max-restarts", str(kills)])
            assert code == 0, out[-3000:]
            for step, rank, start, end, lost in recoveries(tmp / f"healed{n}"):
                failure = f"SIGKILL rank {rank} at step {step}"
                print(f"| {n} | {failure} | {start:.2f} | {end:.2f} | {lost} |", flush=True)
            verdicts.append(
                f"{n} processes, {kills} kills: bitwise equal to the uninterrupted run: "
                f"{'yes' if same(tmp / f'plain{n}', tmp / f'healed{n}', True) else 'NO'}"
            )
        lose = [{"step": 13, "rank": 3, "how": "kill", "lose": True}]
        extra = ["--max-restarts", "1", "--min-processes", "2"]
        code, out = heal(tmp / "shrunk", 4, lose, extra)
        assert code == 0, out[-3000:]
        for step, rank, start, end, lost in recoveries(tmp / "shrunk"):
            failure = f"host of rank {rank} lost at step {step}"
            print(f"| 4 -> 2 | {failure} | {start:.2f} | {end:.2f} | {lost} |", flush=True)
        ok = "yes" if same(tmp / "plain4", tmp / "shrunk", False) else "NO"
        verdicts.append(f"4 -> 2 processes: equal to the uninterrupted 4-process run to 1e-5: {ok}")
    print()
    for line in verdicts:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["end", "restarts", "all"], default="all")
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--watchdog", type=float, default=20.0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"# {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}")
    print()
    if args.part in ("end", "all"):
        end(args)
    if args.part in ("restarts", "all"):
        restarts(args.processes, args.kills, args.seed)


def end(args) -> None:
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
    print()


if __name__ == "__main__":
    main()
