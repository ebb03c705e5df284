"""The GPT job of `replicator train` on every layout a planner writes: ZeRO 1-3 with pipelines
(and `model`), ZeRO-3 data and tensor parallel, each against the same job on one device; the
gpt-only model keys and what is refused; and the job built from shapes (`jobs.abstract_job`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
from unittest import mock

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from oracle import rel_err

import replicator as rp
from replicator import pipeline
from replicator.cli import config as config_lib
from replicator.cli import jobs
from replicator.cli.config import ModelConfig, PipelineConfig, TrainConfig
from replicator.cli.jobs.gpt_job import pipeline_schedule
from replicator.cli.optimizers import OptimizerConfig
from replicator.models import gpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
PIPE, MLP, CNN = (ROOT / "configs" / f"{n}.yaml" for n in ("lm_pipeline", "mlp_zero", "cnn_bn"))
STEPS = 3
TOL = 1e-5
OPTIMIZERS = {  # SGD with momentum: a state for ZeRO to shard, and no scale invariance
    "sgd": OptimizerConfig(name="sgd", learning_rate=0.1, momentum=0.9),
    "adam": OptimizerConfig(name="adam", learning_rate=1e-2),
}


def gpt_job(
    mesh, *, zero_stage=0, opt="sgd", schedule="1f1b", scatter_grads="microbatch", **model
) -> TrainConfig:
    """A tiny GPT job; no clipping (it would hide a gradient off by a factor)."""
    model = {"kind": "gpt", "d_model": 32, "layers": 4, "heads": 4, "seq_len": 16, **model}
    return TrainConfig(
        model=ModelConfig(**model),
        mesh=mesh,
        global_batch=16,
        steps=STEPS,
        optimizer=OPTIMIZERS[opt],
        clip_global_norm=None,
        zero_stage=zero_stage,
        pipeline=(
            PipelineConfig(schedule=schedule, microbatches=4, scatter_grads=scatter_grads)
            if "stage" in mesh
            else None
        ),
    )


def whole(tree):
    """ZeRO-3's ShardedParams as host arrays (each stored in its own shape)."""

    def unshard(x):
        return np.asarray(x.value if isinstance(x, rp.ShardedParam) else x)

    return jax.tree.map(unshard, tree, is_leaf=lambda x: isinstance(x, rp.ShardedParam))


def train(config: TrainConfig):
    """``STEPS`` steps of the CLI's job: its state, and the parameters in `gpt.init`'s layout."""
    repl, step_fn, state, input_fn, _ = jobs.build(config)
    batches = iter(input_fn(repl.input_context()))
    for _ in range(STEPS):
        state, _ = repl.run(step_fn, state, next(batches))
    params = whole(state["job"]["params"])
    if "stages" in params:  # [K, L/K, ...], or [V, K, L/(V K), ...] with virtual stages
        p = config.pipeline
        v = p.repeats if p.schedule in ("circular", "interleaved") else 1
        params = dict(params, blocks=pipeline.unstack_stages(params.pop("stages"), v))
    return state, params


def build_and_train(config: TrainConfig, devices: int | None = None):
    """`train`, on the first ``devices`` devices if given."""
    with contextlib.ExitStack() as stack:
        if config.optimizer.name == "adam":
            # Adam's first updates are lr * g / (|g| + eps): with eps=1e-8 a gradient entry
            # near zero turns float noise (a sum in another order) into a large change of the
            # update (measured: 1e-2 relative after one step, 8 devices against one). eps=1e-3
            # keeps it smooth, as in tests/test_gpt_tensor.py; scale errors still show.
            eps = functools.partial(optax.adam, eps=1e-3)
            stack.enter_context(mock.patch.object(optax, "adam", eps))
        if devices is not None:
            replicator = rp.Replicator
            one = lambda **kw: replicator(**kw, devices=jax.devices()[:devices])
            stack.enter_context(mock.patch.object(rp, "Replicator", one))
        return train(config)


@functools.cache
def one_device(opt: str):
    """The oracle: the same job on one device, data parallel with the whole batch."""
    return build_and_train(gpt_job({"data": 1}, opt=opt), devices=1)[1]


