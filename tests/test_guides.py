"""The code written in the documentation's pages (docs/**/*.md) runs as the pages say.

Every ```python block of a page is run by a test here, found by its page, a line before it (a
heading, or a phrase of the text) and its index after that line;
`test_every_python_and_yaml_block_is_run` fails, naming the page and line, on a block no test
runs. Self-contained blocks run in this
process (`exec`, a fresh namespace); fragments run with the names they assume; blocks meant for a
script (`replicator launch`, worker processes, Weights & Biases) are written to a file and
started as the page says, on 127.0.0.1 only. The YAML configs load with the CLI's loader, and the
commands name configs that exist. The README's own code is tests/test_readme.py's.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import PartitionSpec as P

import replicator as rp

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^( *)```(\S*)[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
HEADING = re.compile(r"^#+ .*$", re.M)
TIMEOUT = 600  # seconds, for each process a test starts


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block of a page: its language (``""`` for a bare fence), its text (without
    the indentation of a list item), the 1-based line of its opening fence, and the heading
    above it."""

    page: str  # relative to docs/
    line: int
    lang: str
    code: str
    heading: str

    def __str__(self) -> str:
        return f"docs/{self.page}:{self.line} ({self.heading})"


def pages() -> list[str]:
    """The site's markdown pages, relative to docs/."""
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def blocks(page: str) -> list[Block]:
    """Every fenced code block of ``page``, in order."""
    text = (DOCS / page).read_text()
    fences = list(FENCE.finditer(text))
    headings = [  # not a comment line in a block
        h
        for h in HEADING.finditer(text)
        if not any(f.start() < h.start() < f.end() for f in fences)
    ]
    found = []
    for m in fences:
        above = [h.group(0) for h in headings if h.start() < m.start()]
        indent = len(m.group(1))
        code = "".join(line[indent:] for line in m.group(3).splitlines(keepends=True))
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(page, line, m.group(2), code, above[-1] if above else ""))
    return found


def block(page: str, after: str, index: int = 0, lang: str = "python") -> Block:
    """The ``index``-th ``lang`` block of ``page`` after ``after``: a heading (the whole line,
    which must be on the page once) or a phrase of the text (its first occurrence)."""
    text = (DOCS / page).read_text()
    if after.startswith("#"):
        lines = text.splitlines()
        assert lines.count(after) == 1, f"docs/{page}: {lines.count(after)} lines {after!r}"
        start = lines.index(after) + 1
    else:
        assert after in text, f"docs/{page} does not say {after!r}"
        start = text[: text.index(after)].count("\n") + 1
    later = [b for b in blocks(page) if b.line > start and b.lang == lang]
    assert len(later) > index, f"docs/{page}: no {lang} block {index} after {after!r}"
    return later[index]


def run(b: Block, namespace: dict | None = None, replace=()) -> dict:
    """Runs a python block in ``namespace`` (a fresh one by default) and returns it. Each
    ``(old, new)`` of ``replace`` must occur in the block once. Tracebacks name the page and its
    own line numbers."""
    code = b.code
    for old, new in replace:
        assert code.count(old) == 1, (str(b), old)
        code = code.replace(old, new)
    namespace = {} if namespace is None else namespace
    exec(compile("\n" * b.line + code, f"docs/{b.page}", "exec"), namespace)
    return namespace


def printed(b: Block, namespace: dict | None = None, replace=()) -> tuple[dict, str]:
    """`run`, and what the block printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        namespace = run(b, namespace, replace)
    return namespace, out.getvalue()


def process_env(**extra: str) -> dict:
    """This environment on the CPU, without settings that would change JAX's devices (nor a
    W&B key), importing this checkout's replicator."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAX_") and k not in ("XLA_FLAGS", "WANDB_API_KEY")
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def command(line: str) -> list[str]:
    """A command as a page writes it: ``replicator`` is this environment's, ``python`` this
    interpreter."""
    words = shlex.split(line)
    if words[0] == "replicator":
        script = pathlib.Path(sys.executable).with_name("replicator")
        words[:1] = [str(script)] if script.exists() else [sys.executable, "-m", "replicator.cli"]
    return [sys.executable if w == "python" else w for w in words]


