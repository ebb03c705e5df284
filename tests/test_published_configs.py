"""MaxText's published runs as configs (``configs/published/``): each file loads and names its
source and published MFU; one row of each kind of layout compiles for its TPU generation
(libtpu, here; nothing runs) at two narrow layers with the recipe's layout: mesh, sequences a
chip, remat and offload policy, kernel and experts. Whether each fits at full size is
`benchmarks/published.py`'s (BENCHMARKS.md).

The whole module needs libtpu (``pip install "replicator[tpu]"``); without it, only the loading
test runs.
"""

import importlib.util
import json
import math
import pathlib
import re

import pytest

import replicator as rp
from replicator import cli
from replicator.cli import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "configs" / "published"
ROWS = sorted(p.stem for p in PUBLISHED.glob("*.yaml"))
# the eight rows of MaxText's docs/reference/models/tiering.md: file -> published MFU (%)
TIERING = {
    "llama2_70b_v5p-512": "65.4", "mixtral_8x7b_v5p-256": "52.56", "llama2_70b_v6e-256": "43.8",
    "llama3.1_8b_v6e-256": "45.46", "llama3.1_70b_v6e-256": "50.33",
    "llama3.1_405b_v6e-256": "38.55", "mixtral_8x7b_v6e-256": "35.23",
    "mixtral_8x22b_v6e-256": "36.2",
}  # fmt: skip


def _target(name: str) -> tuple[str, int]:
    """The row's target (its file name's tail) and slices (its mesh's ``dcn_data``)."""
    mesh = config_lib.load(PUBLISHED / f"{name}.yaml").mesh
    return name.rsplit("_", 1)[1], mesh.get("dcn_data", 1)


def test_every_published_row_has_its_config_naming_its_source():
    assert ROWS == sorted(TIERING) and set(COMPILED) <= set(ROWS)
    for name in ROWS:
        text = (PUBLISHED / f"{name}.yaml").read_text()
        head = re.sub(r"\s*\n#\s*", " ", text.split("\nname:")[0])  # the comment, one line
        assert f"{TIERING[name]}% MFU" in head, name  # the published figure
        assert re.search(r"\b[0-9a-f]{40}\b", head), name  # the recipe's commit
        cfg = config_lib.load(PUBLISHED / f"{name}.yaml")
        assert cfg.name == name and cfg.model.attention == "splash"
        assert cfg.zero_stage == 3 and cfg.model.dtype == "bfloat16"
        assert cfg.model.reduce_dtype == "bfloat16"
        target, slices = _target(name)
        chips = rp.targets.tpu_target(target, slices=slices).num_devices
        fixed = math.prod(v for v in cfg.mesh.values() if v != -1)
        assert chips % fixed == 0, (name, cfg.mesh)
        assert f"--target {target}" in head, name


# Compiled at two layers narrowed as the shipped configs are (tests/test_tpu_targets.py: heads
# 128 wide, the splash kernel's, a 512-token sequence, a small vocabulary) on 8 chips of the
# row's generation, with the rest of its recipe: sequences a chip, the mesh's axes (model, two
# slices), remat and offload, kernel, experts, ZeRO-3 and dtypes. CI's time allows one row:
# two slices with a `model` axis and activations offloaded to the host on v6e (Llama 3.1 405B).
# The other rows' layouts are theirs with other sizes (the v6e Llamas, offloading), or compiled
# by test_tpu_targets.py: FSDP with MaxText's remat preset on v5p (configs/llama2_70b.yaml, Llama
# 2 70B's recipe), experts over an `expert` axis on v6e (configs/mixtral_8x22b.yaml), dropless
# experts on v5p (configs/mixtral_tiny.yaml); the chunked head and experts the Mixtral rows take
# are tests/test_loss_chunks.py's. Every row compiles at full size in benchmarks/published.py.
COMPILED = ["llama3.1_405b_v6e-256"]
NARROW = ["model.layers=2", "model.d_model=512", "model.heads=4", "model.kv_heads=2",
          "model.d_ff=1024", "model.vocab=4096", "model.seq_len=512"]  # fmt: skip
SMALL = {"v5p": "v5p-16", "v6e": "v6e-8"}  # 8 chips
SHRUNK_MESH = {  # the rows whose mesh fixes its axes: the same axes on 8 chips
    # 2 slices x data 1 x model 4, a key/value head on each device of `model`
    "llama3.1_405b_v6e-256": ("v6e-4", ["mesh.data=1", "model.kv_heads=4"]),
    "mixtral_8x22b_v6e-256": ("v6e-8", ["mesh.data=2"]),  # data 2 x expert 4
}


def _narrowed(name: str) -> tuple[str, int, list[str]]:
    """The row's small target, slices and overrides: 8 chips, as many sequences a chip."""
    target, slices = _target(name)
    cfg = config_lib.load(PUBLISHED / f"{name}.yaml")
    per_chip = cfg.global_batch // rp.targets.tpu_target(target, slices=slices).num_devices
    small, mesh = SHRUNK_MESH.get(name, (SMALL[target.split("-")[0]], []))
    chips = rp.targets.tpu_target(small, slices=slices).num_devices
    return small, slices, [*NARROW, *mesh, f"global_batch={per_chip * chips}"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
@pytest.mark.slow  # a TPU compile at two narrow layers
@pytest.mark.parametrize("name", COMPILED)
def test_published_configs_compile_for_their_generation_at_two_layers(name, tmp_path, capfd):
    """``replicator explain configs/published/NAME.yaml ...narrowed... --target T --quick``, as
    typed (the CLI compiles in a process of its own): the recipe's layout compiles for its TPU
    generation and fits."""
    target, slices, overrides = _narrowed(name)
    out = tmp_path / "report.json"
    args = ["explain", str(PUBLISHED / f"{name}.yaml"), *overrides, "--target", target,
            *(["--slices", str(slices)] if slices > 1 else []), "--json", str(out), "--quick"]  # fmt: skip
    code = cli.main(args)
    run = capfd.readouterr()
    assert code == 0, f"exit {code}:\n{run.err[-3000:]}"
    report = json.loads(out.read_text())
    assert report["platform"] == "tpu"
    assert report["num_devices"] == rp.targets.tpu_target(target, slices=slices).num_devices
    assert report["fits"] is True, (report["peak_bytes"], report["hbm_bytes"])
    assert report["step_seconds"] > 0 and report["unknown_trip_counts"] == 0
    if "offload" in str(config_lib.load(PUBLISHED / f"{name}.yaml").model.remat):
        assert report["host_bytes"] > 0, report["host_bytes"]  # the offloaded activations