def sharded_over_data(x) -> bool:
    return "data" in str(x.sharding.spec)


def on_model(x) -> bool:
    """A vector split over `model` (a bias of heads or MLP units, after a layer axis)."""
    return "model" in str(x.sharding.spec) and sum(n > 1 for n in x.shape) <= 2 and x.ndim <= 2


@pytest.mark.parametrize(
    "mesh, zero_stage, opt, scatter_grads",
    [
        # (ZeRO-1 on {data 2, stage 4}: tests/test_zero_3d.py's engine, and here on 3 axes)
        ({"data": 2, "stage": 4}, 3, "sgd", "microbatch"),
        ({"data": 2, "stage": 4}, 3, "sgd", "step"),
        ({"data": 8}, 3, "sgd", "microbatch"),
        ({"data": 2, "stage": 2, "model": 2}, 1, "sgd", "microbatch"),
        ({"data": 4, "model": 2}, 3, "adam", "microbatch"),
    ],
)
@pytest.mark.slow
def test_the_gpt_job_under_zero_equals_one_device(mesh, zero_stage, opt, scatter_grads):
    """The pipelines run 1F1B; ZeRO-3 parameters are stored flat (each block's layers one by
    one) and gathered where used, with `model` too (and with pipeline.scatter_grads=step the
    stages' gradients summed whole and reduce-scattered once a step). Three steps equal one
    device, and the optimizer state (ZeRO-3: the parameters too) really is split over the
    replicas."""
    want = one_device(opt)
    job = gpt_job(mesh, zero_stage=zero_stage, opt=opt, scatter_grads=scatter_grads)
    state, got = build_and_train(job)
    err = rel_err(got, want)
    print(f"rel_err {err:.2e}")  # shown with pytest -s
    assert err <= TOL, err
    model = gpt.GPTConfig(vocab_size=256, seq_len=16, d_model=32, num_heads=4, num_layers=4)
    assert rel_err(got, gpt.init(model, jax.random.key(0))) > 1e-2  # training moved them
    # Every leaf is split over the replicas but the biases split over `model` (ZeRO splits an
    # axis that nothing else splits; a bias has one, and `model` has it).
    moments = [x for x in jax.tree.leaves(state["job"]["opt"]) if x.size > 1]
    assert moments and all(sharded_over_data(x) or on_model(x) for x in moments)
    assert sum(map(sharded_over_data, moments)) > len(moments) // 2
    params = jax.tree.leaves(
        state["job"]["params"], is_leaf=lambda x: isinstance(x, rp.ShardedParam)
    )
    if zero_stage == 3:
        assert all(isinstance(p, rp.ShardedParam) for p in params)
        assert all(sharded_over_data(p.value) or on_model(p.value) for p in params)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_the_gpt_job_over_slices_equals_one_device(zero_stage):
    """``{dcn_data 2, data 4}``: the slice axis emulated as an ordinary mesh axis on CPU (the
    replicas span both, ZeRO shards over both). Three SGD steps equal one device to 1e-5."""
    want = one_device("sgd")
    state, got = build_and_train(gpt_job({"dcn_data": 2, "data": 4}, zero_stage=zero_stage))
    assert rel_err(got, want) <= TOL
    if zero_stage:
        moments = [x for x in jax.tree.leaves(state["job"]["opt"]) if x.size > 1]
        assert all("dcn_data" in str(x.sharding.spec) for x in moments if sharded_over_data(x))


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_gradients_summed_in_bf16_below_zero3_are_within_bf16_of_one_device(zero_stage):
    """``model.reduce_dtype: bfloat16`` with ZeRO 0-2 sends the gradients' all-reduce (ZeRO-1
    and 2: reduce-scatter) over ``{dcn_data 2, data 4}`` in bf16: three SGD steps within
    bf16's rounding of one device (1e-2; bf16 keeps 8 bits), and not its fp32 result: the
    option is in effect, not ignored."""
    want = one_device("sgd")
    job = gpt_job({"dcn_data": 2, "data": 4}, zero_stage=zero_stage, reduce_dtype="bfloat16")
    if zero_stage == 2:
        job = dataclasses.replace(job, accumulate_steps=2)
    _, got = build_and_train(job)
    err = rel_err(got, want)
    assert 1e-6 < err <= 1e-2, err