def start(
    line: str, cwd: pathlib.Path, timeout: float = TIMEOUT, **env: str
) -> subprocess.CompletedProcess:
    """Runs a command line of a page in ``cwd``; prints the end of its output."""
    result = subprocess.run(
        command(line),
        cwd=cwd,
        env=process_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(result.stdout[-3000:], result.stderr[-3000:])
    return result


# The blocks that run as they are, each in a fresh namespace, with what they must have made.
SELF_CONTAINED = {
    "outputs come back whole": ("guides/data_parallel.md", "### Outputs come back whole", 0),
    "local sgd": ("guides/data_parallel.md", "### Local SGD across slices (DiLoCo)", 0),
    "debugging on one device": ("guides/pipelines.md", "**Debugging on one device.**", 0),
    "restore into another structure": (
        "guides/checkpoints_and_reliability.md",
        "A checkpoint restores only into the state that saved it.",
        0,
    ),
    "non-finite training": ("guides/checkpoints_and_reliability.md", "### Non-finite training", 0),
    "optimizers from python": ("guides/training_and_cli.md", "The same pieces from Python:", 0),
    "explain for a tpu target": (
        "guides/explain_and_plan.md",
        "The same from Python: a `Replicator` on the target's devices explains",
        0,
    ),
    "a qwen2 config": ("guides/llama_and_hf.md", "**Qwen2.**", 0),
    "generate text": ("guides/llama_and_hf.md", "## Generate text", 0),
}


@pytest.mark.parametrize("name", SELF_CONTAINED)
def test_self_contained_block_runs(name):
    b = block(*SELF_CONTAINED[name])
    ns, out = printed(b)
    if name == "outputs come back whole":
        assert ns["out"]["loss"].shape == (2,)
        assert ns["out"]["g_stages"]["w"].shape == (2, 4, 4, 8, 8)
        assert ns["out"]["g_head"].shape == (2, 8, 3)
    elif name == "debugging on one device":
        assert ns["repl"].lowering == "local"
        assert ns["state"]["stages"]["w"].sharding.spec == P()
        assert ns["out"]["g_stages"]["w"].shape == (1, 4, 2, 16, 16)
        assert "loss " in out  # jax.debug.print, eager
    elif name == "restore into another structure":
        assert "['ema']['w']" in out and "['params']['b']" in out, out
        assert set(ns["state"]) == {"params", "ema"}
    elif name == "non-finite training":
        assert "the training output 'loss' is nan at step 6" in out, out
    elif name == "explain for a tpu target":  # libtpu ([test]) compiles for v5p-16 here
        target, fits, mfu = out.split()
        assert (target, fits) == ("v5p-16", "True") and 0 < float(mfu.rstrip("%")) <= 100, out
        assert ns["report"].platform == "tpu" and ns["report"].num_devices == 8
    elif name == "local sgd":  # 10 outer steps of 4 inner steps each: towards w = (1, 2, 3)
        assert out.split()[-1] == "True", out
        assert all(x.shape[0] == 2 for x in jax.tree.leaves(ns["state"]["opt"].inner))
    elif name == "generate text":
        assert out.strip() == "(2, 20) (20,)", out
        assert (np.asarray(ns["greedy"])[:, :4] == [[1, 2, 3, 4], [5, 6, 7, 8]]).all()
    elif name == "a qwen2 config":
        assert (ns["config"].num_kv_heads, ns["config"].rope_theta) == (2, 1e6)
    elif name == "optimizers from python":
        assert out.splitlines() == [
            "{'b': False, 'w': True}",
            "[0.0, 0.0005, 0.001, 0.0005, 0.0]",
        ]


# Data parallelism


def test_nnx_batchnorm_example_runs_with_cross_replica_statistics():
    ns = run(block("guides/data_parallel.md", "### Cross-replica BatchNorm"))
    assert ns["model"].bn.axis_name == "data"  # built inside repl.context()
    assert ns["out"]["loss"].shape == (8,)


def test_linen_batchnorm_line_takes_statistics_over_the_global_batch():
    """The linen line, in a module's ``__call__``, in training mode inside ``step_fn``: the
    statistics of all 8 replicas' examples; in eval mode, anywhere."""
    import flax.linen as nn

    b = block("guides/data_parallel.md", "### Cross-replica BatchNorm", 1)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return run(b, {"nn": nn, "rp": rp, "x": x, "train": train})["x"]

    x = np.random.default_rng(0).normal(2.0, 3.0, size=(32, 4)).astype(np.float32)
    net = Net()
    variables = net.init(jax.random.key(0), x[:4], train=False)  # eval mode: outside any step
    repl = rp.Replicator()

    def step_fn(state, x):
        y, updates = net.apply(state, x, train=True, mutable=["batch_stats"])
        return state, {"y": y, "mean": updates["batch_stats"]["BatchNorm_0"]["mean"]}

    _, out = repl.run(step_fn, repl.replicate(variables), x)
    want = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5)
    np.testing.assert_allclose(np.asarray(out["y"]).reshape(32, 4), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["mean"][0], 0.01 * x.mean(0), rtol=1e-5)  # momentum 0.99


