"""What a new user typed and got wrong or unclear, each now working or one line with its fix."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

import replicator as rp
from replicator import cli
from replicator.cli import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='needs pip install "replicator[tpu]"'
)


def _listing(path: pathlib.Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in path.rglob("*")}


def _refused(capsys, *argv) -> str:
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_family_given_on_a_kind_llama_config_is_the_model_built():
    cfg = config_lib.load(ROOT / "configs/llama_tiny.yaml", ["model.family=qwen2"])
    assert (cfg.model.kind, cfg.model.family, cfg.model.label) == ("gpt", "qwen2", "qwen2")
    cfg = config_lib.load(ROOT / "configs/llama_tiny.yaml")
    assert (cfg.model.family, cfg.model.label) == ("llama", "llama")


def test_a_family_that_contradicts_kind_llama_or_is_unknown_is_one_line(capsys, tmp_path):
    before = _listing(tmp_path)
    line = _refused(capsys, "train", f"{ROOT}/configs/llama_tiny.yaml", "model.family=gpt",
                    f"out_dir={tmp_path}")  # fmt: skip
    assert "model.kind=llama is short for model.kind=gpt with model.family=llama" in line
    assert "write model.kind=gpt, or drop model.family" in line
    line = _refused(capsys, "train", f"{ROOT}/configs/llama_tiny.yaml", "model.family=gemma",
                    f"out_dir={tmp_path}")  # fmt: skip
    assert "model.family='gemma' is not a model family; use one of" in line and "'qwen2'" in line
    assert _listing(tmp_path) == before


def test_an_empty_value_names_the_key_and_the_fix(capsys, tmp_path):
    before = _listing(tmp_path)
    line = _refused(capsys, "train", f"{ROOT}/configs/lm_dp.yaml", "out_dir=")
    assert "out_dir has no value (`out_dir=` or null), and it takes str; give one" in line
    assert "None" not in line
    line = _refused(capsys, "train", f"{ROOT}/configs/lm_dp.yaml", "model.layers=",
                    f"out_dir={tmp_path}")  # fmt: skip
    assert "model.layers has no value (`model.layers=` or null), and it takes int" in line
    assert _listing(tmp_path) == before


def test_the_flags_that_take_no_value_are_the_parsers_own():
    """An option after which an override may follow (``--quick steps=3``) is a flag the CLI
    knows takes no value: every ``store_true`` option of explain and plan."""
    parser = cli._parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    flags = {
        option
        for name in ("explain", "plan")
        for action in commands[name]._actions
        if action.nargs == 0 and action.option_strings
        for option in action.option_strings
        if option.startswith("--")
    }
    assert flags == set(cli._FLAGS)


@needs_libtpu
def test_overrides_after_quick_are_read(capsys):
    """``--quick mesh.data=3``: the override is read (the mesh then refused for v5e-8's 8 chips,
    before anything compiles), not taken for the flag's value."""
    line = _refused(capsys, "explain", f"{ROOT}/configs/lm_dp.yaml", "--target", "v5e-8",
                    "--quick", "mesh.data=3")  # fmt: skip
    assert "mesh {'data': 3} does not make the 8 chips of v5e-8" in line


@needs_libtpu
def test_a_slice_shape_no_accelerator_type_names_keeps_its_topology():
    t = rp.targets.tpu_target("v5p:2x2x3")
    assert (t.name, t.chips, t.topology, t.label) == ("v5p:2x2x3", 12, "v5p:2x2x3", "v5p:2x2x3")
    assert rp.targets.tpu_target("v5p:2x2x2").name == "v5p-16"  # an accelerator type's shape
    from replicator._src.core import targets

    assert targets.describe(rp.tpu_devices("v5p:2x2x3")).name == "v5p:2x2x3"
    assert targets.describe(rp.tpu_devices("v5p-16")).name == "v5p-16"