@pytest.mark.slow
def test_the_gpt_job_under_interleaved_1f1b_equals_one_device():
    """Interleaved 1F1B on {data: 2, stage: 4} with V=2 virtual stages per device (8 blocks, one
    per logical stage; M=4 micro-batches, a multiple of K) and ZeRO-1: three steps equal the
    8-block GPT on one device, and the stage blocks [V, K, 1, ...] are split over `stage`."""
    want = build_and_train(gpt_job({"data": 1}, layers=8), devices=1)[1]
    mesh = {"data": 2, "stage": 4}
    state, got = build_and_train(gpt_job(mesh, zero_stage=1, schedule="interleaved", layers=8))
    err = rel_err(got, want)
    print(f"rel_err {err:.2e}")  # shown with pytest -s
    assert err <= TOL, err
    model = gpt.GPTConfig(vocab_size=256, seq_len=16, d_model=32, num_heads=4, num_layers=8)
    assert rel_err(got, gpt.init(model, jax.random.key(0))) > 1e-2  # training moved them
    qkv = state["job"]["params"]["stages"]["attn"]["qkv"]
    assert qkv.shape == (2, 4, 1, 32, 96) and qkv.sharding.spec[:2] == (None, "stage")


def test_the_config_takes_interleaved_1f1b_with_its_repeats():
    """pipeline.schedule=interleaved builds Interleaved1F1B(repeats=pipeline.repeats), whose
    stage blocks are [V, K, L/(V K), ...]; the job is refused before anything is traced when
    the micro-batches are not a multiple of the stage axis (the library's message, then the
    config keys) or the layers do not split into K x V stages."""
    keys = ["pipeline.schedule=interleaved", "model.layers=16", "pipeline.microbatches=8"]
    config = config_lib.load(PIPE, [*keys, "pipeline.repeats=4"])
    assert pipeline_schedule(config) == pipeline.Interleaved1F1B(repeats=4)
    _, _, state, _ = jobs.abstract_job(config)
    assert state["job"]["params"]["stages"]["attn"]["qkv"].shape == (4, 4, 1, 64, 192)
    with pytest.raises(
        ValueError,
        match=r"^Interleaved1F1B\.timetable: num_microbatches must be a multiple of num_stages .*got "
        r"num_microbatches=6 with num_stages=4\. Use num_microbatches=8, or OneFOneB\(\)\. In "
        r"the config: pipeline\.microbatches=6 with mesh\.stage=4 and pipeline\.schedule="
        r"interleaved\.$",
    ):
        jobs.abstract_job(config_lib.load(PIPE, [*keys, "pipeline.microbatches=6"]))
    with pytest.raises(ValueError, match=r"stack_stages: 4 layers do not split into num_stages=4 "
                       r"x repeats=2 = 8 equal stages; use a multiple of 8 layers"):  # fmt: skip
        jobs.abstract_job(config_lib.load(PIPE, ["pipeline.schedule=interleaved"]))


# -- refused when the config loads --------------------------------------------------------------


