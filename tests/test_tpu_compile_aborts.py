"""A TPU compile that ends the process never ends ``replicator explain --target``.

libtpu's compiler calls ``abort()`` on a failed internal check (libtpu 0.0.42.1 does, in XLA's
SPMD partitioner, on some FSDP x tensor-parallel programs). The CLI compiles a target in a
process of its own (`replicator.cli.isolated`); these tests end that process as libtpu would
(``REPLICATOR_TEST_ABORT_COMPILING``) before it compiles the step. The real abort on libtpu
0.0.42.1, in a per-layer compile the report then does without, is
`test_tpu_targets.test_llama_tiny_explains_with_the_per_layer_compiles`.
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import pytest

from replicator import cli
from replicator.cli import isolated

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='needs pip install "replicator[tpu]"'
)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _listing(path: pathlib.Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in path.rglob("*")}


def test_an_abort_compiling_the_step_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(isolated.ABORT_FOR_TESTS, "step")
    (tmp_path / "keep.txt").write_text("a user's file")
    before = _listing(tmp_path)
    out = tmp_path / "report.json"
    code = cli.main(
        ["explain", f"{ROOT}/configs/lm_dp.yaml", "--target", "v5p-16", "--json", str(out)]
    )
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    line = lines[0]
    assert line.startswith("replicator explain: the TPU compiler (jax "), line
    assert "ended the process (SIGABRT) compiling lm_dp's step for v5p-16: " in line
    assert "Check failed: step (tests.cc:1)" in line  # the compiler's own words, kept
    if jax.__version_info__ < (0, 12):
        assert "libtpu 0.0.42.1" in line and "jax 0.12 with libtpu 0.0.50.1 compiles" in line
    assert "another layout (a different zero_stage or mesh.model) may compile" in line
    assert captured.out == "" and _listing(tmp_path) == before  # no report written