# ZeRO


def test_optimizer_example_runs_and_learns():
    ns = run(
        block(
            "guides/zero.md",
            "## Optimizer options: ZeRO, accumulation, clipping, compression, loss scaling",
        )
    )
    metrics = ns["metrics"]
    assert float(metrics["loss"][0]) < 0.05 * 16  # from ~16 at w = 0
    assert int(metrics["skipped"][0]) == 0
    mu = ns["state"]["opt"].inner[0].mu["w"]  # [16, 1]: its 16 rows over 8 replicas
    assert {s.data.shape for s in mu.addressable_shards} == {(2, 1)}


# Pipelines


def test_pipeline_example_runs_and_learns():
    from replicator import pipeline

    ns = run(block("guides/pipelines.md", "## Pipeline parallelism"))
    assert ns["state"]["params"]["stages"]["w"].sharding.spec == pipeline.stage_spec()
    losses = ns["losses"]
    assert losses[-1] < 0.5 * losses[0], losses


def test_pipeline_picture_is_current():
    from replicator import pipeline

    picture = block("guides/pipelines.md", '`pipeline.render("1f1b", 4, 6)` draws it', lang="")
    assert picture.code.strip() in pipeline.render("1f1b", 4, 6)


@pytest.mark.slow  # 4.2 s
def test_pipelines_of_any_model_example_runs_and_learns():
    ns = run(block("guides/pipelines.md", "## Pipelines of any model"))
    losses = ns["losses"]
    assert losses[-1] < 0.05 * losses[0], losses
    assert ns["packed"]["float32"].shape == (4, 2048)
    assert [sorted(p) for p in ns["trained"]] == [["b", "w"], ["b", "w"], ["w"], ["b", "w"]]
    ns = run(block("guides/pipelines.md", "## Pipelines of any model", 1))
    assert ns["split"].sizes == (2, 1, 1, 2)
    assert len(ns["model"]) == 4


def test_zero_bubble_picture_and_modelled_times_are_current():
    from replicator import pipeline

    picture = block("guides/pipelines.md", "### Zero-bubble", lang="")
    assert picture.code.strip() in pipeline.render("zerobubble", 4, 8)
    b = block("guides/pipelines.md", "### Modelled step time")
    want = "\n".join(line[2:] for line in b.code.splitlines() if line.startswith("# "))
    lines = []
    run(b, {"print": lambda *a: lines.append(" ".join(map(str, a)))})
    assert "\n".join(lines) == want


# Tensor parallelism and 3-D meshes


def test_tensor_parallel_example_runs_and_keeps_the_split():
    ns = run(block("guides/tensor_parallel.md", "## Tensor parallelism and 3-D meshes"))
    w1 = ns["state"][0]["w1"]
    assert w1.sharding.spec == P(None, "model")
    assert {s.data.shape for s in w1.addressable_shards} == {(12, 8)}
    assert ns["out"]["loss"].shape == (2,)


@pytest.mark.slow  # 3.3 s
def test_gpt_tensor_parallel_example_splits_the_heads():
    ns = run(block("guides/tensor_parallel.md", "### The GPT with tensor parallelism"))
    qkv = ns["qkv"]
    assert qkv.addressable_shards[0].data.shape == (2, 32, 24)
    assert ns["out"]["loss"].shape == (2,)


@pytest.mark.slow
def test_zero_on_3d_meshes_examples_split_over_data_on_top_of_model_and_stage():
    ns = run(block("guides/tensor_parallel.md", "### ZeRO on 3-D meshes"))  # FSDP x TP
    qkv = ns["qkv"]
    assert qkv.sharding.spec == P(None, "data", "model")
    assert qkv.addressable_shards[0].data.shape == (2, 16, 96)
    assert ns["report"].bytes_by(kind="all-gather", axes=("model",)) == 0
    assert ns["report"].bytes_by(kind="all-gather", axes=("data",)) > 0
    ns = run(block("guides/tensor_parallel.md", "### ZeRO on 3-D meshes", 1))  # ZeRO-1 x PP
    assert ns["mu"].sharding.spec == P("stage", "data")
    assert ns["mu"].addressable_shards[0].data.size == 256


