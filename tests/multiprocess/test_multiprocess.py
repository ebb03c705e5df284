"""Real multi-process runs: 2 processes x 4 emulated CPU devices through `replicator launch`."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import OPTIMIZERS, batches, mlp_state, mlp_step, rel_err, single_device

import replicator as rp

HERE = Path(__file__).resolve().parent
LAUNCH = [sys.executable, "-m", "replicator.launch", "-n", "2", "--devices-per-process", "4"]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.slow
def test_two_processes_train_like_one_device_and_like_one_process(opt, tmp_path):
    out = tmp_path / "params.npz"
    run = subprocess.run(
        [*LAUNCH, "--", sys.executable, str(HERE / "worker_dp.py"), opt, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[0] process 0: last loss" in run.stdout and "[1] process 1: last loss" in run.stdout
    got = list(np.load(out).values())
    tx = OPTIMIZERS[opt]()
    oracle, _ = single_device("mlp", tx, batches())  # one device, the whole batch
    assert rel_err(got, jax.tree.leaves(oracle.params)) <= 1e-5
    repl = rp.Replicator()  # this process: 8 devices
    state = repl.replicate(mlp_state(repl.wrap_optimizer(OPTIMIZERS[opt]())))
    for batch in batches():
        state, _ = repl.run(mlp_step, state, batch)
    assert rel_err(got, jax.tree.leaves(state.params)) <= 1e-5


@pytest.mark.slow  # 4.3 s
def test_a_killed_process_ends_the_job_with_its_rank(tmp_path):
    start = time.monotonic()
    proc = subprocess.Popen(
        [
            *LAUNCH,
            "--grace",
            "5",
            "--",
            sys.executable,
            str(HERE / "worker_forever.py"),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids = {}
    try:
        while len(pids) < 2 and time.monotonic() - start < 120:
            for rank in (0, 1):
                path = tmp_path / f"rank{rank}.pid"
                if path.exists() and path.read_text():
                    pids[rank] = int(path.read_text())
            time.sleep(0.1)
        assert len(pids) == 2, "the workers did not start training"
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "rank 1 was killed by SIGKILL" in output, output[-2000:]
    time.sleep(0.5)
    for pid in pids.values():  # no process is left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_dp_x_pp_spanning_two_processes_equals_single_device_training(tmp_path):
    import test_pipeline as tp

    out = tmp_path / "params.npz"
    run = subprocess.run(
        [*LAUNCH, "--", sys.executable, str(HERE / "worker_pp.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = list(np.load(out).values())
    tx = optax.sgd(0.1)
    want, opt = tp.init_params(), tx.init(tp.init_params())
    for i in range(3):
        x, t = tp.make_batch(16, seed=10 + i)
        updates, opt = tx.update(jax.grad(tp.oracle_loss)(want, x, t), opt, want)
        want = optax.apply_updates(want, updates)
    assert rel_err(got, jax.tree.leaves(jax.tree.map(np.asarray, want))) <= 1e-5
    assert rel_err(got, jax.tree.leaves(tp.init_params())) > 1e-2


@pytest.mark.slow
def test_without_the_launcher_a_dead_peer_ends_the_job_by_heartbeat(tmp_path):
    """JAX's coordination service notices the dead process (after rp.distributed.initialize's
    heartbeat_timeout, 10 s here, 30 by default) and ends the survivor: an error in bounded
    time, not a hang."""
    port = rp.distributed.free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env |= {
            "REPLICATOR_COORDINATOR": f"127.0.0.1:{port}",
            "REPLICATOR_NUM_PROCESSES": "2",
            "REPLICATOR_PROCESS_ID": str(rank),
            "REPLICATOR_CPU_DEVICES": "4",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "worker_forever.py"), str(tmp_path), "10"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "rank1.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        procs[1].kill()
        killed_at = time.monotonic()
        procs[0].wait(timeout=60)
        assert procs[0].returncode != 0 and time.monotonic() - killed_at < 40
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
