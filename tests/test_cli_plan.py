"""`replicator plan CONFIG --devices N --memory M --hardware H`: the ranked table, the written
config that `replicator train` runs, and the refusals."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest
import yaml

import replicator as rp

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=32", "model.layers=2", "model.seq_len=16", "global_batch=16"]


def replicator(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "replicator.cli", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow
def test_plan_writes_the_best_layout_as_a_config_that_trains(tmp_path):
    """A small GPT on 8 devices, ZeRO-1 layouts with 1F1B or none, model and stage axes up to
    2: the table ranks the layouts that fit 4 MiB, the written config holds the best layout
    and `replicator train` runs it."""
    out, report = tmp_path / "best.yaml", tmp_path / "plan.json"
    run = replicator(
        "plan", "configs/lm_dp.yaml", *SMALL, "--devices", 8, "--memory", "4MiB",
        "--hardware", "tpu-v5e", "--schedules", "1f1b", "--max-model", 2, "--max-stage", 2,
        "--zero-stages", 1, "--out", out, "--json", report,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "layouts that fit, fastest first" in run.stdout and f"wrote {out}" in run.stdout
    plan = json.loads(report.read_text())
    best = plan["best"]
    assert plan["ranked"][0]["layout"] == best and best["zero_stage"] == 1
    assert all(c["compiled"]["memory"]["peak"] <= 4 * 2**20 for c in plan["ranked"])
    written = yaml.safe_load(out.read_text())
    assert written["zero_stage"] == 1 and written["model"]["d_model"] == 32
    mesh = {"data": best["data"]}
    mesh.update({k: best[k] for k in ("stage", "model") if best[k] > 1})
    assert written["mesh"] == mesh
    assert (written["pipeline"] is None) == (best["stage"] == 1)
    train = replicator(
        "train", out, "steps=2", "log_every=1", "checkpoint_every=2", f"out_dir={tmp_path}"
    )
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = (tmp_path / "lm_dp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]


@pytest.mark.slow  # 4.5 s
def test_plan_refusals_exit_2_with_the_message():
    run = replicator("plan", "configs/lm_dp.yaml", "--devices", 8, "--hardware", "tpu-v9")
    assert run.returncode == 2
    assert "replicator plan: hardware='tpu-v9' is neither a known profile" in run.stderr
    run = replicator("plan", "configs/lm_dp.yaml", "--devices", 0)
    assert run.returncode == 2 and "--devices must be 1 or more; got 0" in run.stderr
    run = replicator("plan", "configs/lm_dp.yaml", "--devices", 8, "--memory", "lots")
    assert run.returncode == 2 and "memory='lots' is not a size" in run.stderr
    run = replicator("plan", "configs/mlp_zero.yaml", "--devices", 8, "--compile-top", 2)
    assert run.returncode == 2 and "--compile-top prices a GPT; " in run.stderr
    run = replicator("plan", "configs/lm_dp.yaml", "--devices", 8, "--compile-top", "some")
    assert run.returncode == 2 and "--compile-top must be a number >= 1 or 'all'" in run.stderr


@pytest.mark.slow  # two families compiled on 8 emulated devices
def test_plan_compile_top_prices_every_layout_and_compiles_two_families(tmp_path):
    out = tmp_path / "plan.json"
    run = replicator("plan", "configs/lm_dp.yaml", *SMALL, "--devices", 8, "--hardware",
                     "tpu-v5e", "--compile-top", 2, "--json", out, "--out", tmp_path / "p.yaml")  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    everything = [*report["ranked"], *report["rejected"]]
    assert report["priced"] == len(everything) and all(c["priced"] for c in everything)
    tried = [c for c in everything if c["status"] not in ("skipped", "too big (priced)")]
    assert 1 <= len(tried) <= 2 * 3  # at most 3 layouts of each of the 2 families
    assert "priced first" in run.stdout and "compiling the 2 fastest families" in run.stderr
    assert "priced peak" in run.stdout  # the formulas' figures beside each program's


def test_plan_prices_a_gpt_first_by_default_and_compiles_every_family_when_told(monkeypatch):
    """Without --compile-top a GPT is priced and 4 families compiled; ``all`` compiles every
    family, as does the default for a model the formulas do not price."""
    from replicator import cli
    from replicator.cli import plan

    seen = {}
    monkeypatch.setattr(plan.rp, "plan", lambda build, families, **kw: seen.update(kw) or 0 / 0)
    for flag, priced in (([], 4), (["--compile-top", "all"], None), (["--compile-top", "7"], 7)):
        seen.clear()
        with pytest.raises(ZeroDivisionError):
            cli.main(["plan", str(ROOT / "configs/lm_dp.yaml"), *SMALL, "--devices", "8", *flag])
        assert seen.get("compile_top") == priced and ("model" in seen) == bool(priced)
    seen.clear()
    with pytest.raises(ZeroDivisionError):
        cli.main(["plan", str(ROOT / "configs/mlp_zero.yaml"), "--devices", "8"])
    assert "model" not in seen and "compile_top" not in seen


@pytest.mark.slow  # 12 TPU programs compiled here
def test_plan_for_a_tpu_target_compiles_each_layout_for_the_tpu(tmp_path):
    """--target v5p-16: the layouts of 8 chips, each compiled by libtpu for TPU v5p and priced
    on its chip (peak under its HBM); the best is written as a config."""
    pytest.importorskip("libtpu")
    out, report = tmp_path / "best.yaml", tmp_path / "plan.json"
    run = replicator(
        "plan", "configs/lm_dp.yaml", *SMALL, "--target", "v5p-16", "--max-stage", 1,
        "--max-model", 2, "--zero-stages", "0,3", "--out", out, "--json", report,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "plan for 8 devices of tpu-v5p" in run.stdout
    plan = json.loads(report.read_text())
    assert plan["ranked"] and plan["hardware"]["name"] == "tpu-v5p"
    assert all(c["compiled"]["memory"]["peak"] <= rp.planner.HARDWARE_PROFILES["tpu-v5p"].memory_bytes
               for c in plan["ranked"])  # fmt: skip
    assert yaml.safe_load(out.read_text())["model"]["d_model"] == 32
    refused = replicator("plan", "configs/lm_dp.yaml", "--target", "v5p-16", "--devices", 4)
    assert refused.returncode == 2 and "which has 8 chips; drop --devices" in refused.stderr
    refused = replicator("plan", "configs/lm_dp.yaml")
    assert refused.returncode == 2 and "give --devices N" in refused.stderr


# -- context and expert axes ----------------------------------------------------------------------

LONG = ["model.d_model=32", "model.layers=2", "model.seq_len=512", "global_batch=8"]


def plan_args(*argv):
    from replicator.cli import _parser

    return _parser().parse_args(["plan", "configs/lm_dp.yaml", "--devices", "8", *argv])


def test_a_long_sequence_config_gets_context_layouts_written_into_mesh():
    """Enumeration only (nothing compiled): model.seq_len=512 gets context axes (ring, and
    all-to-all where the config can say so), 64 does not; the written config puts the context
    axis in mesh: and, over it, the attention in model:."""
    from replicator.cli import config as config_lib
    from replicator.cli import plan

    args = plan_args("--max-model", "1", "--max-stage", "1", "--zero-stages", "1")
    cfg = config_lib.load(str(ROOT / "configs/lm_dp.yaml"), LONG)
    families = plan.layouts_for(cfg, 8, args)
    contexts = {(f.layouts[0].context, f.layouts[0].attention) for f in families}
    attention = {"ring", "all_to_all"} if "attention" in plan._model_keys() else {"ring"}
    assert contexts == {(1, None)} | {(c, a) for c in (2, 4, 8) for a in attention
                                      if a == "ring" or 4 % c == 0}  # fmt: skip
    short = config_lib.load(str(ROOT / "configs/lm_dp.yaml"), [*LONG[:2], "model.seq_len=64"])
    assert {f.layouts[0].context for f in plan.layouts_for(short, 8, args)} == {1}
    assert {f.layouts[0].context for f in plan.layouts_for(
        cfg, 8, plan_args("--max-context", "2", "--attention", "ring", "--max-model", "1",
                          "--max-stage", "1"))} == {1, 2}  # fmt: skip
    raw = dataclasses.asdict(cfg)
    raw.pop("learning_rate")
    written = plan.with_layout(raw, rp.planner.Layout(data=2, context=4, zero_stage=1))
    assert written["mesh"] == {"data": 2, "context": 4} and written["cpu_devices"] == 8
    assert written["model"].get("attention", "ring") == "ring"
    config_lib.from_dict(config_lib.TrainConfig, written, where="plan")  # a valid config
    if "experts" in plan._model_keys():  # once the config has the mixture-of-experts keys
        moe = config_lib.load(str(ROOT / "configs/lm_dp.yaml"), [*LONG, "model.experts=4"])
        experts = {f.layouts[0].expert for f in plan.layouts_for(moe, 8, args)}
        assert experts == {1, 2, 4}
        assert all(f.layouts[0].context == 1 for f in plan.layouts_for(moe, 8, args))


@pytest.mark.slow
def test_plan_lists_context_layouts_for_a_long_sequence(tmp_path):
    """`replicator plan` on configs/lm_dp.yaml with 512-token sequences: the table lists the
    context layouts (compiled: the ring's and the all-to-all's bytes in the JSON) beside data
    parallelism, and writes the best."""
    out, report = tmp_path / "best.yaml", tmp_path / "plan.json"
    run = replicator(
        "plan", "configs/lm_dp.yaml", *LONG, "--devices", 8, "--memory", "1GiB",
        "--hardware", "tpu-v5e", "--max-model", 1, "--max-stage", 1, "--zero-stages", 1,
        "--max-context", 4, "--compile-top", "all", "--out", out, "--json", report,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data=2 context=4 ring zero=1" in run.stdout, run.stdout
    plan = json.loads(report.read_text())
    ranked = {(c["layout"]["context"], c["layout"]["attention"]): c for c in plan["ranked"]}
    assert {(2, "ring"), (4, "ring"), (1, None)} <= set(ranked)
    kinds = {(c["kind"], tuple(c["axes"])) for c in ranked[4, "ring"]["compiled"]["collectives"]}
    assert ("collective-permute", ("context",)) in kinds
    for key, cand in ranked.items():
        if key[1] == "all_to_all":
            kinds = {(c["kind"], tuple(c["axes"])) for c in cand["compiled"]["collectives"]}
            assert ("all-to-all", ("context",)) in kinds
    written = yaml.safe_load(out.read_text())
    best = plan["best"]
    assert written["mesh"].get("context", 1) == best["context"]


def test_splash_configs_plan_no_model_axis_and_zero_below_3_without_reduce_dtype():
    """Llama 2 70B's config (splash attention, bf16 reduce_dtype under ZeRO-3): its layouts have
    no model or context axis, which the kernel refuses, and those of other ZeRO stages are written (and
    built) with reduce_dtype off, which the config would refuse and which changes nothing."""
    import argparse

    from replicator.cli import config as config_lib
    from replicator.cli import plan as plan_cli

    cfg = config_lib.load(ROOT / "configs/llama2_70b.yaml")
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "configs/llama2_70b.yaml", "--devices", "256"])
    families = plan_cli.layouts_for(cfg, 256, args)
    layouts = [lay for f in families for lay in f.layouts]
    assert layouts and all(lay.model == lay.context == lay.expert == 1 for lay in layouts)
    raw = dataclasses.asdict(cfg)
    raw.pop("learning_rate")
    for lay in (
        rp.planner.Layout(data=256, zero_stage=1),
        rp.planner.Layout(data=256, zero_stage=3),
    ):
        out = plan_cli.with_layout(raw, lay)
        config_lib.from_dict(config_lib.TrainConfig, out, where="plan")  # not refused
        want = "bfloat16" if lay.zero_stage == 3 else None
        assert out["model"]["reduce_dtype"] == want