# Context and experts


def test_long_context_example_equals_one_device():
    ns = run(block("guides/context_parallel.md", "## Long context: the `context` axis"))
    got, want = float(ns["out"]["out_sum"][0]), float(ns["want"])
    assert abs(got - want) <= 1e-5 * abs(want) + 1e-4


@pytest.mark.slow  # its first MoE compile; tests/test_moe.py covers the layer in the fast lane
def test_mixture_of_experts_example_counts_its_tokens():
    ns = run(block("guides/expert_parallel.md", "## Mixture of experts: the `expert` axis"))
    assert ns["y"].shape == (2, 8, 16)
    assert [int(r) for r in ns["stats"].routed] == [16, 16]  # 8 tokens x top-2 per sequence


# Multi-host: scripts for `replicator launch`, two processes on 127.0.0.1


@pytest.mark.slow
def test_multi_host_script_runs_on_two_processes(tmp_path):
    """The script's ``...`` is one step of the reader's own."""
    step = (
        "import jax.numpy as jnp\n"
        'step = lambda s, x: (s, {"loss": rp.all_reduce(jnp.mean(x), "mean")})\n'
        "_, out = repl.run(step, repl.replicate(jnp.zeros(())), jnp.ones((repl.num_replicas, 2)))\n"
    )
    b = block("guides/multi_host.md", "## Multi-host")
    assert b.code.count("\n...\n") == 1
    (tmp_path / "train.py").write_text(b.code.replace("\n...\n", "\n" + step))
    line = "replicator launch -n 2 --devices-per-process 4 -- python train.py"
    assert line in (DOCS / b.page).read_text()
    result = start(line, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "[0] 1.0" in lines and "[1] 1.0" not in lines  # process 0 prints the reduced loss


@pytest.mark.slow
def test_multi_slice_script_runs_unchanged_on_one_slice(tmp_path):
    b = block("guides/multi_host.md", "### Multi-slice TPU: the `dcn_data` axis")
    (tmp_path / "train.py").write_text(b.code)
    result = start("replicator launch -n 2 --devices-per-process 2 -- python train.py", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):  # CPU devices have no slice_index: one slice, dcn_data of size 1
        assert f"[{rank}] launcher None {{'dcn_data': 1, 'data': 4}}" in result.stdout


# Training and the command


@pytest.mark.slow  # 2.8 s on a quiet machine: 1020 steps, 10 checkpoints
def test_training_loop_examples_run(tmp_path):
    """The eval example as it is; then the ``rp.fit`` call above it, with that example's data,
    step and a fresh state, writing into tmp_path."""
    ns = run(block("guides/training_and_cli.md", "## Training loop", 1))
    evals = [r["eval_loss"] for r in ns["result"].history if "eval_loss" in r]
    assert len(evals) == 4 and evals[-1] < 0.1 * evals[0], evals
    ns["state"] = ns["repl"].replicate({"w": np.zeros((3, 1), np.float32)})
    run_dir = tmp_path / "run"
    ns = run(
        block("guides/training_and_cli.md", "## Training loop"),
        ns,
        replace=[
            ('directory="/tmp/run"', f'directory="{run_dir}"'),
            ('metrics_path="/tmp/run/metrics.jsonl"', f'metrics_path="{run_dir}/metrics.jsonl"'),
            ('tensorboard_dir="/tmp/run/tb"', f'tensorboard_dir="{run_dir}/tb"'),
        ],
    )
    result = ns["result"]
    assert result.step == 1000
    np.testing.assert_allclose(np.asarray(ns["state"]["w"])[:, 0], [1.0, -2.0, 0.5], atol=1e-3)
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) > 0
    assert any((run_dir / "tb").iterdir())
    assert rp.Checkpoints(run_dir).steps()[-1] == 1000


