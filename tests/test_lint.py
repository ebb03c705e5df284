"""The code passes ruff (lint and format), configured in pyproject.toml."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff(command):
    # The environment's own ruff, also when its Python runs without the venv activated.
    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
        "ruff"
    )
    assert ruff, "ruff is part of the test extra: pip install -e '.[test]'"
    result = subprocess.run([ruff, *command], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
