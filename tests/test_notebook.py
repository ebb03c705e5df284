"""The Colab quickstart notebook is stored valid and without outputs. The documentation's build
runs it from top to bottom in a fresh kernel and fails on a cell's error; `tests/test_docs.py`
reads the checks it printed there."""

import pathlib

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "quickstart.ipynb"


def test_notebook_is_stored_valid_and_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
