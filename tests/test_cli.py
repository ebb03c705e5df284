"""`replicator train CONFIG`: configs validate, and each shipped config trains (short runs)."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from replicator import cli
from replicator.cli import config, jobs
from replicator.cli.jobs import pictures

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_config_errors_name_the_key_and_list_the_valid_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nstepps: 3\n")
    with pytest.raises(
        ValueError,
        match=r"unknown key 'stepps' in TrainConfig\. Did you mean 'steps'\? Valid keys: name, model",
    ):
        config.load(path)
    path.write_text("name: x\nsteps: many\n")
    with pytest.raises(ValueError, match=r"steps: expected int; got 'many'"):
        config.load(path)
    path.write_text("model: {kind: gpt, layer: 2}\n")
    with pytest.raises(
        ValueError, match=r"unknown key 'layer' in ModelConfig\. Did you mean 'layers'"
    ):
        config.load(path)
    path.write_text("name: x\n")
    assert config.load(
        path, ["model.layers=8", "learning_rate=1", "pipeline.microbatches=8"]
    ) == config.TrainConfig(
        name="x",
        model=config.ModelConfig(layers=8),
        optimizer=config.OptimizerConfig(learning_rate=1.0),
        pipeline=config.PipelineConfig(microbatches=8),
    )
    with pytest.raises(ValueError, match=r"write key=value"):
        config.load(path, ["steps"])


# (lm_dp trains as a command in tests/test_cli_data.py, on its own text and on shards)
@pytest.mark.parametrize("name", ["lm_pipeline", "mlp_zero", "lm_3d"])
@pytest.mark.slow
def test_shipped_configs_train(name, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(ROOT / "configs" / f"{name}.yaml"),
         "steps=8", "log_every=4", "checkpoint_every=4", f"out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 4, 8]  # the first step too: the curve's start
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert (tmp_path / name / "loss.png").read_bytes()[:4] == b"\x89PNG"
    if name == "lm_pipeline":  # the schedule's picture, as text and as a PNG
        assert "schedule=1f1b K=4" in (tmp_path / name / "schedule.txt").read_text()
        assert (tmp_path / name / "schedule.png").read_bytes()[:4] == b"\x89PNG"
    if name == "lm_3d":  # the 3-D mesh, 1F1B over its 2 stages
        assert "'data': 2, 'stage': 2, 'model': 2" in run.stdout, run.stdout
        assert "schedule=1f1b K=2" in (tmp_path / name / "schedule.txt").read_text()


def _train(capsys, config_path, out_dir, *overrides) -> str:
    """``replicator train`` in this process (`cli.main`): what it printed."""
    code = cli.main(["train", str(config_path), f"out_dir={out_dir}", *overrides])
    said = "".join(capsys.readouterr())
    assert code == 0, said[-3000:]
    return said


@pytest.mark.slow
def test_cnn_bn_trains_and_resumes_on_the_same_data(tmp_path, capsys):
    cfg = ROOT / "configs" / "cnn_bn.yaml"
    args = ("log_every=2", "checkpoint_every=4", "plot=false")
    _train(capsys, cfg, tmp_path / "a", "steps=8", *args)
    rows = [json.loads(x) for x in (tmp_path / "a/cnn_bn/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4, 6, 8]
    assert all(math.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in rows), rows
    assert rows[-1]["loss"] < 0.9 * rows[0]["loss"], rows
    # Stopped at step 4 and run again: restored from the checkpoint, the input_fn replays the
    # same batches, so steps 6 and 8 match the uninterrupted run.
    _train(capsys, cfg, tmp_path / "b", "steps=4", *args)
    resumed = _train(capsys, cfg, tmp_path / "b", "steps=8", *args)
    assert "resumed from the checkpoint of step 4" in resumed
    again = [json.loads(x) for x in (tmp_path / "b/cnn_bn/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [1, 2, 4, 6, 8]
    for r, s in zip(rows, again):
        assert math.isclose(r["loss"], s["loss"], rel_tol=1e-5), (rows, again)
        assert r["accuracy"] == s["accuracy"]


def test_bad_config_exits_2_with_the_message(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nmae: x\n")
    run = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(path)], capture_output=True, text=True
    )
    assert run.returncode == 2 and "unknown key 'nmae'" in run.stderr


def _explain(config, *overrides, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "replicator.cli", "explain", str(ROOT / "configs" / config),
         *overrides],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
def test_explain_reports_the_main_job_without_training(tmp_path):
    run = _explain("lm_pipeline.yaml", f"out_dir={tmp_path}", "--json", str(tmp_path / "r.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    for words in ("memory per device", "collective-permute", "pipeline: 1f1b, K=4 stages"):
        assert words in run.stdout, run.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mesh"] == {"data": 2, "stage": 4} and report["num_devices"] == 8
    (p,) = report["pipelines"]
    sent = sum(c["bytes"] * c["count"] for c in report["collectives"]
               if c["kind"] == "collective-permute")  # fmt: skip
    # global_batch 32 over 2 replicas, 4 micro-batches: 4 sequences of 64 tokens x d_model 64.
    assert p["activation_bytes"] == 4 * 64 * 64 * 4
    assert sent == p["activation_bytes"] * p["sends_per_step"] == p["activation_bytes"] * 2 * 10
    assert not (tmp_path / "lm_pipeline").exists()  # nothing trained, nothing written


@pytest.mark.slow
def test_explain_plans_a_64_device_mesh_on_this_machine(tmp_path):
    run = _explain(
        "lm_pipeline.yaml", "mesh.data=8", "mesh.stage=8", "model.layers=16",
        "global_batch=256", "pipeline.microbatches=8", "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_devices"] == 64 and report["platform"] == "cpu"
    assert report["pipelines"][0]["num_stages"] == 8


def test_explain_zero3_config_shows_its_gathers_and_scatters():
    run = _explain("mlp_zero.yaml")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "all-gather" in run.stdout and "reduce-scatter" in run.stdout


def test_explain_of_an_impossible_config_says_why_and_exits_2():
    run = _explain("lm_pipeline.yaml", "mesh.stage=8", "mesh.data=1", "model.layers=8")
    assert run.returncode == 2
    assert "replicator explain: OneFOneB.timetable: num_microbatches must be >= num_stages" in (
        run.stderr
    )
    assert "Traceback" not in run.stderr


def test_interleaved_with_micro_batches_not_a_multiple_of_the_stages_is_refused_at_once(
    capsys, tmp_path
):
    """train and explain: the library's message and the config keys, exit 2, before anything is
    traced (so before the first step) and without a traceback."""
    path = ROOT / "configs" / "lm_pipeline.yaml"
    overrides = ["pipeline.schedule=interleaved", "model.layers=8", "pipeline.microbatches=6",
                 "global_batch=24", f"out_dir={tmp_path}"]  # fmt: skip
    assert config.load(path, overrides).pipeline.schedule == "interleaved"
    for command in ("train", "explain"):
        assert cli.main([command, str(path), *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"replicator {command}: Interleaved1F1B.timetable: num_microbatches must be a multiple "
            f"of num_stages"
        ), err
        assert "OneFOneB(). In the config: pipeline.microbatches=6 with mesh.stage=4" in err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "lm_pipeline" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "name, overrides, words",
    [
        ("cnn_bn", ["zero_stage=3"], "model.kind='cnn' supports zero_stage 0, 1 or 2"),
        ("cnn_bn", ["accumulate_steps=2"], "accumulate_steps=2"),
        ("cnn_bn", ["mesh.stage=2"], "model.kind='cnn' is data parallel"),
        ("lm_pipeline", ["pipeline=null"], "a mesh with a 'stage' axis needs a pipeline: section"),
        ("cnn_bn", ["mesh.model=2"], "model.kind='cnn' has no tensor-parallel layout"),
        ("mlp_zero", ["mesh.model=2"], "model.kind='mlp' has no tensor-parallel layout"),
        ("lm_3d", ["model.heads=3", "model.d_model=96"], "model.heads=3 does not split over mesh"),
    ],
)
def test_what_a_model_kind_needs_is_checked_when_the_config_loads(
    name, overrides, words, capsys, tmp_path
):
    path = ROOT / "configs" / f"{name}.yaml"
    with pytest.raises(ValueError, match=f"^{path}: .*{words}"):
        config.load(path, overrides)
    errors = []
    for command in ("train", "explain"):
        assert cli.main([command, str(path), f"out_dir={tmp_path}", *overrides]) == 2
        errors.append(capsys.readouterr().err)
    assert errors[0].removeprefix("replicator train: ") == errors[1].removeprefix(
        "replicator explain: "
    )
    assert errors[0].count("\n") == 1 and words in errors[0], errors
    assert not (tmp_path / name).exists()  # refused before the run directory


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_reduce_dtype_below_zero3_is_the_optimizers_grad_dtype(stage):
    """``model.reduce_dtype`` below ZeRO-3 is the dtype the optimizer sends the gradients in
    (`wrap_optimizer(grad_dtype=...)`), not the model's (which gathers nothing): the values are
    tests/test_cli_gpt_layouts.py's."""
    from replicator.cli.jobs import base, gpt_job

    path = ROOT / "configs/llama2_7b.yaml"
    cfg = config.load(path, [f"zero_stage={stage}"])
    assert (base.grad_dtype(cfg), gpt_job.gpt_config(cfg).reduce_dtype) == ("bfloat16", None)
    for off in ("null", "float32"):
        cfg = config.load(path, [f"zero_stage={stage}", f"model.reduce_dtype={off}"])
        assert base.grad_dtype(cfg) is None
    cfg = config.load(path, ["zero_stage=3"])
    assert (base.grad_dtype(cfg), gpt_job.gpt_config(cfg).reduce_dtype) == (None, "bfloat16")