def test_array_record_shards_are_written_and_read_back(tmp_path, monkeypatch):
    from replicator.cli.data import DataConfig, examples

    monkeypatch.chdir(tmp_path)
    ns = run(block("guides/training_and_cli.md", "### Your own data"))
    shards = sorted(tmp_path.glob("data/train.array_record-*"))
    assert [p.name for p in shards] == [f"train.array_record-{s:05d}-of-00004" for s in range(4)]
    bash = block("guides/training_and_cli.md", "### Your own data", lang="bash")
    path = re.search(r"'data\.path=(.*?)'", bash.code).group(1)  # the glob the page trains on
    records = examples(DataConfig(path=path), kind="gpt", seq_len=64)
    assert records.size == ns["n"]
    with records.source() as source:
        first = records.example(source[0], 0)
    np.testing.assert_array_equal(first["tokens"], ns["ids"][:64])
    np.testing.assert_array_equal(first["targets"], ns["ids"][1:65])


@pytest.mark.slow
def test_your_own_writer_and_wandb_example_writes_an_offline_run(tmp_path):
    b = block("guides/training_and_cli.md", "#### Your own writer, and Weights & Biases")
    run_dir = tmp_path / "regression"
    script = b.code.replace('dir="/tmp/regression"', f'dir="{run_dir}"')
    assert script != b.code
    (tmp_path / "writers.py").write_text(script)
    closed_port = "http://127.0.0.1:9"  # offline: nothing may be sent
    result = start(
        "python writers.py",
        tmp_path,
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_BASE_URL=closed_port,
        WANDB_ERROR_REPORTING="false",
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
        HTTP_PROXY=closed_port,
        HTTPS_PROXY=closed_port,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == [
        "step 5",
        "step 10",
        "step 15",
        "step 20",
    ]
    assert lines[-1] == "closed"
    (offline,) = run_dir.glob("wandb/offline-run-*")
    assert list(offline.glob("run-*.wandb"))
    for log in tmp_path.glob("**/wandb/**/*.log"):  # no attempt to reach a server
        assert "127.0.0.1:9" not in log.read_text(errors="replace"), log


@pytest.mark.slow
def test_your_own_model_trains_with_the_command_the_page_gives(tmp_path):
    b = block("guides/training_and_cli.md", "### Your own model")
    (tmp_path / "linear.py").write_text(b.code)
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "lm_dp.yaml", tmp_path / "configs")
    (line,) = block(
        "guides/training_and_cli.md", "### Your own model", lang="bash"
    ).code.splitlines()
    result = start(line, tmp_path)  # from the directory linear.py is in
    assert result.returncode == 0, result.stderr[-3000:]
    assert "20 steps" in result.stdout
    (record,) = [json.loads(r) for r in (tmp_path / "runs/lm_dp/metrics.jsonl").open()][-1:]
    assert record["step"] == 20
    assert record["loss"] < 0.1 * 6.25  # from 6.25 (the squared weights' sum) at w = 0


# Checkpoints and reliability


def test_checkpoints_fragment_saves_and_restores(tmp_path):
    repl = rp.Replicator()
    state = repl.replicate({"w": np.arange(8, dtype=np.float32)})
    ns = run(
        block("guides/checkpoints_and_reliability.md", "## Checkpoints"),
        {"rp": rp, "step": 7, "state": state},
        replace=[('"/tmp/run1"', repr(str(tmp_path / "run1")))],
    )
    assert ns["record"]["step"] == 7 and ns["record"]["data_position"] == 7
    np.testing.assert_array_equal(ns["state"]["w"], np.arange(8))
    assert ns["ckpt"].steps() == [7]


def test_checkpoint_3d_example_restores_onto_another_layout():
    ns = run(
        block(
            "guides/checkpoints_and_reliability.md",
            "### Saving on a 3-D mesh, restoring onto another layout",
        )
    )
    assert ns["record"]["step"] == 100
    assert ns["state"]["params"]["w"].sharding.spec == ns["P"]("stage")


@pytest.mark.slow
def test_launcher_example_fails_in_rank_1_as_it_says(tmp_path):
    b = block("guides/checkpoints_and_reliability.md", "### The launcher: `replicator launch`")
    first = b.code.splitlines()[0]
    assert first.startswith("# save as fail.py, then: ")
    (tmp_path / "fail.py").write_text(b.code)
    result = start(first.removeprefix("# save as fail.py, then: "), tmp_path)
    assert result.returncode == 3
    assert "replicator launch: rank 1 exited with 3" in result.stdout + result.stderr