@pytest.mark.parametrize(
    "path, overrides, words",
    [
        (PIPE, ["accumulate_steps=2"],
         r"accumulate_steps=2 does not apply to a pipeline .*use pipeline\.microbatches instead "
         r"\(e\.g\. pipeline\.microbatches=8\)"),
        (PIPE, ["model.vocab=100"],
         r"model\.vocab=100 is smaller than the built-in text's 256 byte tokens.*use "
         r"model\.vocab >= 256, or data\.path with data\.tokenizer"),
        (PIPE, ["model.dtype=float16"], r"model\.dtype='float16' is not a compute dtype.*bfloat16"),
        (PIPE, ["model.remat=1"], r"model\.remat: expected bool; got 1"),
        (PIPE, ["pipeline.schedule=interleaved", "pipeline.repeats=1"],
         r"pipeline\.repeats=1: schedule='interleaved' needs 2 or more virtual stages per "
         r"device; use repeats=2 .*or schedule='1f1b'"),
        (PIPE, ["pipeline.scatter_grads=step"],
         r"pipeline\.scatter_grads='step' is when ZeRO-3 reduce-scatters the pipeline stages' "
         r"gradients; "
         r"with zero_stage=0 it would change nothing\. Use zero_stage=3"),
        (PIPE, ["pipeline.schedule=interleave"],
         r"pipeline\.schedule='interleave' is not a schedule; use one of .*'interleaved'.* Did "
         r"you mean 'interleaved'\?"),
        (PIPE, ["mesh.stage=2", "mesh.data=2", "mesh.model=2", "model.d_ff=65"],
         r"model\.d_ff=65 does not split over mesh\.model=2.*\(e\.g\. d_ff=66\)"),
        (MLP, ["model.vocab=512"], r"model\.vocab=512 is for model\.kind='gpt'; model\.kind='mlp'"),
        (MLP, ["model.remat=true"], r"model\.remat=True is for model\.kind='gpt'"),
        (CNN, ["model.d_ff=64"], r"model\.d_ff=64 is for model\.kind='gpt'; model\.kind='cnn'"),
        (CNN, ["model.dtype=bfloat16"], r"model\.dtype='bfloat16' is for model\.kind='gpt'"),
    ],
)  # fmt: skip
def test_refused_when_the_config_loads_naming_the_key(path, overrides, words):
    with pytest.raises(ValueError, match=f"^{path}: .*{words}"):
        config_lib.load(path, overrides)


def test_the_gpt_keys_reach_the_model():
    c = config_lib.load(
        PIPE, ["model.vocab=512", "model.d_ff=96", "model.dtype=bfloat16", "model.remat=true"]
    )
    model = jobs.gpt_config(c)
    assert (model.vocab_size, model.hidden, model.dtype, model.remat) == (
        512, 96, np.dtype("bfloat16"), True,
    )  # fmt: skip
    default = jobs.gpt_config(config_lib.load(PIPE))  # the shipped config recomputes
    assert (default.vocab_size, default.hidden, default.dtype, default.remat) == (
        256, 256, np.dtype("float32"), "full",
    )  # fmt: skip


# -- built from shapes --------------------------------------------------------------------------


def figures(report: rp.StepReport) -> dict:
    data = json.loads(report.to_json())
    del data["compile_seconds"], data["step"]
    return data


@pytest.mark.parametrize(
    "mesh, zero_stage, ema_decay",
    [({"data": 8}, 3, 0.9), ({"data": 4, "stage": 2}, 1, None)],
)
@pytest.mark.slow
def test_explain_of_the_job_from_shapes_equals_explain_of_the_built_job(
    mesh, zero_stage, ema_decay
):
    """The state from shapes (ZeRO-3's flat parameters, the EMA sharded as they are, the step
    counter; a pipeline's stage blocks with ZeRO-1's state) compiles to the same step."""
    optimizer = OptimizerConfig(ema_decay=ema_decay)
    config = dataclasses.replace(gpt_job(mesh, zero_stage=zero_stage), optimizer=optimizer)
    repl, step_fn, state, batch = jobs.abstract_job(config)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    assert set(state) == {"job", "step"} | ({"ema"} if ema_decay else set())
    assert batch == {k: jax.ShapeDtypeStruct((16, 16), np.int32) for k in ("tokens", "targets")}
    assert figures(repl.explain(step_fn, state, batch)) == figures(jobs.explain(config))


@pytest.mark.parametrize(
    "schedule, remat",
    [
        ("gpipe", False),
        ("gpipe", True),
        ("circular", True),
        ("1f1b", False),
        ("1f1b", "dots"),
        ("zerobubble", "full"),
        ("interleaved", "dots"),
    ],
)
def test_model_remat_is_the_pipeline_engines_for_every_schedule(schedule, remat):
    """model.remat reaches rp.pipeline.value_and_grad as it is, whatever the schedule
    (tests/test_pipeline.py: each policy against the sequential model)."""
    calls = []
    value_and_grad = pipeline.value_and_grad

    def spy(*args, **kwargs):
        calls.append(kwargs["remat"])
        return value_and_grad(*args, **kwargs)

    with mock.patch.object(pipeline, "value_and_grad", spy):
        jobs.abstract_job(gpt_job({"data": 4, "stage": 2}, schedule=schedule, remat=remat))
    assert calls == [remat]