def test_the_config_families_are_the_gpt_and_the_hugging_face_families():
    """``model.family`` means a model family: the GPT's own or one of `FAMILIES` (the config
    keeps its own list, imported before JAX starts)."""
    from replicator.models.families import FAMILIES

    assert config.MODEL_FAMILIES == ("gpt", *FAMILIES)
    assert config.EXPERT_FAMILIES == tuple(name for name, f in FAMILIES.items() if f.experts)


QWEN2_TINY = """\
name: qwen2_tiny
model: {kind: gpt, family: qwen2, d_model: 32, layers: 2, heads: 4, kv_heads: 2, seq_len: 16,
        tie_embeddings: true}
mesh: {data: -1}
steps: 2
global_batch: 8
log_every: 1
"""


@pytest.mark.slow  # a CLI run end to end; the fast lane builds the family config in test_qwen2
def test_a_qwen2_from_scratch_has_query_key_value_biases_and_trains(tmp_path):
    path = tmp_path / "qwen2.yaml"
    path.write_text(QWEN2_TINY)
    cfg = config.load(path, [f"out_dir={tmp_path}", "plot=false"])
    model = jobs.gpt_config(cfg)  # Llama's block with the family's options
    assert (model.qkv_bias, model.bias, model.norm, model.gated) == (True, False, "rms", True)
    _, _, state, _, _ = jobs.build(cfg)
    attention = state["job"]["params"]["blocks"]["attn"]
    assert sorted(attention) == ["k", "k_bias", "out", "q", "q_bias", "v", "v_bias"]
    summary = jobs.run(cfg)
    lines = [
        json.loads(x) for x in (tmp_path / "qwen2_tiny/metrics.jsonl").read_text().splitlines()
    ]
    assert summary["steps"] == 2 and [r["step"] for r in lines] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in lines)
    assert lines[0]["loss"] == pytest.approx(math.log(256), rel=0.05)  # from scratch: uniform


