"""The README's API example runs as written, and its quickstart matches .ci/run. The code of the
documentation's pages is tests/test_guides.py's."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_api_example_runs_and_learns(capsys):
    block = README.split("## The whole API in one example", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["repl"].num_replicas == 8
    assert namespace["out"]["loss"].shape == (8,)
    assert float(namespace["out"]["loss"][0]) < 1e-3
    assert "repl.wrap_optimizer" in code


def test_ci_runs_the_readme_test_command():
    quickstart = re.search(r"## Quickstart.*?```bash\n(.*?)```", README, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in quickstart.strip().splitlines()]
    assert len(lines) == 2, "the quickstart is exactly two commands"
    assert lines[1] in (ROOT / ".ci" / "run").read_text()
    # The main job is tests/test_cli.py's smoke run of the same config.
    assert lines[0] == 'pip install -e ".[plot]" && replicator train configs/lm_pipeline.yaml'
    assert (ROOT / "configs" / "lm_pipeline.yaml").exists()


def test_the_api_example_is_the_only_python_in_the_readme():
    """Every other example lives in a docs page, where tests/test_guides.py runs it."""
    assert README.count("```python") == 1
