"""Jobs for rp.plan's tests, importable by its worker processes: fake compiled programs with
chosen peaks (to test the search), and the GPT built from shapes for any layout (a long-sequence
GPT for context axes, a mixture-of-experts GPT for expert axes); `ladders`, the layouts of a
model from the option records' fields."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import optax

import replicator as rp
from replicator import pipeline
from replicator.models import gpt

COMPILED: list = []  # the layouts fake_build's Replicator compiled, in order (this process)


class _FakeReplicator:
    """Compiles nothing: its report's peak is 1000 / accumulate_steps, plus 500 without remat;
    remat costs a third more FLOPs, and each accumulation step 1% more."""

    def __init__(self, layout: rp.planner.Layout):
        self.layout = layout
        self.mesh = types.SimpleNamespace(shape=layout.mesh_shape)

    def explain(self, step_fn, state, *args, stage_costs=True):
        lay = self.layout
        COMPILED.append(lay)
        peak = 1000 // lay.accumulate_steps + (0 if lay.remat else 500)
        memory = types.SimpleNamespace(
            arguments=100, outputs=100, aliased=100, temporaries=peak - 100, peak=peak
        )
        flops = 1e9 * (4 / 3 if lay.remat else 1) * (1 + 0.01 * lay.accumulate_steps)
        return types.SimpleNamespace(
            mesh=lay.mesh_shape, memory=memory, flops=flops, collectives=(), pipelines=(),
            compile_seconds=0.0,
        )  # fmt: skip


def fake_build(layout: rp.planner.Layout):
    state = {"w": jax.ShapeDtypeStruct((25,), jnp.float32)}  # 100 bytes, on every device
    return _FakeReplicator(layout), None, state


def refusing_build(layout: rp.planner.Layout):
    raise ValueError("no such layout here")


CONFIG = gpt.GPTConfig(vocab_size=256, seq_len=16, d_model=32, num_heads=4, num_layers=4)
BATCH = 16
# For context layouts given by hand (128 tokens: shorter than enumerate_layouts would split,
# and twice as quick to compile as 512).
CONTEXT = gpt.GPTConfig(vocab_size=256, seq_len=128, d_model=32, num_heads=4, num_layers=2)
CONTEXT_BATCH = 8
MOE = gpt.GPTConfig(vocab_size=256, seq_len=16, d_model=32, num_heads=4, num_layers=2,
                    num_experts=4)  # fmt: skip


def gpt_build(layout: rp.planner.Layout, config: gpt.GPTConfig = CONFIG, batch_size: int = BATCH):
    """The GPT's Adam step for ``layout`` (data, model, context with its attention, expert,
    ZeRO, accumulation; pipelines with their schedule), its state from shapes and its batch as
    shapes."""
    if layout.attention is not None:
        config = dataclasses.replace(config, attention=layout.attention)
    repl = rp.Replicator(mesh_shape=layout.mesh_shape)
    batch = jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32)
    batch = {"tokens": batch, "targets": batch}
    if layout.stage == 1:
        opt = repl.wrap_optimizer(
            optax.adam(1e-3), zero_stage=layout.zero_stage, accumulate_steps=layout.accumulate_steps
        )

        def init():
            params = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
            if layout.zero_stage == 3:  # stored sharded, gathered layer by layer
                params = opt.shard_params(params, stacked=["blocks"])
            return {"params": params, "opt": opt.init(params)}

        def loss_fn(params, b):
            return gpt.loss(params, b["tokens"], b["targets"], config=config)

        def step(state, b):
            params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], b)
            return {"params": params, "opt": opt_state}, metrics

        return repl, step, repl.abstract(init), batch
    schedule = {
        "gpipe": pipeline.GPipe,
        "1f1b": pipeline.OneFOneB,
        "zerobubble": pipeline.ZeroBubble,
        "circular": lambda: pipeline.Circular(repeats=layout.repeats),
        "interleaved": lambda: pipeline.Interleaved1F1B(repeats=layout.repeats),
    }[layout.schedule]()
    tx = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=layout.zero_stage)
    grad_fn = gpt.pipeline_value_and_grad(
        config, num_microbatches=layout.microbatches, schedule=schedule
    )

    def init():
        params = gpt.init(config, jax.random.key(0))
        placed = gpt.place_pipeline(
            repl, params, num_stages=layout.stage, repeats=schedule.repeats, config=config
        )
        if layout.zero_stage == 3:
            placed = tx.shard_params(placed)
        return {"params": placed, "opt": tx.init(placed)}

    def pipeline_step(state, b):
        loss, grads = grad_fn(state["params"], b)
        updates, opt_state = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt_state}, {"loss": rp.all_reduce(loss, "mean")}

    return repl, pipeline_step, repl.abstract(init), batch


context_gpt_build = functools.partial(gpt_build, config=CONTEXT, batch_size=CONTEXT_BATCH)
moe_gpt_build = functools.partial(gpt_build, config=MOE, batch_size=BATCH)


def crashing_build(layout: rp.planner.Layout):
    """fake_build, except that the process dies on the layout with 4 replicas and ZeRO-0 (as a
    check failure in XLA's compiler would end it)."""
    if layout.data == 4 and layout.zero_stage == 0:
        import os

        os._exit(7)
    return fake_build(layout)


def slow_build(layout: rp.planner.Layout):
    """fake_build, except that a layout with a ``model`` axis of 2 takes 10 minutes to build (a
    compile the planner should stop)."""
    if layout.model == 2:
        import time

        time.sleep(600)
    return fake_build(layout)


def ladders(n: int, **fields) -> list:
    """`rp.planner.enumerate_layouts` of ``n`` devices, each keyword put in the record that has
    it (`ModelSizes`, `SearchOptions` or `AxisLimits`)."""
    planner = rp.planner
    records = {}
    for name, cls in (("sizes", planner.ModelSizes), ("search", planner.SearchOptions),
                      ("limits", planner.AxisLimits)):  # fmt: skip
        mine = {f.name for f in dataclasses.fields(cls)} & set(fields)
        if mine or name == "sizes":
            records[name] = cls(**{key: fields.pop(key) for key in mine})
    assert not fields, f"no record has {sorted(fields)}"
    return planner.enumerate_layouts(n, **records)