def test_a_big_gpt_is_built_from_shapes_allocating_nothing():
    """2e9 parameters (8 GB, 24 GB with Adam's moments) with ZeRO-3 over {data: 2, model: 4}:
    every leaf a shape with its sharding, and no device memory taken."""
    config = TrainConfig(
        model=ModelConfig(kind="gpt", d_model=4096, layers=8, heads=32, seq_len=2048, vocab=51200),
        mesh={"data": 2, "model": 4},
        global_batch=16,
        zero_stage=3,
    )
    before = sum(x.nbytes for x in jax.live_arrays())
    repl, _, state, batch = jobs.abstract_job(config)
    assert sum(x.nbytes for x in jax.live_arrays()) - before < 2**20
    params = state["job"]["params"]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    assert sum(x.size for x in jax.tree.leaves(params)) > 2e9
    qkv = params["blocks"]["attn"]["qkv"].value  # its own shape: rows over data, heads over model
    assert qkv.shape == (8, 4096, 3 * 4096) and qkv.sharding.spec == P(None, "data", "model")
    assert batch["tokens"].shape == (16, 2048)
    assert repl.mesh.shape == {"data": 2, "model": 4}


def test_an_own_job_is_not_built_from_shapes():
    config = TrainConfig(model=ModelConfig(kind="my_models:job"))
    with pytest.raises(ValueError, match=r"abstract_job: model\.kind='my_models:job' is your own"):
        jobs.abstract_job(config)


@pytest.mark.slow  # 3 compiles, 5-8 s
def test_vocab_parallel_computes_each_logit_once():
    """``model.vocab_parallel`` (the default) splits the token table by rows and the output
    matrix by columns over ``model``: {data: 4, model: 2} then does the matmul FLOPs of
    {data: 8} per device (each logit computed once), where keeping them whole computes every
    logit on both ``model`` devices. On a ``context`` axis they stay whole (XLA's partitioner
    aborts on that split there)."""

    def compiled(mesh, **model):
        repl, step_fn, state, batch = jobs.abstract_job(gpt_job(mesh, **model))
        params = state["job"]["params"]
        specs = (params["embed"]["tokens"].sharding.spec, params["head"]["w"].sharding.spec)
        return specs, repl.explain(step_fn, state, batch).matmul_flops

    tp = {"data": 4, "model": 2}
    (split, flops), (whole_specs, whole_flops) = compiled(tp), compiled(tp, vocab_parallel=False)
    assert split == (P("model"), P(None, "model")), split
    assert whole_specs == (P(), P()), whole_specs
    ideal = compiled({"data": 8})[1]
    assert flops == ideal < whole_flops, (flops, ideal, whole_flops)
    head = 16 // 4 * 16 * 2 * 32 * 256 * 3  # tokens x (forward + 2 backward) x D x V, per device
    assert whole_flops - flops == head // 2, (whole_flops - flops, head)
    config = gpt_job({"data": 2, "context": 2, "model": 2}, attention="all_to_all")
    state = jobs.abstract_job(config)[2]
    assert state["job"]["params"]["embed"]["tokens"].sharding.spec == P()


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_gradients_in_bf16_with_a_model_axis_are_refused_on_xla_cpu(zero_stage):
    """XLA:CPU's compiler ends the process on a bf16 all-reduce of the leaves kept whole over
    ``model``: ``model.reduce_dtype: bfloat16`` below ZeRO-3 with a ``model`` axis is refused
    while the step is traced, naming the fixes, before anything compiles."""
    job = gpt_job({"data": 4, "model": 2}, zero_stage=zero_stage, reduce_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"grad_dtype=bfloat16\) with a 'model' axis aborts "
                       r"XLA:CPU's compiler; on the CPU send the gradients in fp32"):  # fmt: skip
        build_and_train(job)
