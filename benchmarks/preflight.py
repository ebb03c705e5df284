"""``replicator explain --resume``: a Llama 3 8B run checked against v5p-64 before booking it.

A run of Llama 3 8B at full size is a checkpoint whose metadata says so: saved from the config
narrowed, then each array's shape set to the full one in its metadata (tensorstore's resize;
`tests/test_preflight.run_at_full_size`). The preflight reads metadata only, so to it this is
the checkpoint of a full-size run (its arrays would be 96 GB; these are a few MB). Three
commands, each timed from the shell (a process of its own, libtpu loaded, the step compiled for
the 32 chips where it is):

1. the run checked against ``configs/llama3_8b.yaml model.remat=full global_batch=32`` on
   v5p-64 (remat, which the shipped file needs to fit at all, and one sequence of 8,192 tokens a
   chip, as the file's v5p-1024 layout has): accepted, the restore's peak beside the step's;
2. a run of the narrowed model against the same: refused, naming the leaf;
3. the run against ZeRO-0 on v5e-64 (16 GiB chips): the restore holds the whole state on every
   chip, refused.

    python benchmarks/preflight.py
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _explain(*args: str) -> tuple[int, float, str, str]:
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "explain", str(ROOT / "configs/llama3_8b.yaml"),
         *args],
        capture_output=True, text=True, cwd=ROOT, timeout=1800,
    )  # fmt: skip
    return run.returncode, time.perf_counter() - start, run.stdout, run.stderr


def main() -> None:
    os.environ["JAX_NUM_CPU_DEVICES"] = "8"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(ROOT / "tests"))
    from test_preflight import NARROW, run_at_full_size

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="preflight-"))
    start = time.perf_counter()
    full = run_at_full_size(tmp / "full", "llama3_8b", "v5p-64")
    made = time.perf_counter() - start
    size = sum(p.stat().st_size for p in full.rglob("*") if p.is_file())
    print(f"a Llama 3 8B run at full size, by its metadata: {size / 2**20:.1f} MiB on disk, "
          f"made in {made:.1f} s")  # fmt: skip
    out = tmp / "report.json"
    code, seconds, stdout, stderr = _explain(
        "model.remat=full", "global_batch=32", "--target", "v5p-64", "--resume", str(full), "--quick",
        "--json", str(out),
    )  # fmt: skip
    line = next((x for x in stdout.splitlines() if x.startswith("resume:")), stderr[-500:])
    print(f"1. accepted: exit {code} in {seconds:.1f} s\n   {line}")
    if code == 0:
        resume = json.loads(out.read_text())["resume"]
        print(f"   restore peak {resume['restore_peak_bytes'] / 2**30:.2f} GiB, step peak "
              f"{resume['step_peak_bytes'] / 2**30:.2f} GiB per chip")  # fmt: skip
    small = tmp / "small"
    _save_narrowed(small, NARROW)
    code, seconds, _, stderr = _explain("--target", "v5p-64", "--resume", str(small))
    print(f"2. another model size: exit {code} in {seconds:.1f} s\n   {stderr.strip()}")
    code, seconds, _, stderr = _explain("zero_stage=0", "--target", "v5e-64", "--resume", str(full))
    print(f"3. ZeRO-0 on v5e-64: exit {code} in {seconds:.1f} s\n   {stderr.strip()}")
    print(f"jax {jax.__version__}; {datetime.date.today()}")


def _save_narrowed(run_dir: pathlib.Path, narrow: list[str]) -> None:
    import jax
    import jax.numpy as jnp

    import replicator as rp
    from replicator.cli import config as config_lib
    from replicator.cli import jobs

    cfg = config_lib.load(ROOT / "configs/llama3_8b.yaml", [*narrow, "mesh.data=8"])
    _, _, state, _ = jobs.abstract_job(cfg, devices=jax.devices()[:8])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), state)
    ckpt = rp.Checkpoints(run_dir / "checkpoints")
    ckpt.save(2, zeros, data_position=2)
    ckpt.close()


if __name__ == "__main__":
    main()
