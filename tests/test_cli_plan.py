"""`replicator plan CONFIG --devices N --memory M --hardware H`: the ranked table, the written
config that `replicator train` runs, and the refusals."""

import dataclasses
import json
import pathlib
import subprocess
import sys
import types

import plan_jobs
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


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    """`replicator plan` of a small GPT on 8 devices: ZeRO-1 layouts with 1F1B or none, model
    and stage axes up to 2, within 4 MiB; every layout priced and the 2 fastest ladders
    compiled; the wide table. Its run, the written config's path and the JSON."""
    tmp = tmp_path_factory.mktemp("small_plan")
    out, report = tmp / "best.yaml", tmp / "plan.json"
    run = replicator(
        "plan", "configs/lm_dp.yaml", *SMALL, "--devices", 8, "--memory", "4MiB",
        "--hardware", "tpu-v5e", "--schedules", "1f1b", "--max-model", 2, "--max-stage", 2,
        "--zero-stages", 1, "--compile-top", 2, "--wide", "--out", out, "--json", report,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return types.SimpleNamespace(run=run, out=out, plan=json.loads(report.read_text()))


@pytest.mark.slow
def test_plan_writes_the_best_layout_as_a_config_that_trains(small_plan, tmp_path):
    """The table ranks the layouts that fit 4 MiB, the written config holds the best layout
    and `replicator train` runs it."""
    run, out, plan = small_plan.run, small_plan.out, small_plan.plan
    assert "layouts that fit, fastest first" in run.stdout and f"wrote {out}" in run.stdout
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


@pytest.mark.slow
def test_plan_compile_top_prices_every_layout_and_compiles_two_ladders(small_plan):
    """``--compile-top 2``: every layout priced, at most 3 layouts of each of 2 ladders
    compiled; ``--wide`` shows the step's parts and the priced figures beside the compiled."""
    run, report = small_plan.run, small_plan.plan
    everything = [*report["ranked"], *report["rejected"]]
    assert report["priced"] == len(everything) and all(c["priced"] for c in everything)
    tried = [c for c in everything if c["status"] not in ("skipped", "too big (priced)")]
    assert 1 <= len(tried) <= 2 * 3  # at most 3 layouts of each of the 2 ladders
    assert "priced first" in run.stdout and "compiling the 2 fastest ladders" in run.stderr
    header = next(line for line in run.stdout.splitlines() if "peak/device" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == [
        "#", "layout", "peak/device", "step", "compute", "bubble", "ICI", "DCN", "MFU",
        "priced peak", "priced step",
    ]  # fmt: skip


def test_plan_prints_the_columns_to_choose_by_in_120_columns_and_every_column_with_wide(
    monkeypatch, capsys, tmp_path
):
    """The default table fits a 120-column terminal with the layouts' longest names, and
    names what ``--wide`` and ``--json`` add; ``--wide`` prints the step's parts and the priced
    figures; the JSON carries them all. (`rp.plan` here plans fake programs, at once.)"""
    from replicator import cli
    from replicator.cli import plan

    layouts = [
        rp.planner.Layout(data=1, stage=2, schedule="interleaved", microbatches=4, repeats=2,
                          context=2, attention="all_to_all", model=2, zero_stage=1,
                          remat="dots"),
        rp.planner.Layout(data=4, model=2, zero_stage=3, accumulate_steps=16, remat=True),
    ]  # fmt: skip
    real = rp.plan

    def fake_plan(build, ladders, **kw):
        return real(plan_jobs.fake_build, layouts, **{**kw, "workers": 0, "progress": False})

    monkeypatch.setattr(plan.rp, "plan", fake_plan)
    shown = {}
    for flag in ([], ["--wide"]):
        report = tmp_path / f"plan{len(flag)}.json"
        argv = ["plan", str(ROOT / "configs/lm_dp.yaml"), *SMALL, "--devices", "8",
                "--hardware", "tpu-v5e", "--out", str(tmp_path / "p.yaml"), "--json",
                str(report), *flag]  # fmt: skip
        assert cli.main(argv) == 0
        shown[bool(flag)] = capsys.readouterr().out
    narrow, wide = (shown[w].split("\nwrote ")[0] for w in (False, True))  # the paths aside
    assert max(map(len, narrow.splitlines())) <= 120, narrow
    header = lambda text: next(line for line in text.splitlines() if "peak/device" in line)
    names = lambda text: [c.strip() for c in header(text).split("┃")[1:-1]]
    assert names(narrow) == ["#", "layout", "peak/device", "step", "MFU"]
    assert "or --wide; every figure: to_json() or --json" in narrow
    assert names(wide) == ["#", "layout", "peak/device", "step", "compute", "bubble", "ICI",
                           "DCN", "MFU", "priced peak", "priced step"]  # fmt: skip
    assert str(layouts[0]) in wide
    for c in json.loads(report.read_text())["ranked"]:
        assert {"total", "compute", "bubble", "ici", "dcn", "mfu"} <= set(c["time"])
        assert c["compiled"]["memory"]["peak"] and c["priced"]["peak_bytes"]


def test_plan_prices_a_gpt_first_by_default_and_compiles_every_ladder_when_told(monkeypatch):
    """Without --compile-top a GPT is priced and 4 ladders compiled; ``all`` compiles every
    ladder, as does the default for a model the formulas do not price."""
    from replicator import cli
    from replicator.cli import plan

    seen = {}
    monkeypatch.setattr(plan.rp, "plan", lambda build, ladders, **kw: seen.update(kw) or 0 / 0)
    for flag, priced, skip, limit in (
        ([], 4, 1.1, 240.0), (["--compile-top", "all"], None, None, None),
        (["--compile-top", "7", "--skip-slower", "1.5", "--time-limit", "90"], 7, 1.5, 90.0),
        (["--skip-slower", "none", "--time-limit", "none"], 4, None, None),
    ):  # fmt: skip
        seen.clear()
        with pytest.raises(ZeroDivisionError):
            cli.main(["plan", str(ROOT / "configs/lm_dp.yaml"), *SMALL, "--devices", "8", *flag])
        pricing = seen["pricing"]
        assert (None if pricing is None else pricing.compile_top) == priced
        assert (None if pricing is None else pricing.skip_slower) == skip
        assert (None if pricing is None else pricing.time_limit) == limit
        assert pricing is None or pricing.model.d_model == 32  # the config's GPT
    seen.clear()
    with pytest.raises(ZeroDivisionError):
        cli.main(["plan", str(ROOT / "configs/mlp_zero.yaml"), "--devices", "8"])
    assert seen["pricing"] is None


def test_plan_refusals_exit_2_with_the_message(capsys):
    """Each refused before anything compiles, with exit code 2 and one line naming the
    option (`replicator.cli.main`, which ``replicator`` exits with)."""
    from replicator import cli

    config = str(ROOT / "configs/lm_dp.yaml")
    for argv, message in [
        ([config, "--devices", "8", "--hardware", "tpu-v9"],
         "replicator plan: hardware='tpu-v9' is neither a known profile"),
        ([config, "--devices", "0"], "--devices must be 1 or more; got 0"),
        ([config, "--devices", "8", "--memory", "lots"], "memory='lots' is not a size"),
        ([str(ROOT / "configs/mlp_zero.yaml"), "--devices", "8", "--compile-top", "2"],
         "--compile-top prices a GPT; "),
        ([config, "--devices", "8", "--compile-top", "some"],
         "--compile-top must be a number >= 1 or 'all'"),
        ([config, "--devices", "8", "--skip-slower", "0.9"],
         "--skip-slower must be a number >= 1 or 'none'; got '0.9'"),
        ([config, "--devices", "8", "--time-limit", "0"],
         "--time-limit must be a number of seconds > 0 or 'none'; got '0'"),
        ([config, "--devices", "8", "--time-limit", "4m"],
         "--time-limit must be a number of seconds > 0 or 'none'; got '4m'"),
        ([config, "--target", "v5p-16", "--devices", "4"], "which has 8 chips; drop --devices"),
        ([config], "give --devices N"),
    ]:  # fmt: skip
        assert cli.main(["plan", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


@pytest.mark.slow  # 4 TPU programs compiled here
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
    hbm = rp.planner.HARDWARE_PROFILES["tpu-v5p"].memory_bytes
    assert all(c["compiled"]["memory"]["peak"] <= hbm for c in plan["ranked"])
    assert yaml.safe_load(out.read_text())["model"]["d_model"] == 32


@pytest.mark.slow  # 3 TPU programs of 2 slices compiled here, about 20 s
def test_plan_over_slices_puts_the_replicas_across_them_and_prices_the_dcn(tmp_path):
    """--target v5p-8 --slices 2: every layout has ``dcn_data=2`` (its other axes inside a
    slice of 4 chips); the table shows each one's DCN time; the priced DCN time (the replicas'
    reductions and gathers, hierarchical) is within 20% of the compiled program's; the written
    config's mesh crosses the slices."""
    pytest.importorskip("libtpu")
    out, report = tmp_path / "best.yaml", tmp_path / "plan.json"
    run = replicator(
        "plan", "configs/lm_dp.yaml", "model.d_model=512", "model.heads=8", "model.layers=2",
        "global_batch=16", "--target", "v5p-8", "--slices", 2, "--max-stage", 1,
        "--max-model", 1, "--zero-stages", "0,1,3", "--out", out, "--json", report,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "plan for 8 devices (2 slices of 4) of tpu-v5p" in run.stdout
    assert "DCN" in run.stdout.split("layouts that fit")[1].splitlines()[2]  # the header row
    plan = json.loads(report.read_text())
    tried = {(c["layout"]["zero_stage"], c["layout"]["hybrid"]) for c in plan["ranked"]}
    assert {(0, False), (1, False)} <= tried  # ZeRO over both slices (ZeRO-3: priced slower)
    assert {(1, True), (3, True)} <= tried  # and inside each (hybrid ZeRO)
    for c in plan["ranked"]:
        assert (c["layout"]["dcn_data"], c["layout"]["data"]) == (2, 4)
        assert c["compiled"]["mesh"] == {"dcn_data": 2, "data": 4}
        compiled, priced = c["time"]["dcn"], c["priced_time"]["dcn"]
        assert compiled > 0 and priced == pytest.approx(compiled, rel=0.2), c["layout"]
    best = yaml.safe_load(out.read_text())
    assert best["mesh"] == {"dcn_data": 2, "data": 4}
    assert best.get("zero_axes") == (["data"] if plan["ranked"][0]["layout"]["hybrid"] else None)


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
    ladders = plan.layouts_for(cfg, 8, args)
    contexts = {(f.layouts[0].context, f.layouts[0].attention) for f in ladders}
    attention = {"ring", "all_to_all"} if "attention" in plan._model_keys() else {"ring"}
    assert contexts == {(1, None)} | {(c, a) for c in (2, 4, 8) for a in attention
                                      if a == "ring" or 4 % c == 0}  # fmt: skip
    short = config_lib.load(str(ROOT / "configs/lm_dp.yaml"), [*LONG[:2], "model.seq_len=64"])
    assert {f.layouts[0].context for f in plan.layouts_for(short, 8, args)} == {1}
    assert {f.layouts[0].context for f in plan.layouts_for(
        cfg, 8, plan_args("--max-context", "2", "--attention", "ring", "--max-model", "1",
                          "--max-stage", "1"))} == {1, 2}  # fmt: skip
    raw = dataclasses.asdict(cfg)
    raw.pop("learning_rate", None)
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
    context layouts (compiled: the ring's bytes in the JSON) beside data parallelism, and
    writes the best. Its 3 ladders (data parallel; a ring over a context axis of 2 or 4) are all
    compiled, each from its fastest priced layout; the table fits 120 columns. (All-to-all over
    `context` is listed by the enumeration test above and compiled by test_cli_context_moe's
    explain of configs/gpt_long.yaml.)"""
    out, report = tmp_path / "best.yaml", tmp_path / "plan.json"
    run = replicator(
        "plan", "configs/lm_dp.yaml", *LONG, "--devices", 8, "--memory", "1GiB",
        "--hardware", "tpu-v5e", "--max-model", 1, "--max-stage", 1, "--zero-stages", 1,
        "--max-context", 4, "--attention", "ring", "--compile-top", 3, "--skip-slower", "none",
        "--out", out, "--json", report,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data=2 context=4 ring zero=1" in run.stdout, run.stdout
    table = run.stdout.split("\nwrote ")[0]  # the paths written aside
    assert max(map(len, table.splitlines())) <= 120, run.stdout
    plan = json.loads(report.read_text())
    ranked = {(c["layout"]["context"], c["layout"]["attention"]): c for c in plan["ranked"]}
    assert {(2, "ring"), (4, "ring"), (1, None)} <= set(ranked)
    kinds = {(c["kind"], tuple(c["axes"])) for c in ranked[4, "ring"]["compiled"]["collectives"]}
    assert ("collective-permute", ("context",)) in kinds
    assert {key[1] for key in ranked} == {"ring", None}  # --attention ring: no all-to-all
    written = yaml.safe_load(out.read_text())
    best = plan["best"]
    assert written["mesh"].get("context", 1) == best["context"]


def test_splash_configs_plan_no_model_axis_and_keep_the_reduce_dtype():
    """Llama 2 70B's config (splash attention, bf16 reduce_dtype under ZeRO-3): its layouts have
    no model or context axis, which the kernel refuses (a mixture's have expert axes), and those
    of every ZeRO stage are written (and built) with its reduce_dtype: below ZeRO-3 the
    optimizer sums the gradients in it."""
    import argparse

    from replicator.cli import config as config_lib
    from replicator.cli import plan as plan_cli

    cfg = config_lib.load(ROOT / "configs/llama2_70b.yaml")
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "configs/llama2_70b.yaml", "--devices", "256"])
    ladders = plan_cli.layouts_for(cfg, 256, args)
    layouts = [lay for f in ladders for lay in f.layouts]
    assert layouts and all(lay.model == lay.context == lay.expert == 1 for lay in layouts)
    # a mixture with splash attention: expert axes (they split sequences), as the Mixtral
    # recipes lay them out (configs/published/mixtral_8x22b_v6e-256.yaml: data 64 x expert 4)
    moe = config_lib.load(ROOT / "configs/published/mixtral_8x22b_v6e-256.yaml")
    moe_args = parser.parse_args(["plan", "configs/published/mixtral_8x22b_v6e-256.yaml",
                                  "--devices", "256"])  # fmt: skip
    moe_layouts = [lay for f in plan_cli.layouts_for(moe, 256, moe_args) for lay in f.layouts]
    assert {lay.expert for lay in moe_layouts} == {1, 2, 4, 8}
    assert all(lay.model == lay.context == 1 for lay in moe_layouts)
    raw = dataclasses.asdict(cfg)
    raw.pop("learning_rate", None)
    for lay in (
        rp.planner.Layout(data=256, zero_stage=1),
        rp.planner.Layout(data=256, zero_stage=3),
    ):
        out = plan_cli.with_layout(raw, lay)
        config_lib.from_dict(config_lib.TrainConfig, out, where="plan")  # not refused
        assert out["model"]["reduce_dtype"] == "bfloat16"


def test_a_recipes_own_remat_policy_by_name_is_planned_and_written_back():
    """Llama 3.1 8B's published recipe keeps its layer input and q/k/v/out projections in host
    memory (a policy by name): the plan tries that policy beside its presets, in layouts
    without a pipeline (a pipeline keeps its residuals on the device), and the config it writes
    holds the policy as the recipe wrote it."""
    import argparse

    from replicator.cli import config as config_lib
    from replicator.cli import plan as plan_cli

    path = "configs/published/llama3.1_8b_v6e-256.yaml"
    cfg = config_lib.load(ROOT / path)
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", path, "--target", "v6e-256"])
    own = ("decoder_layer_input=offload,key_proj=offload,out_proj=offload,query_proj=offload,"
           "value_proj=offload")  # fmt: skip
    layouts = [lay for f in plan_cli.layouts_for(cfg, 256, args) for lay in f.layouts]
    mine = [lay for lay in layouts if lay.remat == own]
    assert mine and all(lay.stage == 1 for lay in mine)
    assert {lay.remat for lay in layouts} >= {False, "dots", "save_dot_except_mlpwi", True, own}
    recipe = rp.planner.Layout(data=256, zero_stage=3, remat=own)
    assert recipe in layouts
    raw = dataclasses.asdict(cfg)
    raw.pop("learning_rate", None)
    out = plan_cli.with_layout(raw, recipe)
    assert out["model"]["remat"] == cfg.model.remat
    config_lib.from_dict(config_lib.TrainConfig, out, where="plan")  # not refused
    # priced by its names: 32 layers of 4 x 8,192 tokens, each keeping its input, q, out (4,096
    # wide each) and k, v (1,024) on the host in bf16: 28.00 GiB a chip, as the compiled
    # program's report says (BENCHMARKS.md); the MLP computed again
    from replicator._src.planner import pricing

    shape = plan_cli.pricing_options(cfg, args).model
    priced = pricing.price(recipe, shape)
    assert priced.host_memory == 32 * 4 * 8192 * (3 * 4096 + 2 * 1024) * 2 == 28 * 2**30
    assert priced.host_bytes == 2 * priced.host_memory
    kept = pricing.price(dataclasses.replace(recipe, remat="save_dot_except_mlpwi"), shape)
    assert kept.host_memory == 0 and kept.peak_bytes > priced.peak_bytes


def test_plan_compiles_for_a_tpu_in_one_process_for_each_two_cores(monkeypatch):
    """`plan.default_workers`: 2 processes (1 on one core); for a TPU target, whose compiler
    keeps 2 cores busy, one for each 2 cores, up to 2."""
    from replicator.cli import plan

    for cores, cpu, tpu in ((1, 1, 1), (2, 2, 1), (3, 2, 1), (4, 2, 2), (64, 2, 2)):
        monkeypatch.setattr(plan.os, "cpu_count", lambda c=cores: c)
        assert (plan.default_workers(None), plan.default_workers("v5p-8")) == (cpu, tpu), cores