@pytest.mark.slow
def test_elastic_factor_fragment_runs_under_the_launcher(tmp_path):
    """The fragment, with the imports and the Replicator it assumes, on 2 processes."""
    b = block("guides/checkpoints_and_reliability.md", "### Restarts and elastic resizing")
    first = "info = rp.distributed.initialize()\n"
    assert b.code.startswith(first)
    script = "import optax\n\nimport replicator as rp\n\n" + first + "repl = rp.Replicator()\n"
    script += b.code.removeprefix(first)
    script += (
        "print(info.planned_count, info.process_count, info.elastic_factor, type(opt).__name__)\n"
    )
    (tmp_path / "train.py").write_text(script)
    result = start("replicator launch -n 2 --devices-per-process 2 -- python train.py", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):  # launched as planned: nothing to make up for
        assert f"[{rank}] 2 2 1 DistributedOptimizer" in result.stdout.splitlines()


# Explain and plan


def test_explain_example_runs_and_its_printed_tables_are_current():
    b = block("guides/explain_and_plan.md", "## Explain a step before paying for it")
    ns, _ = printed(b)
    report = ns["report"]
    assert report.bytes_by(kind="reduce-scatter") == 4 * 2 * 512 * 1024  # the fp32 gradient
    shown = [line.rstrip() for line in str(report).splitlines()]
    table = block("guides/explain_and_plan.md", "## Explain a step before paying for it", lang="")
    for line in table.code.splitlines():
        if "│" in line:  # the table rows (memory, FLOPs, collectives) as the code prints them
            assert line.rstrip() in shown or _same_within(line, shown, XLA_FLOPS_DRIFT), line


# The page prints jax 0.10.2's tables. XLA's counts of element-wise FLOPs move by a few hundredths
# of a percent between releases (1.711e+08 on 0.10.2, 1.713e+08 on 0.12 for the FLOPs row).
XLA_FLOPS_DRIFT = 0.0 if jax.__version_info__ < (0, 11) else 0.005


def _same_within(line: str, shown: list[str], rel: float) -> bool:
    """Whether some shown row has ``line``'s label and its number within ``rel``."""
    label, *cells = [c.strip() for c in line.strip().strip("│").split("│")]
    for row in shown:
        got_label, *got = [c.strip() for c in row.strip().strip("│").split("│")]
        if got_label == label and len(got) == len(cells) == 1:
            try:
                want, have = float(cells[0]), float(got[0])
            except ValueError:
                return False
            return abs(have - want) <= rel * abs(want)
    return False


@pytest.mark.slow  # 5.5 s
def test_plan_example_builds_the_layouts_it_plans():
    """The rp.plan example's build(layout) compiles two layouts in this 8-device process, and
    the plan ranks them (the whole plan runs as a script below)."""
    b = block("guides/explain_and_plan.md", "## Plan a layout: `replicator plan`")
    ns = run(b, {"__name__": "guide"})  # not "__main__": the example's plan is not run here
    layouts = [rp.planner.Layout(data=8), rp.planner.Layout(data=4, model=2, remat=True)]
    report = rp.plan(ns["build"], layouts, hardware="h100", memory="80GB", workers=0)
    assert {str(c.layout) for c in report.ranked} == {"data=8", "data=4 model=2 remat"}
    assert 'if __name__ == "__main__":' in b.code and "rp.planner.enumerate_layouts(" in b.code


@pytest.mark.slow
def test_plan_example_runs_as_a_script(tmp_path):
    """As the page says: a script whose plan runs under ``__main__``, in worker processes."""
    b = block("guides/explain_and_plan.md", "## Plan a layout: `replicator plan`")
    (tmp_path / "plan_gpt.py").write_text(b.code)
    result = start("python plan_gpt.py", tmp_path, timeout=1200)  # about a minute here
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layouts that fit, fastest first" in result.stdout
    best = re.search(r"^best: (.*)$", result.stdout, re.M).group(1)  # the report's last line
    assert result.stdout.splitlines()[-1] == best  # print(report.best)
    assert "stage" not in result.stdout  # no pipeline in this step


def test_hardware_profile_yaml_loads(tmp_path):
    b = block("guides/explain_and_plan.md", "### Hardware profiles", lang="yaml")
    path = tmp_path / "my_gpu.yaml"
    path.write_text(b.code)
    profile = rp.planner.hardware_profile(str(path))
    assert profile.name == "my-gpu" and profile.peak_flops == 1e15 and profile.island_size == 8
    assert profile.host_bandwidth == 6.4e10 and profile.host_memory_bytes == 256 * 10**9


