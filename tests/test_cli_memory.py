"""`replicator train` refuses, from shapes and before anything is allocated, a job whose state
does not fit in this machine's memory (`jobs.memory`), and the shipped configs pass comfortably."""

import pathlib

import jax
import pytest

from replicator import cli
from replicator.cli import config
from replicator.cli.jobs import building, memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 2**30


@pytest.fixture
def nothing_built(monkeypatch):
    """`building.build` (which allocates the state) fails the test if it is called."""

    def build(config):
        raise AssertionError(f"{config.name}: the state was built (allocated)")

    monkeypatch.setattr(building, "build", build)
    jax.devices()  # the suite's 8 devices started, so that cpu_devices=4 changes none


def test_llama2_7b_is_refused_in_one_line_before_anything_is_allocated(
    tmp_path, capsys, monkeypatch, nothing_built
):
    # 6.7e9 fp32 parameters and AdamW's two moments: 75.3 GiB of state (1 s here). The
    # machine's available memory is this one's at the time of writing, whatever it is now.
    monkeypatch.setattr(memory, "available_memory", lambda: (22 * GiB, "MemAvailable"))
    code = cli.main(["train", str(ROOT / "configs" / "llama2_7b.yaml"), "cpu_devices=4",
                     f"out_dir={tmp_path}"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    assert err.count("\n") == 1, err
    assert err.startswith(
        "replicator train: llama2_7b needs at least 125.5 GiB of memory on this machine's CPU "
        "devices and 22.0 GiB is available (MemAvailable): its state is 75.3 GiB (parameters "
        "25.1 GiB) on 8 devices, plus its gradients and a batch, x 1.25 for activations and "
        "XLA's temporaries; it would need less than is available with model.layers=4 (at "
        "least 20.0 GiB) (zero_stage and cpu_devices do not cut it: ZeRO-3 keeps one copy, "
        "split over the 8 CPU devices this process emulates in its own memory; model.dtype "
        "does not: it is the compute dtype, the parameters stay float32)."
    ), err
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_the_available_memory_is_read_from_this_machine():
    have, source = memory.available_memory()
    assert have > 0 and source in (
        "MemAvailable in /proc/meminfo",
        "free physical pages",
        "the cgroup's memory.max less memory.current",
    )


def test_a_small_job_on_a_small_machine_is_refused_naming_the_change_that_fits(
    tmp_path, capsys, monkeypatch, nothing_built
):
    lm_dp = config.load(ROOT / "configs" / "lm_dp.yaml")
    need = memory.needed(lm_dp)  # replicated on 8 devices: 8 copies of a 0.1M-parameter GPT
    one_copy = 4 * sum(
        x.size for x in jax.tree.leaves(building.abstract_job(lm_dp)[2]["job"]["params"])
    )
    assert need.devices == 8 and need.params == 8 * one_copy
    assert 3 * need.params < need.state < 3 * need.params + 1024  # Adam's moments; counters
    batch = 2 * 32 * 64 * 4  # tokens and targets, int32
    assert need.total == -(-5 * (need.state + need.params + batch) // 4)
    monkeypatch.setattr(memory, "available_memory", lambda: (need.total // 4, "test"))
    code = cli.main(["train", str(ROOT / "configs" / "lm_dp.yaml"), f"out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"needs at least {need.total / 2**20:.1f} MiB" in err
    assert f"and {need.total / 4 / 2**20:.1f} MiB is available (test)" in err
    assert (
        "would need less than is available with zero_stage=3 (at least " in err
    )  # ZeRO-3: one copy over the 8 devices
    assert list(tmp_path.iterdir()) == []
    # replicator launch -n 2: the processes on one machine share its memory
    monkeypatch.setattr(memory, "available_memory", lambda: (need.total * 3 // 2, "test"))
    memory.check_memory(lm_dp)  # alone, it fits
    with pytest.raises(ValueError, match=r"for each of the 2 processes of this machine: its"):
        memory.check_memory(lm_dp, processes=2)
    monkeypatch.setattr(memory, "available_memory", lambda: (need.total // 40, "test"))
    with pytest.raises(
        ValueError,
        match=r"available with zero_stage=3 optimizer.name=sgd model\.layers=1 \(at least ",
    ):
        memory.check_memory(lm_dp)


@pytest.mark.parametrize(
    "name", ["lm_pipeline", "lm_dp", "lm_3d", "mlp_zero", "cnn_bn", "llama_tiny", "gpt_moe"]
)
def test_the_shipped_small_configs_need_little_memory(name):
    need = memory.needed(config.load(ROOT / "configs" / f"{name}.yaml"))
    assert need is not None and need.total < 128 * 2**20, need  # MiB, on any machine