@pytest.mark.parametrize(
    "model, words",
    [
        ("{kind: gpt, family: mixtral}",
         r"model\.family='mixtral' has a mixture of experts in every block; got experts=0, "
         r"moe_every=1\. Set model\.experts \(e\.g\. model\.experts=8, with model\.top_k=2\) "
         r"and model\.moe_every=1, or use model\.family=llama for a dense model\."),
        ("{kind: gpt, family: qwen}",
         r"model\.family='qwen' is not a model family; use one of 'gpt', 'llama', 'mixtral', "
         r"'qwen2', .*'mistral'\. Did you mean 'qwen\d'\?"),
        ("{kind: gpt, kv_heads: 2}",
         r"model\.kv_heads=2 is for the families on Llama's block \(family: llama, mixtral, "
         r"qwen2, .*mistral\); remove the key, or use kind: llama\."),
    ],
)  # fmt: skip
def test_a_family_the_model_cannot_be_is_refused_naming_the_key_and_the_fix(tmp_path, model, words):
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {model}\n")
    with pytest.raises(ValueError, match=f"^{path}: {words}"):
        config.load(path)


def test_a_mixtral_from_scratch_is_llama_with_experts():
    cfg = config.from_dict(config.TrainConfig, {
        "model": {"kind": "gpt", "family": "mixtral", "experts": 4, "top_k": 2, "d_model": 32,
                  "heads": 4, "layers": 2}})  # fmt: skip
    model = jobs.gpt_config(cfg)
    assert (model.num_experts, model.top_k, model.norm, model.bias) == (4, 2, "rms", False)
    assert (model.capacity_factor, model.aux_weight) == (1.25, 0.01)  # the config's keys