def test_remat_by_name_yaml_is_maxtexts_llama_8b_offload():
    b = block("guides/explain_and_plan.md", "### Remat by name and host offload", lang="yaml")
    remat = yaml.safe_load(b.code)["model"]["remat"]
    policy = rp.pipeline.remat_policy(remat)
    assert policy.offloaded == ("decoder_layer_input", "key_proj", "out_proj", "query_proj",
                                "value_proj") and not policy.saved  # fmt: skip


def test_loss_chunks_yaml_loads_as_the_models_key():
    b = block("guides/explain_and_plan.md", "### The head's loss in chunks: `model.loss_chunks`",
              lang="yaml")  # fmt: skip
    from replicator.cli import config, jobs

    cfg = config.from_dict(config.TrainConfig, yaml.safe_load(b.code))
    assert cfg.model.loss_chunks == 8 and jobs.gpt_config(cfg).loss_chunks == 8


# Llama, Hugging Face checkpoints and tokenizers


@pytest.mark.slow
def test_hf_save_example_writes_what_transformers_loads(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from replicator.models import hf

    torch.manual_seed(0)
    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**sizes, num_attention_heads=4, num_key_value_heads=2)
    )
    model.save_pretrained(tmp_path / "llama")
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    params = hf.load(tmp_path / "llama", hf.abstract(hf.read_config(tmp_path / "llama"), mesh))
    run(
        block("guides/llama_and_hf.md", "## Fine-tune a Hugging Face Llama"),
        {"params": params},
        replace=[
            ('"/tmp/my-llama"', repr(str(tmp_path / "my-llama"))),
            ('"/path/to/llama"', repr(str(tmp_path / "llama"))),
        ],
    )
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "my-llama")
    want = model.state_dict()
    for name, value in again.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), want[name].numpy(), err_msg=name)


