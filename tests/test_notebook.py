"""The Colab quickstart notebook runs from top to bottom in a fresh kernel, and its checks pass.

The kernel is a new process of this interpreter (ipykernel's native kernel), so the notebook's
``jax_num_cpu_devices=8`` applies there as it would on a fresh runtime.
"""

import os
import pathlib
import sys
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "quickstart.ipynb"


def test_notebook_is_stored_valid_and_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


def kernel_manager() -> AsyncKernelManager:
    """The python3 kernel of this interpreter. An installed "python3" kernelspec may start
    whatever ``python`` is on PATH; with no kernel directories, jupyter_client falls back to
    ipykernel's native spec, which runs ``sys.executable``."""
    specs = KernelSpecManager(kernel_dirs=[])
    km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs)
    assert km.kernel_spec.argv[0] == sys.executable, km.kernel_spec.argv
    return km


def kernel_env() -> dict:
    """This environment without settings that would change JAX's devices, on the CPU like the
    rest of the suite, importing this checkout's replicator."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def text_of(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "".join(parts)


@pytest.mark.slow
def test_notebook_runs_and_its_checks_pass(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint('kernel:', sys.executable)"))
    km = kernel_manager()
    client = NotebookClient(
        nb,
        km=km,
        kernel_name="python3",
        timeout=600,  # per cell, generous: the whole notebook takes about 10 s on 2 CPU cores
        startup_timeout=120,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    start = time.perf_counter()
    # Raises CellExecutionError if a cell fails; cleanup_kc: shut down the kernel we passed in.
    client.execute(env=kernel_env(), cleanup_kc=True)
    print(f"\nquickstart.ipynb executed in {time.perf_counter() - start:.1f} s")
    assert not km.has_kernel

    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert not [c for c in code if any(o.output_type == "error" for o in c.outputs)]
    assert code[0].outputs == []  # the install cell: replicator is importable, nothing to do
    text = "\n".join(text_of(c) for c in code)
    assert f"kernel: {sys.executable}" in text
    assert "8 devices: [CpuDevice(id=0)" in text
    assert "data parallel == single device: OK" in text
    assert "first run: 50 steps, resumed_from=None" in text
    assert "second run: resumed_from=50, now at step 100" in text
    assert "1F1B pipeline == sequential model: OK" in text
    assert "ZeRO-3 == single device: OK" in text
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)  # the plot