def test_the_short_forms_become_long_forms_before_any_config_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    raw = {"model": {"kind": "llama", "heads": 4, "kv_heads": 2}, "optimizer": "sgd",
           "learning_rate": "1e-2", "wandb": True, "out_dir": "~/runs", "init_from": ""}  # fmt: skip
    cfg = config.from_dict(config.TrainConfig, raw)
    assert (cfg.model.kind, cfg.model.family, cfg.model.kv_heads) == ("gpt", "llama", 2)
    assert cfg.optimizer == config.OptimizerConfig(name="sgd", learning_rate=0.01)
    assert cfg.wandb == config.WandbConfig() and cfg.init_from is None
    assert cfg.out_dir == str(tmp_path / "runs")
    assert raw["optimizer"] == "sgd"  # the data read is not changed
    assert config.from_dict(config.TrainConfig, {"wandb": False}).wandb is None
    # a frozen config only checks: built in Python, a short form is refused with its long form
    for build, words in [
        (lambda: config.ModelConfig(kind="llama"),
         r"ModelConfig: kind='llama' is a config file's short form of kind='gpt' with "
         r"family='llama'; build ModelConfig\(kind='gpt', family='llama'\)"),
        (lambda: config.TrainConfig(wandb=True),
         r"TrainConfig: wandb=True is a config file's short form of wandb: \{\}; give "
         r"wandb=WandbConfig\(\)"),
        (lambda: config.TrainConfig(out_dir="~/runs"),
         r"TrainConfig: out_dir='~/runs' is a config file's short form of the home directory; "
         r"give out_dir=os.path.expanduser\('~/runs'\)"),
        (lambda: config.TrainConfig(init_from="/ckpt"),
         r"TrainConfig: init_from='/ckpt' starts a model of a Hugging Face family"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{words}"):
            build()


def test_no_frozen_config_is_changed_after_it_is_built():
    sources = (ROOT / "replicator" / "cli").rglob("*.py")
    assert not [p for p in sources if "object.__setattr__" in p.read_text()]


def test_the_loss_picture_starts_at_the_first_logged_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "loss": 5.5}, {"step": 20, "loss": 3.0}, {"step": 20, "eval_loss": 3.1}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 40, "lo')
    assert pictures.logged_losses(str(metrics)) == [(1, 5.5), (20, 3.0)]  # a cut line passed over
    cfg = config.TrainConfig(name="x")
    pictures.plot_loss(str(metrics), str(tmp_path / "loss.png"), cfg)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
