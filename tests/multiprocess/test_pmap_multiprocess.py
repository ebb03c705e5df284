"""lowering="pmap" on several processes: 2 processes x 4 emulated CPU devices through
`replicator launch`, against lowering="shard_map" in the same job."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import rel_err

HERE = Path(__file__).resolve().parent
LAUNCH = [sys.executable, "-m", "replicator.launch", "-n", "2", "--devices-per-process", "4"]


@pytest.mark.slow
def test_pmap_on_two_processes_computes_what_shard_map_computes(tmp_path):
    out = tmp_path / "results.npz"
    run = subprocess.run(
        [*LAUNCH, "--", sys.executable, str(HERE / "worker_pmap.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = dict(np.load(out))
    names = sorted(k.removeprefix("pmap/") for k in got if k.startswith("pmap/"))
    assert names == sorted(k.removeprefix("shard_map/") for k in got if k.startswith("shard_map/"))
    assert {"zero0/params/0", "zero1/opt/2", "zero1/loss", "probe/row"} <= set(names)
    for name in names:  # parameters, optimizer state and losses after 5 steps, and the probe
        want, have = got[f"shard_map/{name}"], got[f"pmap/{name}"]
        assert have.shape == want.shape and have.dtype == want.dtype, name
        assert rel_err(have, want) <= 1e-6, name
    losses = got["pmap/zero0/loss"]  # [steps, replicas]: reduced, so every row is equal
    assert (losses == losses[:, :1]).all() and losses[-1, 0] < losses[0, 0]
    assert rel_err(got["pmap/zero1/params/1"], got["pmap/zero0/params/1"]) <= 1e-6
    # Each replica saw its own rows of both global batches, and knew its global id.
    x = np.arange(48, dtype=np.float32).reshape(16, 3)
    y = x[::-1] ** 2
    want_rows = [
        r * 1000 + x[2 * r : 2 * r + 2].sum(0) * 0.5 + y[2 * r : 2 * r + 2].sum(0) for r in range(8)
    ]
    np.testing.assert_array_equal(got["pmap/probe/row"], np.stack(want_rows))
    np.testing.assert_array_equal(got["pmap/probe/id"], np.arange(8))
    assert float(got["pmap/probe/total"]) == x.sum()
    # A Python float argument stays weakly typed, as under jax.jit: bfloat16 * 0.500244 is 0.5.
    np.testing.assert_array_equal(got["pmap/probe/half"], np.full((8, 2), 0.5, np.float32))
