"""The README's API example runs as written, and its quickstart matches .ci/run."""

import pathlib
import re

import pytest

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


def pipeline_spec():
    from replicator import pipeline

    return pipeline.stage_spec()


def test_pipeline_example_runs_and_learns():
    block = README.split("## Pipeline parallelism", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["state"]["params"]["stages"]["w"].sharding.spec == pipeline_spec()
    losses = namespace["losses"]
    assert losses[-1] < 0.5 * losses[0], losses


def test_pipeline_picture_in_the_readme_is_current():
    from replicator import pipeline

    block = README.split('`pipeline.render("1f1b", 4, 6)` draws it', 1)[1]
    picture = re.search(r"```\n(.*?)```", block, re.S).group(1)
    assert picture.strip() in pipeline.render("1f1b", 4, 6)


def test_optimizer_example_runs_and_learns():
    block = README.split("## Optimizer options", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    metrics = namespace["metrics"]
    assert float(metrics["loss"][0]) < 0.05 * 16  # from ~16 at w = 0
    assert int(metrics["skipped"][0]) == 0
    mu = namespace["state"]["opt"].inner[0].mu["w"]  # [16, 1]: its 16 rows over 8 replicas
    assert {s.data.shape for s in mu.addressable_shards} == {(2, 1)}


def test_explain_example_runs_and_its_printed_tables_are_current(capsys):
    block = README.split("## Explain a step before paying for it", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    report = namespace["report"]
    assert report.bytes_by(kind="reduce-scatter") == 4 * 2 * 512 * 1024  # the fp32 gradient
    printed = re.search(r"```python\n.*?```\n\n```\n(.*?)```", block, re.S).group(1)
    shown = [line.rstrip() for line in str(report).splitlines()]
    for line in printed.splitlines():
        if "│" in line:  # the table rows (memory, FLOPs, collectives) as the code prints them
            assert line.rstrip() in shown, line


def test_nnx_batchnorm_example_runs_with_cross_replica_statistics():
    block = README.split("### Cross-replica BatchNorm", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["model"].bn.axis_name == "data"  # built inside repl.context()
    assert namespace["out"]["loss"].shape == (8,)


def test_every_case_of_exact_or_refused_is_listed():
    section = README.split("## What is exact, and what is refused", 1)[1].split("\n## ", 1)[0]
    for case in [
        "zero_stage", "clip_global_norm", "stage", "repl.abstract", "Checkpoints.restore",
        "lowering=\"local\"", "BatchNorm", "eval_fn", "ReplicasDivergedError", "gather_params",
        "scan_layers", "jax_num_cpu_devices", "Checkpoints.save",
    ]:  # fmt: skip
        assert case in section, case


def test_tensor_parallel_example_runs_and_keeps_the_split():
    block = README.split("## Tensor parallelism and 3-D meshes", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    from jax.sharding import PartitionSpec as P

    w1 = namespace["state"][0]["w1"]
    assert w1.sharding.spec == P(None, "model")
    assert {s.data.shape for s in w1.addressable_shards} == {(12, 8)}
    assert namespace["out"]["loss"].shape == (2,)


def run_block(after: str, index: int = 0) -> dict:
    """Runs the ``index``-th python block after the heading ``after`` and returns its names."""
    block = README.split(after, 1)[1]
    code = re.findall(r"```python\n(.*?)```", block, re.S)[index]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


@pytest.mark.slow  # 3.3 s
def test_gpt_tensor_parallel_example_splits_the_heads():
    namespace = run_block("### The GPT with tensor parallelism")
    qkv = namespace["qkv"]
    assert qkv.addressable_shards[0].data.shape == (2, 32, 24)
    assert namespace["out"]["loss"].shape == (2,)


@pytest.mark.slow
def test_zero_on_3d_meshes_examples_split_over_data_on_top_of_model_and_stage():
    from jax.sharding import PartitionSpec as P

    namespace = run_block("### ZeRO on 3-D meshes")  # FSDP x TP
    qkv = namespace["qkv"]
    assert qkv.sharding.spec == P(None, "data", "model")
    assert qkv.addressable_shards[0].data.shape == (2, 16, 96)
    assert namespace["report"].bytes_by(kind="all-gather", axes=("model",)) == 0
    assert namespace["report"].bytes_by(kind="all-gather", axes=("data",)) > 0
    namespace = run_block("### ZeRO on 3-D meshes", 1)  # ZeRO-1 x PP
    assert namespace["mu"].sharding.spec == P("stage", "data")
    assert namespace["mu"].addressable_shards[0].data.size == 256


def test_checkpoint_3d_example_restores_onto_another_layout():
    namespace = run_block("### Saving on a 3-D mesh, restoring onto another layout")
    assert namespace["record"]["step"] == 100
    assert namespace["state"]["params"]["w"].sharding.spec == namespace["P"]("stage")


@pytest.mark.slow  # 4.2 s
def test_pipelines_of_any_model_example_runs_and_learns():
    block = README.split("## Pipelines of any model", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    losses = namespace["losses"]
    assert losses[-1] < 0.05 * losses[0], losses
    assert namespace["packed"]["float32"].shape == (4, 2048)
    assert [sorted(p) for p in namespace["trained"]] == [["b", "w"], ["b", "w"], ["w"], ["b", "w"]]
    gpt_split = re.findall(r"```python\n(.*?)```", block, re.S)[1]
    namespace = {}
    exec(compile(gpt_split, "README.md", "exec"), namespace)
    assert namespace["split"].sizes == (2, 1, 1, 2)
    assert len(namespace["model"]) == 4


def test_zero_bubble_picture_and_modelled_times_in_the_readme_are_current():
    from replicator import pipeline

    block = README.split("### Zero-bubble", 1)[1]
    picture = re.search(r"```\n(.*?)```", block, re.S).group(1)
    assert picture.strip() in pipeline.render("zerobubble", 4, 8)
    block = README.split("### Modelled step time", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    printed = "\n".join(line[2:] for line in code.splitlines() if line.startswith("# "))
    namespace = {"print": lambda *a: lines.append(" ".join(map(str, a)))}
    lines = []
    exec(compile(code, "README.md", "exec"), namespace)
    assert "\n".join(lines) == printed


@pytest.mark.slow  # 5.5 s
def test_plan_example_builds_the_layouts_it_plans():
    """The README's rp.plan example: its build(layout) compiles two layouts in this 8-device
    process, and the plan ranks them (the enumeration itself runs in the example)."""
    import replicator as rp

    block = README.split("## Plan a layout", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {"__name__": "readme"}  # not "__main__": the example's plan is not run here
    exec(compile(code, "README.md", "exec"), namespace)
    layouts = [rp.Layout(data=8), rp.Layout(data=4, model=2, remat=True)]
    report = rp.plan(namespace["build"], layouts, hardware="h100", memory="80GB", workers=0)
    assert {str(c.layout) for c in report.ranked} == {"data=8", "data=4 model=2 remat"}
    assert 'if __name__ == "__main__":' in code and "rp.enumerate_layouts(" in code


def _run_block(heading):
    block = README.split(heading, 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def test_long_context_example_equals_one_device():
    ns = _run_block("## Long context: the `context` axis")
    got, want = float(ns["out"]["out_sum"][0]), float(ns["want"])
    assert abs(got - want) <= 1e-5 * abs(want) + 1e-4


@pytest.mark.slow  # its first MoE compile; tests/test_moe.py covers the layer in the fast lane
def test_mixture_of_experts_example_counts_its_tokens():
    ns = _run_block("## Mixture of experts: the `expert` axis")
    assert ns["y"].shape == (2, 8, 16)
    assert [int(r) for r in ns["stats"].routed] == [16, 16]  # 8 tokens x top-2 per sequence