@pytest.mark.slow
def test_tokenizer_examples_train_and_pack_as_the_command_does(tmp_path, monkeypatch):
    """Both tokenizers train on a corpus of Python's own sources; the packing the page shows
    gives the windows ``data.tokenizer`` serves."""
    pytest.importorskip("tokenizers")
    spm = pytest.importorskip("sentencepiece")
    from replicator.cli.data import DataConfig, examples

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "tok").mkdir()
    sources = sorted(pathlib.Path(os.__file__).parent.glob("*.py"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sources[:120]]
    (tmp_path / "corpus" / "a.txt").write_text("".join(texts[:60]))
    (tmp_path / "corpus" / "b.txt").write_text("".join(texts[60:]))
    (tmp_path / "corpus" / "all.txt").write_text("".join(texts))
    run(block("guides/llama_and_hf.md", "## Tokenizers", 1))  # a byte-level BPE
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    run(block("guides/llama_and_hf.md", "## Tokenizers", 2))  # SentencePiece
    sp = spm.SentencePieceProcessor(model_file="tok/sp.model")
    assert sp.vocab_size() == 8000 and sp.id_to_piece(2) == "</s>"
    documents = [(tmp_path / "corpus" / name).read_text() for name in ("a.txt", "b.txt")]
    seq_len = 64
    ns = run(
        block("guides/llama_and_hf.md", "## Tokenizers", 0),  # EOS packing
        {"documents": documents, "tokenizer": sp, "eos_id": sp.eos_id(), "seq_len": seq_len},
    )
    data = DataConfig(path="corpus", extensions="a.txt,b.txt", tokenizer="tok/sp.model")
    served = examples(data, kind="gpt", seq_len=seq_len)
    ids = np.asarray(ns["ids"])
    assert len(served["tokens"]) == ns["n"]
    windows = np.stack([ids[i * seq_len : i * seq_len + seq_len] for i in range(ns["n"])])
    np.testing.assert_array_equal(served["tokens"], windows)


# Design


def test_every_case_of_exact_or_refused_is_listed():
    text = (DOCS / "design.md").read_text()
    section = text.split("## What is exact, and what is refused", 1)[1].split("\n## ", 1)[0]
    for case in [
        "zero_stage", "clip_global_norm", "stage", "repl.abstract", "Checkpoints.restore",
        "lowering=\"local\"", "BatchNorm", "eval_fn", "ReplicasDivergedError", "gather_params",
        "scan_layers", "jax_num_cpu_devices", "Checkpoints.save",
    ]:  # fmt: skip
        assert case in section, case


# Configs and commands


def load_config(tmp_path, text: str, base: str | None = None):
    """A YAML block as a config file (on top of ``configs/<base>``'s keys, for a block that is
    one section of a config), loaded as ``replicator train`` loads it."""
    from replicator.cli import config

    raw = yaml.safe_load((ROOT / "configs" / base).read_text()) if base else {}
    for key, value in yaml.safe_load(text).items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return config.load(path)


def test_config_sections_load(tmp_path):
    run_config = block("guides/training_and_cli.md", "### Optimizers and schedules", lang="yaml")
    assert run_config.code.startswith("# configs/my_run.yaml\n")
    loaded = load_config(tmp_path, run_config.code)
    assert loaded.name == "my_run" and loaded.optimizer.name == "adamw"
    assert loaded.optimizer.schedule == "cosine" and loaded.optimizer.warmup_steps == 20
    own_data = block("guides/training_and_cli.md", "### Your own data", lang="yaml")
    loaded = load_config(tmp_path, own_data.code, base="lm_dp.yaml")
    assert loaded.data.path == "corpus/" and loaded.data.extensions == ".txt,.md"
    tokenized = block("guides/llama_and_hf.md", "## Tokenizers", lang="yaml")
    loaded = load_config(tmp_path, tokenized.code, base="lm_dp.yaml")
    assert loaded.data.tokenizer == "tok/tokenizer.json" and loaded.model.vocab == 8000


COMMAND = re.compile(r"replicator (?:(?:train|explain|plan) configs/|launch -n)")


def commands() -> list[tuple[Block, list[str]]]:
    """The ``replicator`` commands of the pages' bash blocks and bare command blocks, each as
    its words (continuation lines joined; a ``$`` prompt and what follows ``#`` left out)."""
    found = []
    for page in pages():
        for b in blocks(page):
            if b.lang not in ("bash", ""):
                continue
            for line in b.code.replace("\\\n", " ").splitlines():
                line = line.removeprefix("$ ").split(" #")[0].strip()
                if b.lang == "" and not COMMAND.match(line):
                    continue  # a program's output
                if line and not line.startswith("#"):
                    found.append((b, shlex.split(line)))
    return found


def test_commands_name_configs_that_exist_and_load():
    """Each config a command names exists; a ``replicator train|explain|plan`` command's config
    loads with its overrides (those of placeholder paths aside)."""
    from replicator.cli import config

    checked = 0
    for b, words in commands():
        for word in words:
            for name in re.findall(r"configs/[\w.-]+\.ya?ml", word):
                assert (ROOT / name).exists(), f"{b}: {name} does not exist"
                checked += 1
        if "replicator" not in words:
            continue
        i = words.index("replicator")
        if words[i + 1 : i + 2] == ["launch"] and "--" in words:
            rest = words[words.index("--") + 1 :]
            if rest[:1] != ["replicator"]:
                continue
            i, words = 0, rest
        if words[i + 1] not in ("train", "explain", "plan") or not words[i + 2].startswith(
            "configs/"
        ):
            continue
        overrides = [w for w in words[i + 3 :] if "=" in w and not w.startswith("-")]
        if any("/path/to/" in w for w in overrides):
            overrides = [w for w in overrides if "/path/to/" not in w]
        config.load(ROOT / words[i + 2], overrides)
    assert checked >= 15, checked


# Every block is run


def claimed() -> set[tuple[str, int]]:
    """(page, line) of every block a test here runs or reads: the literal calls of `block` in
    this file, and SELF_CONTAINED."""
    found = set()
    for node in ast.walk(ast.parse(pathlib.Path(__file__).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "block":
            if not all(isinstance(a, ast.Constant) for a in node.args):
                continue  # block(*SELF_CONTAINED[name]), below
            args = [a.value for a in node.args]
            kwargs = {k.arg: k.value.value for k in node.keywords}
            b = block(*args, **kwargs)
            found.add((b.page, b.line))
    for spec in SELF_CONTAINED.values():
        b = block(*spec)
        found.add((b.page, b.line))
    return found


def test_every_python_and_yaml_block_is_run():
    run_here = claimed()
    missing = [
        str(b)
        for page in pages()
        for b in blocks(page)
        if b.lang in ("python", "yaml") and (b.page, b.line) not in run_here
    ]
    assert not missing, "blocks no test runs:\n" + "\n".join(missing)
    assert sum(b.lang == "python" for page in pages() for b in blocks(page)) >= 35
