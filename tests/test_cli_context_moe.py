"""`replicator train` on the `context` and `expert` axes: the shipped long-context and
mixture-of-experts configs train and explain; the mixture-of-experts job equals one device and
logs its routing (the load-balancing loss and the fraction of token-choices dropped); the model
keys reach the GPT; and what these axes cannot run is refused when the config loads, naming
the key."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
from unittest import mock

import jax
import numpy as np
import optax
import pytest
from oracle import rel_err

import replicator as rp
from replicator import cli
from replicator.cli import config as config_lib
from replicator.cli import jobs
from replicator.cli.config import ModelConfig, TrainConfig
from replicator.cli.optimizers import OptimizerConfig
from replicator.models import gpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONG, MOE, DP, PIPE, MLP, CNN = (
    ROOT / "configs" / f"{n}.yaml"
    for n in ("gpt_long", "gpt_moe", "lm_dp", "lm_pipeline", "mlp_zero", "cnn_bn")
)
TOL = 1e-5


def train(path, out_dir, *overrides, capsys=None):
    """``replicator train`` (`cli.main`, in this process unless ``capsys`` is None: then as a
    command, as tests/test_cli.py runs the shipped configs): its output and metrics lines."""
    args = ["train", str(path), f"out_dir={out_dir}", "plot=false", *overrides]
    if capsys is not None:
        assert cli.main(args) == 0, capsys.readouterr().err[-3000:]
        out = capsys.readouterr().out
    else:
        run = subprocess.run(
            [sys.executable, "-m", "replicator.cli", *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        out = run.stdout
    name = config_lib.load(path, overrides).name
    lines = (pathlib.Path(out_dir) / name / "metrics.jsonl").read_text().splitlines()
    return out, [json.loads(x) for x in lines]


def explain(capsys, path, *overrides):
    """``replicator explain`` (`cli.main`): its output."""
    assert cli.main(["explain", str(path), *overrides]) == 0, capsys.readouterr().err[-3000:]
    return capsys.readouterr().out


def assert_moe_metrics(rows):
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("loss", "cross_entropy", "aux_loss")), r
        assert 0 <= r["dropped_fraction"] <= 1 and r["aux_loss"] > 0, r
        # the loss is the one optimized: cross-entropy plus aux_weight x the balancing loss
        assert math.isclose(r["loss"], r["cross_entropy"] + 0.01 * r["aux_loss"], rel_tol=1e-5)


# -- the shipped configs, a few steps -----------------------------------------------------------


@pytest.mark.slow  # the fast lane explains the config (the same program, compiled)
def test_the_long_context_config_trains_with_all_to_all_attention(tmp_path, capsys):
    """{data: 2, context: 4}, 1024 tokens a sequence, all-to-all over the heads
    (`replicator train configs/gpt_long.yaml model.attention=all_to_all`); the config as
    shipped, a ring (zigzag), is explained in `test_explain_reports_the_configs`, and the ring
    trains as one device in tests/test_gpt_context.py. (10 steps as shipped took the loss from
    about ln(256) = 5.5 to 3.89, gpt_moe's to 3.77: `test_the_moe_job_equals_one_device_and_
    logs_its_routing` trains gpt_moe as one device.)"""
    out, rows = train(LONG, tmp_path, "steps=3", "log_every=1", "model.attention=all_to_all",
                      capsys=capsys)  # fmt: skip
    assert "'data': 2, 'context': 4" in out, out
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows), rows
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    assert "aux_loss" not in rows[0]  # a dense GPT has no routing to report


@pytest.mark.parametrize(
    "path, overrides, words",
    [
        pytest.param(  # the ring's K/V blocks
            LONG, ["model.layers=2"], "collective-permute", marks=pytest.mark.slow
        ),
        pytest.param(
            LONG,
            ["model.layers=2", "model.attention=all_to_all"],
            "all-to-all",
            marks=pytest.mark.slow,
        ),
        pytest.param(MOE, ["model.layers=2"], "all-to-all", marks=pytest.mark.slow),
    ],
)
def test_explain_reports_the_configs(path, overrides, words, tmp_path, capsys):
    out = explain(capsys, path, *overrides, "--json", str(tmp_path / "r.json"))
    assert "memory per device" in out and words in out, out
    report = json.loads((tmp_path / "r.json").read_text())
    axis = "context" if path == LONG else "expert"
    assert report["mesh"] == {"data": 2, axis: 4}
    assert any(axis in c["axes"] for c in report["collectives"]), report["collectives"]


# -- the mixture-of-experts job against one device ---------------------------------------------


def moe_job(mesh, **overrides) -> TrainConfig:
    """A tiny MoE GPT, SGD, no clipping; capacity 0.5 (drops)."""
    model = dict(kind="gpt", d_model=32, layers=2, heads=4, seq_len=16, experts=8, top_k=2,
                 capacity_factor=0.5)  # fmt: skip
    return TrainConfig(
        model=ModelConfig(**model),
        mesh=mesh,
        steps=3,
        optimizer=OptimizerConfig(name="sgd", learning_rate=0.1),
        clip_global_norm=None,
        **{"global_batch": 8, **overrides},  # 4 sequences a replica: 1 a device of `expert`
    )


def wide_init(config, key, init=gpt.init):
    """`gpt.init` with routers 25x wider: choices far from ties, so that a sum in another order
    cannot flip one (as tests/test_gpt_moe.py does)."""
    params = init(config, key)
    params["blocks"]["moe"]["moe"]["router"] = 25 * params["blocks"]["moe"]["moe"]["router"]
    return params


def oracle(config: TrainConfig, batches):
    """The steps on one device with the whole batch: SGD on `gpt.loss`, and each step's
    statistics from `gpt.loss_and_stats` (before the update, as the step's)."""
    model, tx = jobs.gpt_config(config), optax.sgd(0.1)
    grad = jax.jit(jax.value_and_grad(
        lambda p, b: gpt.loss_and_stats(p, b["tokens"], b["targets"], config=model),
        has_aux=True,
    ))  # fmt: skip
    params = wide_init(model, jax.random.key(0))
    opt, metrics = tx.init(params), []
    for batch in batches:
        (loss, stats), g = grad(params, batch)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
        stats = {k: float(v) for k, v in stats.items()}
        dropped = stats.pop("dropped") / stats.pop("routed")
        metrics.append({"loss": float(loss), **stats, "dropped_fraction": dropped})
    return params, metrics


def whole(tree):
    """ZeRO-3's ShardedParams as host arrays (each stored in its own shape)."""
    is_sharded = lambda x: isinstance(x, rp.ShardedParam)
    return jax.tree.map(lambda p: np.asarray(getattr(p, "value", p)), tree, is_leaf=is_sharded)


@pytest.mark.parametrize(
    "zero_stage, accumulate_steps",
    [
        # (ZeRO-0 without accumulation: tests/test_mixtral.py's and test_moe.py's oracles)
        pytest.param(3, 2, marks=pytest.mark.slow),
        pytest.param(1, 2, marks=pytest.mark.slow),
    ],
)
def test_the_moe_job_equals_one_device_and_logs_its_routing(zero_stage, accumulate_steps):
    """{data: 2, expert: 4}, each device 2 of the 8 experts: three SGD steps of the CLI's job
    equal SGD on `gpt.loss` on one device with the whole batch, and its metrics are the one
    device's: the loss optimized, its cross-entropy and load-balancing loss, and the fraction of
    token-choices dropped over the whole batch. With accumulation the micro-batches' gradients
    and counts add up to the whole batch's (each sequence is routed on its own)."""
    k = accumulate_steps
    config = moe_job({"data": 2, "expert": 4}, zero_stage=zero_stage, accumulate_steps=k,
                     global_batch=8 * k)  # fmt: skip
    with mock.patch.object(gpt, "init", wide_init):  # the module the GPT job calls it on
        repl, step_fn, state, input_fn, _ = jobs.build(config)
    batches = iter(input_fn(repl.input_context()))
    batches = [jax.tree.map(np.asarray, next(batches)) for _ in range(3)]
    metrics = []
    for batch in batches:
        state, out = repl.run(step_fn, state, batch)
        metrics.append({k: float(np.asarray(v)[0]) for k, v in out.items()})
    want_params, want_metrics = oracle(config, batches)
    got = whole(state["job"]["params"])
    assert rel_err(got, want_params) <= TOL, rel_err(got, want_params)
    assert rel_err(got, wide_init(jobs.gpt_config(config), jax.random.key(0))) > 1e-3
    for m, w in zip(metrics, want_metrics, strict=True):
        assert {k: m[k] for k in w} == pytest.approx(w, rel=TOL), (m, w)
    assert all(0 < w["dropped_fraction"] < 1 for w in want_metrics), want_metrics


# -- the model keys ------------------------------------------------------------------------------


def test_the_context_and_moe_keys_reach_the_model():
    model = jobs.gpt_config(config_lib.load(MOE, [
        "model.moe_every=2", "model.capacity_factor=null", "model.aux_weight=0.1",
        "model.attention=all_to_all", "model.zigzag=false",
    ]))  # fmt: skip
    assert (model.num_experts, model.moe_every, model.top_k, model.capacity_factor) == (
        8,
        2,
        2,
        None,
    )
    assert (model.aux_weight, model.attention, model.zigzag) == (0.1, "all_to_all", False)
    long = jobs.gpt_config(config_lib.load(LONG))
    assert (long.seq_len, long.attention, long.zigzag, long.num_experts) == (1024, "ring", True, 0)
    dense = jobs.gpt_config(config_lib.load(DP))  # the GPT's own defaults
    fields = ("attention", "zigzag", "num_experts", "moe_every", "top_k", "capacity_factor",
              "aux_weight")  # fmt: skip
    assert {f: getattr(dense, f) for f in fields} == {
        f: getattr(gpt.GPTConfig(), f) for f in fields
    }


# -- refused when the config loads ---------------------------------------------------------------


@pytest.mark.parametrize(
    "path, overrides, words",
    [
        # for model.kind gpt only
        (CNN, ["mesh.context=2"], r"mesh\.context: model\.kind='cnn' has no context axis .*use "
         r"a mesh without 'context'"),
        (MLP, ["mesh.expert=2"], r"mesh\.expert: model\.kind='mlp' has no expert axis"),
        (CNN, ["model.experts=4"], r"model\.experts=4 is for model\.kind='gpt'"),
        (MLP, ["model.attention=all_to_all"], r"model\.attention='all_to_all' is for model\."
         r"kind='gpt'"),
        # the keys on their own
        (LONG, ["model.attention=flash"], r"model\.attention='flash' is not an attention .*"
         r"'ring', 'all_to_all'"),
        (MOE, ["model.experts=-1"], r"model\.experts must be an int >= 0; got -1"),
        (MOE, ["model.top_k=9"], r"model\.top_k=9 is more than experts=8 .*use top_k <= 8"),
        (MOE, ["model.moe_every=3"], r"model\.moe_every=3 does not divide layers=4 .*layers=6"),
        (MOE, ["model.capacity_factor=0"], r"model\.capacity_factor must be a finite number > 0 "
         r"or null; got 0"),
        (MOE, ["model.aux_weight=-1"], r"model\.aux_weight must be a finite number >= 0"),
        # a mixture of experts and the mesh
        (MOE, ["mesh={data: 2, stage: 2, expert: 2}", "pipeline={schedule: gpipe}"],
         r"model\.experts=8: the mixture-of-experts GPT has no pipeline layout.*use a mesh "
         r"without 'stage'"),
        (DP, ["mesh={data: 2, expert: 4}"], r"mesh\.expert=4 with model\.experts=0: a dense GPT "
         r"has no experts to split.*use mesh\.data for that"),
        (MOE, ["model.experts=6"], r"model\.experts=6 does not split over mesh\.expert=4 .*"
         r"model\.experts=8"),
        (MOE, ["global_batch=12"], r"global_batch=12 over 2 data replicas gives 6 sequences a "
         r"step, which do not split over mesh\.expert=4 .*global_batch=16"),
        (MOE, ["accumulate_steps=8"], r"global_batch=32 over 2 data replicas and "
         r"accumulate_steps=8 micro-batches gives 2 sequences a step, which do not split over "
         r"mesh\.expert=4 .*global_batch=64"),
        (MOE, ["mesh={data: 1, context: 2, expert: 4}"], r"mesh\.context=2 with mesh\.expert="
         r"4: a context axis and an expert axis together are not supported yet"),
        # the context axis
        (LONG, ["mesh={data: 2, stage: 2, context: 2}", "pipeline={schedule: 1f1b}"],
         r"model\.attention='ring' with mesh\.context=2 cannot run under pipeline\.schedule="
         r"'1f1b' .*use model\.attention=all_to_all, or pipeline\.schedule gpipe or circular"),
        (LONG, ["mesh={data: 2, stage: 2, context: 2}", "model.layers=8",
                "pipeline={schedule: interleaved, microbatches: 2}"],
         r"cannot run under pipeline\.schedule='interleaved'"),
        (LONG, ["mesh={data: 2, stage: 2, context: 2}", "pipeline={schedule: zerobubble}"],
         r"cannot run under pipeline\.schedule='zerobubble'"),
        (LONG, ["model.attention=all_to_all", "model.heads=2"], r"model\.attention='all_to_all'"
         r" splits the heads over mesh\.context=4, but heads=2 do not split 4 ways; use "
         r"model\.heads a multiple of 4"),
        (LONG, ["model.attention=all_to_all", "model.heads=4", "mesh={data: 1, context: 4, model: 2}"],
         r"but heads / mesh\.model = 2 do not split 4 ways; use model\.heads a multiple of 8"),
        (LONG, ["model.seq_len=510"], r"model\.seq_len=510 does not split into 2 x "
         r"mesh\.context = 8 chunks \(the zigzag layout of a ring\); use seq_len a multiple of 8 "
         r"\(e\.g\. model\.seq_len=512\)\.$"),
        (LONG, ["model.seq_len=516"], r"model\.seq_len=516 does not split into 2 x mesh\.context"
         r" = 8 chunks .*or model\.zigzag=false\.$"),
        (LONG, ["model.seq_len=514", "model.attention=all_to_all"], r"model\.seq_len=514 does "
         r"not split into mesh\.context=4 chunks; use seq_len a multiple of 4"),
    ],
)  # fmt: skip
def test_refused_when_the_config_loads_naming_the_key(path, overrides, words):
    with pytest.raises(ValueError, match=f"^{path}: .*{words}"):
        config_lib.load(path, overrides)


def test_what_the_new_axes_fit_is_allowed():
    """What is not refused: a ring under gpipe and circular, all-to-all under 1F1B, a zigzag
    ring off, the MoE keys of a dense model (ignored), an expert axis of size 1."""
    base = ["mesh={data: 2, stage: 2, context: 2}", "model.layers=4"]
    for schedule in ("gpipe", "circular"):
        config_lib.load(LONG, [*base, f"pipeline={{schedule: {schedule}, microbatches: 2}}"])
    config_lib.load(LONG, [*base, "pipeline={schedule: 1f1b}", "model.attention=all_to_all"])
    config_lib.load(LONG, ["model.seq_len=516", "model.zigzag=false"])
    config_lib.load(MOE, ["model.experts=0", "mesh={data: 8, expert: 1}"])


def test_a_refusal_is_one_line_for_train_and_explain(capsys, tmp_path):
    overrides = ["mesh={data: 2, stage: 2, context: 2}", "pipeline={schedule: 1f1b}",
                 f"out_dir={tmp_path}"]  # fmt: skip
    for command in ("train", "explain"):
        assert cli.main([command, str(LONG), *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"replicator {command}: {LONG}: model.attention='ring'"), err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "gpt_long").exists()  # refused before the run directory
