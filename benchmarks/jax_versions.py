"""Two JAX releases side by side: the data-parallel overhead and the main job, in one run.

Each ``--python`` is an interpreter whose environment has replicator installed with its own jax
(CI's two lanes: Python 3.11 with jax 0.10.2, Python 3.12 with jax 0.12). In each of R rounds,
in an order that alternates round by round so that machine load affects both alike, every
interpreter runs

- ``benchmarks/dp_overhead.py`` (``Replicator.run`` against a hand-written ``jit(shard_map)``
  step, its own correctness check included), and
- the main job, ``replicator train configs/lm_pipeline.yaml``, on its built-in text (the same
  bytes on every Python: Python 3.11's standard library ships with the package).

The report gives each interpreter's medians, and the largest relative difference between the
interpreters' losses at every logged step.

    python benchmarks/jax_versions.py --python .venv/bin/python --python .venv-jax012/bin/python
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINED = re.compile(r"loss (\S+) -> (\S+), (\d+) steps in ([\d.]+) s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", action="append", required=True, help="an interpreter (twice)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (R)")
    p.add_argument("--dp-rounds", type=int, default=20, help="dp_overhead.py's --rounds")
    p.add_argument("--steps", type=int, default=200, help="the main job's steps")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def describe(python: str) -> dict:
    code = "import sys, jax, jaxlib; print(sys.version.split()[0], jax.__version__, jaxlib.__version__)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    py, jax_version, jaxlib_version = out.stdout.split()
    return {"python": py, "jax": jax_version, "jaxlib": jaxlib_version}


def dp_overhead(python: str, rounds: int, out: pathlib.Path) -> dict:
    cmd = [python, "benchmarks/dp_overhead.py", "--rounds", str(rounds), "--json", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads(out.read_text())


def main_job(python: str, steps: int, out_dir: pathlib.Path) -> dict:
    cmd = [python, "-m", "replicator.cli", "train", "configs/lm_pipeline.yaml"]
    cmd += [f"out_dir={out_dir}", f"steps={steps}", "plot=false"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"jax_versions: the main job failed under {python}:\n{result.stderr[-3000:]}")
    found = TRAINED.search(result.stdout + result.stderr)
    rows = [json.loads(line) for line in (out_dir / "lm_pipeline" / "metrics.jsonl").open()]
    losses = {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}
    return {"train_s": float(found.group(4)), "losses": losses}


def main() -> None:
    args = parse_args()
    if len(args.python) < 2:
        sys.exit("jax_versions: give --python twice, one interpreter per jax release")
    info = [describe(p) for p in args.python]
    names = [f"Python {i['python']}, jax {i['jax']}" for i in info]
    runs: dict[str, list] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for r in range(args.rounds):
            order = list(zip(args.python, names, strict=True))[:: 1 if r % 2 == 0 else -1]
            for python, name in order:
                slot = tmp / f"{r}-{names.index(name)}"
                dp = dp_overhead(python, args.dp_rounds, pathlib.Path(f"{slot}.json"))
                job = main_job(python, args.steps, slot)
                runs[name].append({"dp": dp, "job": job})
                print(
                    f"round {r + 1}/{args.rounds} {name}: dp ratio {dp['ratio']:.3f} "
                    f"({dp['median_ms']['replicator']:.2f} / {dp['median_ms']['hand-written']:.2f}"
                    f" ms), main job {job['train_s']:.1f} s, loss "
                    f"{job['losses'][min(job['losses'])]:.4f} -> "
                    f"{job['losses'][max(job['losses'])]:.4f}",
                    flush=True,
                )
    today = datetime.date.today().isoformat()
    print(f"\n{today}, `{shlex.join(['python', *sys.argv])}`\n")
    print(
        "| Python, jax | replicator ms | hand-written ms | ratio (median of rounds) | main job training s | loss at the logged steps |"
    )
    print("|---|---|---|---|---|---|")
    summary = {}
    for name in names:
        rs = runs[name]
        rep = float(np.median([x["dp"]["median_ms"]["replicator"] for x in rs]))
        hand = float(np.median([x["dp"]["median_ms"]["hand-written"] for x in rs]))
        ratio = float(np.median([x["dp"]["ratio"] for x in rs]))
        train = [x["job"]["train_s"] for x in rs]
        losses = rs[0]["job"]["losses"]
        shown = ", ".join(f"{losses[s]:.4f}" for s in sorted(losses))
        print(
            f"| {name} | {rep:.2f} | {hand:.2f} | **{ratio:.3f}** | "
            f"{np.median(train):.1f} ({', '.join(f'{t:.1f}' for t in train)}) | {shown} |"
        )
        summary[name] = dict(
            replicator_ms=rep, hand_written_ms=hand, ratio=ratio, train_s=train, losses=losses
        )
    first, *others = names
    for other in others:
        a, b = runs[first][0]["job"]["losses"], runs[other][0]["job"]["losses"]
        steps = sorted(set(a) & set(b))
        rel = max(abs(a[s] - b[s]) / abs(a[s]) for s in steps)
        same = all(x["job"]["losses"] == runs[other][0]["job"]["losses"] for x in runs[other])
        print(
            f"\nlosses of {other} against {first} at the {len(steps)} logged steps: largest "
            f"relative difference {rel:.2e}; repeated rounds bitwise equal: {same}"
        )
        summary[f"max_rel_loss_diff {other}"] = rel
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(dict(date=today, info=info, runs=summary), indent=2, default=str)
        )
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
