"""The examples, as short smoke runs: each trains and the loss falls."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_train_dp_example_learns():
    result = run_example("examples/train_dp.py", "--steps", "60", "--log-every", "20")
    assert "num_replicas=8" in result.stdout
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], result.stdout


@pytest.mark.slow
def test_lm_pipeline_example_learns_on_stdlib_text(tmp_path):
    result = run_example("examples/train_lm_pipeline.py", "--steps", "30", "--out", str(tmp_path))
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", result.stdout).groups())
    assert last < 0.9 * first and "tokens_per_s" in result.stderr
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


@pytest.mark.slow  # 3.4 s
def test_train_zero_example_shards_memory_and_learns():
    result = run_example("examples/train_zero.py", "--steps", "60", "--log-every", "20")
    assert "num_replicas=8" in result.stdout and "ZeRO stage 3" in result.stdout
    # Every device holds 1/8 of the parameters and Adam state (plus padding to a multiple of 8).
    ratio = float(re.search(r"MiB unsharded: (\d+\.\d+)x", result.stdout).group(1))
    assert 7.5 < ratio <= 8.0, result.stdout
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.2 * losses[0], result.stdout


def test_the_tokenizer_example_without_tokenizers_names_the_extra(tmp_path, monkeypatch, capsys):
    """Under an install without the [hf] extra: one line naming it, exit code 2, nothing
    written (in this process: the example's main with ``tokenizers`` made unimportable)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "example", ROOT / "examples" / "train_lm_tokenizer.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ModuleNotFoundError
    monkeypatch.setattr(sys, "argv", ["train_lm_tokenizer.py", "--out", str(tmp_path / "out")])
    assert example.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "needs the tokenizers package" in err and 'pip install "replicator[hf]"' in err, err
    assert not (tmp_path / "out").exists()
