"""repl.explain: the report's numbers against what the step must cost, worked out by hand.

Collective bytes: data parallelism moves the gradient, ZeRO stage 0-2 moves 2 Psi and stage 3
moves 3 Psi words, a pipeline moves one micro-batch's activation per tick each way. Memory: the
arguments are this device's shards of the state and the batch. FLOPs: the matmuls of the model,
counted per loop trip (which XLA's cost_analysis does not do).
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator import pipeline
from replicator._src.report import hlo
from replicator._src.report.cost_model import CollectiveCost, CompiledStep, model_time

D_IN, HIDDEN, D_OUT, BATCH = 16, 64, 4, 64


def mlp():
    rng = np.random.default_rng(0)
    return {
        "w1": rng.normal(size=(D_IN, HIDDEN)).astype(np.float32),
        "w2": rng.normal(size=(HIDDEN, D_OUT)).astype(np.float32),
    }


def mlp_loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def batch(n=BATCH):
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(n, D_IN)).astype(np.float32),
        "y": rng.normal(size=(n, D_OUT)).astype(np.float32),
    }


def dp_step(opt):
    def step(state, batch):
        params, opt_state, metrics = opt.step(mlp_loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    return step


def shard_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def mlp_matmul_flops(rows: int) -> int:
    """Forward x@w1, h@w2; backward dw2, dh, dw1 (no dx): 2 FLOPs per multiply-add."""
    return 2 * rows * (2 * D_IN * HIDDEN + 3 * HIDDEN * D_OUT)


@pytest.mark.parametrize(
    "mesh_shape, lowering",
    [({"data": 8}, "shard_map"), ({"dcn_data": 2, "data": 4}, "shard_map"), ({"data": 8}, "pmap")],
)
def test_data_parallel_moves_the_gradient_and_holds_its_shards(mesh_shape, lowering):
    repl = rp.Replicator(mesh_shape=mesh_shape, lowering=lowering)
    opt = repl.wrap_optimizer(optax.sgd(0.1), clip_global_norm=None)
    params = repl.replicate(mlp())
    state = {"params": params, "opt": opt.init(params)}
    report = repl.explain(dp_step(opt), state, batch())

    grad_bytes = 4 * (D_IN * HIDDEN + HIDDEN * D_OUT)
    axes = tuple(mesh_shape)
    reduce = [c for c in report.collectives if c.kind == "all-reduce"]
    assert {c.axes for c in reduce} == {axes}
    # The gradient, plus the 4-byte loss (XLA may combine both into one all-reduce).
    assert grad_bytes <= report.bytes_by(kind="all-reduce") <= grad_bytes + 16
    assert report.collective_bytes == report.bytes_by(kind="all-reduce")
    n = repl.num_replicas
    assert report.wire_bytes == pytest.approx(2 * (n - 1) / n * report.collective_bytes)

    rows = BATCH // n
    batch_bytes = 4 * rows * (D_IN + D_OUT)
    assert report.memory.arguments == shard_bytes(state) + batch_bytes
    assert report.memory.aliased == shard_bytes(state)  # the donated state is reused
    assert report.memory.outputs >= shard_bytes(state) + 4  # + this device's loss
    assert report.matmul_flops == mlp_matmul_flops(rows)
    # Without loops, the element-wise FLOPs are counted as XLA counts them.
    assert report.flops == pytest.approx(report.xla_flops, rel=0.05)
    assert report.mesh == mesh_shape and report.num_devices == 8 and report.unknown_trip_counts == 0


def test_loops_count_once_per_trip():
    """Gradient accumulation runs the model in a 4-trip scan: the same matmuls in all, which
    cost_analysis counts once."""
    repl = rp.Replicator()
    reports = {}
    for k in (1, 4):
        opt = repl.wrap_optimizer(optax.sgd(0.1), accumulate_steps=k, clip_global_norm=None)
        params = repl.replicate(mlp())
        reports[k] = repl.explain(
            dp_step(opt), {"params": params, "opt": opt.init(params)}, batch()
        )
    assert reports[4].matmul_flops == reports[1].matmul_flops == mlp_matmul_flops(BATCH // 8)
    assert reports[4].xla_flops < 0.5 * reports[1].xla_flops  # the loop body counted once
    assert reports[4].bytes_by(kind="all-reduce") == reports[1].bytes_by(kind="all-reduce")


WIDTH, LAYERS = 64, 4  # every leaf splits evenly over 8: no padding in the ZeRO layouts


def zero_params():
    rng = np.random.default_rng(2)
    return {
        "layers": {
            "w": (rng.normal(size=(LAYERS, WIDTH, WIDTH)) / 8).astype(np.float32),
            "b": np.zeros((LAYERS, WIDTH), np.float32),
        },
        "head": {"w": (rng.normal(size=(WIDTH, 8)) / 8).astype(np.float32)},
    }


@jax.checkpoint  # ZeRO-3 gathers each layer again in the backward pass
def zero_layer(h, p):
    p = rp.gather_params(p)
    return h + jnp.tanh(h @ p["w"] + p["b"]), None


def zero_loss(params, batch):
    h, _ = jax.lax.scan(zero_layer, batch["x"], params["layers"])
    return jnp.mean((h @ rp.gather_params(params["head"])["w"] - batch["y"]) ** 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_move_what_the_paper_says(stage):
    """ZeRO (Rajbhandari et al.): stages 0-2 move 2 Psi per step (all-reduce = reduce-scatter +
    all-gather), stage 3 moves 3 Psi (parameters gathered forward and backward, gradients
    reduce-scattered) for the scanned layers. The head's forward and backward gathers are the
    same instruction outside any loop, which XLA computes once: 2 Psi_head. Per-device state: 16 Psi, 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N, 16 Psi/N
    bytes (Adam, fp32; the gradient is a temporary here, so arguments hold params + state)."""
    repl = rp.Replicator()
    n = repl.num_replicas
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=stage, clip_global_norm=None)
    params = zero_params()
    psi = sum(x.size for x in jax.tree.leaves(params))
    psi_head = params["head"]["w"].size
    placed = opt.shard_params(params, stacked=["layers"]) if stage == 3 else repl.replicate(params)
    state = {"params": placed, "opt": opt.init(placed)}
    rng = np.random.default_rng(3)
    data = {"x": rng.normal(size=(8 * n, WIDTH)).astype(np.float32)}
    data["y"] = rng.normal(size=(8 * n, 8)).astype(np.float32)

    def step(state, batch):
        params, opt_state, metrics = opt.step(zero_loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    report = repl.explain(step, state, data)
    big = [c for c in report.collectives if c.bytes > 64]  # leave out the loss and norms
    assert {c.axes for c in big} == {("data",)}
    volume = sum((2 if c.kind == "all-reduce" else 1) * c.total_bytes for c in big)
    formula = 3 * 4 * (psi - psi_head) + 2 * 4 * psi_head if stage == 3 else 2 * 4 * psi
    # Exactly the formula, up to the loss and norm scalars XLA may combine into the same op.
    assert 0 <= volume - formula <= 64
    kinds = {c.kind for c in big}
    assert kinds == ({"all-reduce"} if stage == 0 else {"reduce-scatter", "all-gather"})
    if stage == 3:  # layers gathered twice (forward, and in the rematerialised backward)
        assert report.bytes_by(kind="all-gather") == 2 * 4 * (psi - psi_head) + 4 * psi_head
        assert report.bytes_by(kind="reduce-scatter") == 4 * psi
    params_and_state = {0: 12 * psi, 1: 4 * psi + 8 * psi // n, 2: 4 * psi + 8 * psi // n}
    expected = params_and_state.get(stage, 12 * psi // n)
    adam_count = 4  # Adam's step counter, an int32 on every device
    batch_bytes = 4 * 8 * (WIDTH + 8)
    assert report.memory.arguments == expected + adam_count + batch_bytes
    assert report.memory.arguments == shard_bytes(state) + batch_bytes


SCHEDULES = {
    "gpipe": pipeline.GPipe(),
    "circular": pipeline.Circular(repeats=2),
    "1f1b": pipeline.OneFOneB(),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pipeline_moves_one_activation_per_tick_each_way(name):
    k, d, m, w, layers, global_batch = 4, 2, 4, 16, 8, 32
    schedule = SCHEDULES[name]
    repl = rp.Replicator(mesh_shape={"data": d, "stage": k})
    rng = np.random.default_rng(4)
    stack = {
        "w": (rng.normal(size=(layers, w, w)) / 4).astype(np.float32),
        "b": rng.normal(size=(layers, w)).astype(np.float32),
    }
    head = rng.normal(size=(w, 2)).astype(np.float32)  # 2 outputs: a 1-wide dot is a multiply
    x = rng.normal(size=(global_batch, w)).astype(np.float32)
    grad_fn = pipeline.value_and_grad(
        pipeline.scan_layers(lambda p, h: jnp.tanh(h @ p["w"] + p["b"])),
        lambda head, y, t: jnp.mean((y @ head - t) ** 2),
        num_microbatches=m,
        schedule=schedule,
    )

    def step(state, x, t):
        loss, (g_stages, _, g_head) = grad_fn(state["stages"], x, t, state["head"])
        new = {
            "stages": jax.tree.map(lambda a, g: a - 0.1 * g, state["stages"], g_stages),
            "head": state["head"] - 0.1 * rp.all_reduce(g_head, "mean"),
        }
        return new, {"loss": rp.all_reduce(loss, "mean")}

    v = schedule.repeats
    state = {
        "stages": repl.place(
            pipeline.stack_stages(stack, num_stages=k, repeats=v), pipeline.stage_spec(v)
        ),
        "head": repl.replicate(head),
    }
    report = repl.explain(step, state, x, x[:, :2])

    plan = schedule.timetable(k, m)
    (note,) = report.pipelines
    mb = global_batch // d // m  # rows of one micro-batch on one device
    assert note.activation_bytes == 4 * mb * w
    assert (note.schedule, note.num_stages, note.num_microbatches, note.ticks) == (
        name, k, m, plan.num_ticks,
    )  # fmt: skip
    assert note.bubble_fraction == pytest.approx(plan.bubble_fraction())
    assert note.picture == pipeline.render(plan, width=100)
    shifts = [c for c in report.collectives if c.kind == "collective-permute"]
    assert {c.axes for c in shifts} == {("stage",)}
    # Activations forward and cotangents backward: one micro-batch each way per tick.
    assert report.bytes_by(kind="collective-permute") == 2 * plan.num_ticks * 4 * mb * w
    assert sum(c.count for c in shifts) == note.sends_per_step == 2 * plan.num_ticks

    # Matmuls on one device: a layer is 2*mb*w*w FLOPs forward; its backward recomputes it
    # and takes two more (weights, input). GPipe and Circular compute through their bubbles
    # (T ticks of Lv layers), 1F1B runs only its M busy ticks each way; the last stage's head
    # runs M times forward (2*mb*w*2) and backward (two more).
    lv = layers // (k * v)
    per_layer = 2 * mb * w * w
    busy = m * v if name == "1f1b" else plan.num_ticks
    head_flops = m * 3 * 2 * mb * w * 2
    assert report.matmul_flops == busy * lv * 4 * per_layer + head_flops
    assert report.xla_flops < report.matmul_flops  # cost_analysis: loop bodies once


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_pipeline_apply_notes_the_forward_plan_it_runs(name):
    k, m, w, global_batch = 4, 4, 16, 32
    schedule = SCHEDULES[name]
    runs = pipeline.GPipe() if name == "1f1b" else schedule  # apply runs 1F1B's forward: GPipe's
    repl = rp.Replicator(mesh_shape={"stage": k, "data": 2})
    rng = np.random.default_rng(5)
    stack = (rng.normal(size=(2 * k * schedule.repeats, w, w)) / 4).astype(np.float32)
    x = rng.normal(size=(global_batch, w)).astype(np.float32)
    f = pipeline.apply(
        pipeline.scan_layers(lambda p, h: jnp.tanh(h @ p)), num_microbatches=m, schedule=schedule
    )
    stages = pipeline.stack_stages(stack, num_stages=k, repeats=schedule.repeats)
    report = repl.explain(
        lambda s, x: (s, {"y": f(s, x)}),
        repl.place(stages, pipeline.stage_spec(schedule.repeats)),
        x,
    )

    plan = runs.timetable(k, m)
    (note,) = report.pipelines
    assert (note.schedule, note.repeats, note.ticks, note.sends_per_step) == (
        runs.name, runs.repeats, plan.num_ticks, plan.num_ticks,
    )  # fmt: skip
    assert note.bubble_fraction == pytest.approx(plan.bubble_fraction())
    assert note.picture == pipeline.render(plan, width=100)
    # The compiled program agrees: forward only, one activation shift per tick.
    shifts = [c for c in report.collectives if c.kind == "collective-permute"]
    assert sum(c.count for c in shifts) == note.sends_per_step


def linear(w, h):
    return h @ w


@pytest.mark.parametrize("name", ["1f1b", "zerobubble"])
def test_pipeline_step_time_is_modelled_from_the_stages_flops(name):
    # Linear layers: XLA drops the recompute (nothing needs it), so per layer F, B (dx) and W
    # (dw) are one matmul each, 2*mb*w*w FLOPs, and the fused backward two.
    k, d, m, w, layers, global_batch = 4, 2, 4, 16, 8, 32
    repl = rp.Replicator(mesh_shape={"data": d, "stage": k})
    rng = np.random.default_rng(6)
    stack = (rng.normal(size=(layers, w, w)) / 4).astype(np.float32)
    x = rng.normal(size=(global_batch, w)).astype(np.float32)
    schedule = pipeline.OneFOneB() if name == "1f1b" else pipeline.ZeroBubble()
    grad_fn = pipeline.value_and_grad(
        pipeline.scan_layers(linear), lambda _, y, t: jnp.mean((y - t) ** 2),
        num_microbatches=m, schedule=schedule,
    )  # fmt: skip

    def step(stages, x, t):
        loss, (g, _, _) = grad_fn(stages, x, t)
        return jax.tree.map(lambda a, g: a - 0.1 * g, stages, g), {"loss": loss}

    stages = repl.place(pipeline.stack_stages(stack, num_stages=k), pipeline.stage_spec())
    report = repl.explain(step, stages, x, x)

    (note,) = report.pipelines
    plan = schedule.timetable(k, m)
    mb, lv = global_batch // d // m, layers // k
    one = lv * 2 * mb * w * w  # one stage's pass on one micro-batch
    want_costs = pipeline.StageCosts(
        forward=(one,) * k, backward_input=(one,) * k, backward_weight=(one,) * k,
        backward=(2 * one,) * k, unit="flops",
    )  # fmt: skip
    want = pipeline.step_time(plan, want_costs)
    assert note.stage_costs == want_costs and note.cost_note == ""
    assert (note.cost_unit, note.modelled_time) == ("flops", want.time)
    assert note.modelled_bubble == pytest.approx(want.bubble_fraction)
    assert note.dataflow_time == want.dataflow_time <= want.time
    equal = pipeline.step_time(plan)
    assert (note.equal_time, note.equal_bubble) == (equal.time, equal.bubble_fraction)
    assert note.bubble_fraction == pytest.approx(plan.bubble_fraction())
    # Equal layers on every stage: the measured costs keep the equal-cost bubble.
    assert note.modelled_bubble == pytest.approx(note.equal_bubble)
    text = " ".join(str(report).split())
    assert (
        f"modelled step on {k} parallel devices in lock-step ticks: {want.time:.4g} FLOPs" in text
    )
    assert f"{want.dataflow_time:.4g} FLOPs without tick barriers" in text
    assert f"F {one:.3g} {one:.3g} {one:.3g} {one:.3g}" in text
    assert json.loads(report.to_json())["pipelines"][0]["stage_costs"]["forward"] == [one] * k


def test_pipeline_of_unequal_stages_models_their_measured_bubble():
    # Stage 0 runs x @ [4, 8], then two [8, 8] layers as one scan_layers run (stages_from_layers
    # makes it a chain of runs); stage 1 runs x @ [8, 2]. Linear: F = B = W, the backward 2 F.
    rng = np.random.default_rng(7)
    shapes = [(4, 8), (8, 8), (8, 8), (8, 2)]
    layer_params = [(rng.normal(size=s) / 2).astype(np.float32) for s in shapes]
    fns, params = pipeline.stages_from_layers(linear, layer_params, (3, 1))
    model = pipeline.sequential(fns, params)
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 2}, devices=jax.devices()[:4])
    f = pipeline.value_and_grad(
        model, lambda _, y, t: jnp.mean((y - t) ** 2), num_microbatches=2, schedule="1f1b"
    )

    def step(packed, x, t):
        loss, (g, _, _) = f(packed, x, t)
        return jax.tree.map(lambda a, g: a - 0.1 * g, packed, g), {"loss": loss}

    x = rng.normal(size=(16, 4)).astype(np.float32)
    t = rng.normal(size=(16, 2)).astype(np.float32)
    report = repl.explain(step, repl.place(model.pack(params), pipeline.stage_spec()), x, t)

    (note,) = report.pipelines
    mb = 16 // 2 // 2
    f0, f1 = 2 * mb * 4 * 8 + 2 * (2 * mb * 8 * 8), 2 * mb * 8 * 2
    want_costs = pipeline.StageCosts(
        forward=(f0, f1), backward_input=(f0, f1), backward_weight=(f0, f1),
        backward=(2 * f0, 2 * f1), unit="flops",
    )  # fmt: skip
    assert note.stage_costs == want_costs
    want = pipeline.step_time(pipeline.OneFOneB().timetable(2, 2), want_costs)
    assert note.modelled_time == want.time
    assert note.modelled_bubble == pytest.approx(want.bubble_fraction)
    # Stage 1 idles most of each tick: far more bubble than with equal costs.
    assert note.modelled_bubble > note.equal_bubble + 0.1
    assert note.equal_bubble == pytest.approx(note.bubble_fraction)
    text = " ".join(str(report).split())
    assert (
        f"bubble {want.bubble_fraction:.1%} with the stages' measured costs "
        f"({note.equal_bubble:.1%} with equal costs)"
    ) in text
    assert f"F {f0:.3g} {f1:.3g}; backward {2 * f0:.3g} {2 * f1:.3g}" in text


def test_pipeline_apply_models_the_forward_and_says_why_a_stage_is_not_measured():
    k, m, w, global_batch = 4, 4, 16, 32
    repl = rp.Replicator(mesh_shape={"stage": k, "data": 2})
    rng = np.random.default_rng(8)
    stages = pipeline.stack_stages(
        (rng.normal(size=(2 * k, w, w)) / 4).astype(np.float32), num_stages=k
    )
    placed = repl.place(stages, pipeline.stage_spec())
    x = rng.normal(size=(global_batch, w)).astype(np.float32)
    plan = pipeline.GPipe().timetable(k, m)

    def explain(stage_fn):
        f = pipeline.apply(stage_fn, num_microbatches=m)
        (note,) = repl.explain(lambda s, x: (s, {"y": f(s, x)}), placed, x).pipelines
        return note

    # Forward only: T ticks of one stage's forward (backward passes cost nothing).
    note = explain(pipeline.scan_layers(linear))
    one = 2 * 2 * (global_batch // 2 // m) * w * w  # 2 layers per stage
    assert note.stage_costs.forward == (one,) * k and note.stage_costs.backward == (0.0,) * k
    assert note.modelled_time == plan.num_ticks * one
    assert note.modelled_bubble == pytest.approx((k - 1) / plan.num_ticks)
    assert note.equal_time == plan.num_ticks

    # A stage that XLA compiles to a while loop cannot be counted: the equal-cost model only.
    def looped(ws, h):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, ws)[0]

    note = explain(looped)
    assert note.stage_costs is None and "stage 0's forward compiles to a loop" in note.cost_note
    assert (note.cost_unit, note.modelled_time) == ("units", plan.num_ticks)
    assert note.modelled_bubble == pytest.approx(plan.bubble_fraction())


def test_shapes_alone_give_the_same_report_and_nothing_runs():
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=1)
    params = repl.replicate(mlp())
    state = {"params": params, "opt": opt.init(params)}
    before = jax.tree.map(np.asarray, state)
    concrete = repl.explain(dp_step(opt), state, batch())
    # Nothing was donated or changed.
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)

    def shape_of(x):
        sharding = x.sharding if isinstance(x.sharding, NamedSharding) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    abstract = repl.explain(
        dp_step(opt), jax.tree.map(shape_of, state), jax.eval_shape(lambda: batch())
    )
    assert abstract.memory == concrete.memory
    assert abstract.collectives == concrete.collectives
    assert abstract.flops == concrete.flops


def test_report_prints_a_table_and_serialises_to_json():
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.sgd(0.1))
    params = repl.replicate(mlp())
    report = repl.explain(dp_step(opt), {"params": params, "opt": opt.init(params)}, batch())
    text = str(report)
    for words in ("memory per device", "arguments (state + batch)", "FLOPs per step",
                  "all-reduce", "data", "nothing run"):  # fmt: skip
        assert words in text, text
    data = json.loads(report.to_json())
    assert data["mesh"] == {"data": 8} and data["memory"]["peak"] == report.memory.peak
    # XLA:CPU's peak_memory_in_bytes leaves the temporaries out: the bound is the peak there
    assert report.memory.compiler_peak == 0 and report.memory.peak == data["memory"]["bound"]
    assert len(data["collectives"]) == len(report.collectives)
    assert data["collective_summary"][0]["kind"] == "all-reduce"


@pytest.mark.parametrize(
    "stats, peak",
    [  # Mixtral 8x22B on v6e-256, full remat, 2 accumulation steps (libtpu 0.0.50.1)
     (dict(argument=6843223040, output=6842701504, alias=6842698752, temp=37104718816,
           peak_memory=31705823936, total_allocation=31712158272), 31712158272),
     # the recipe, activations offloaded: peak_memory_in_bytes counts the host's 70 GiB
     (dict(argument=7343647744, output=7342995136, alias=7342992384, temp=20317202528,
           host_temp=75161927680, peak_memory=82505652928, total_allocation=22917028576),
      22917028576),
     # jax 0.10 (no total_allocation_bytes): the bound (libtpu 0.0.42, an MLP on v5p-16:
     # 11.3 MB of peak_memory_in_bytes, 6.0 of bound, 6.2 by libtpu's log)
     (dict(argument=4260352, output=3933216, alias=3932672, temp=1736032,
           peak_memory=11342368), 5996928)],
)  # fmt: skip
def test_a_tpu_programs_peak_is_the_hbm_libtpu_allocates(stats, peak):
    from types import SimpleNamespace

    from replicator._src.report import step_report

    name = {"peak_memory": "peak_memory_in_bytes", "total_allocation": "total_allocation_bytes"}
    fields = {name.get(k, f"{k}_size_in_bytes"): v for k, v in stats.items()}
    stats = SimpleNamespace(generated_code_size_in_bytes=0, **fields)
    memory = step_report.Memory(
        arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
        temporaries=stats.temp_size_in_bytes, aliased=stats.alias_size_in_bytes,
        generated_code=0, compiler_peak=step_report._compiler_peak(stats))  # fmt: skip
    assert memory.peak == peak
    assert memory.bound == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                            - stats.alias_size_in_bytes + stats.temp_size_in_bytes)  # fmt: skip


def test_local_lowering_has_no_program_to_explain():
    repl = rp.Replicator(lowering="local")
    with pytest.raises(ValueError, match=r"Replicator.explain: lowering='local' runs step_fn"):
        repl.explain(lambda s, x: (s, {}), jnp.zeros(()), jnp.ones(8))


def test_kernels_in_a_conditional_count_for_its_costliest_branch_only():
    text = """
%small (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %k = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/replicator_kernel_flops_100/splash"}
}
%large (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %k = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/replicator_kernel_flops_300/splash"}
}
ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} conditional(%pred, %x, %x), branch_computations={%small, %large}
}
"""
    costs = hlo.analyze(text, {"context": 2})
    assert costs.flops == 300 and costs.kernel_flops == 300  # not both branches' 400


def test_only_pallas_calls_in_a_kernels_scope_count_as_kernels():
    """A sharding annotation in a kernel's named scope (shard_map's around megablox's tgmm)
    carries no FLOPs; the Pallas call does, on a TPU or a GPU."""
    text = """
ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %s = f32[8]{0} custom-call(%x), custom_call_target="Sharding", metadata={op_name="jit(f)/replicator_kernel_flops_100/tgmm"}
  %k = f32[8]{0} custom-call(%s), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/replicator_kernel_flops_100/tgmm"}
  ROOT %g = f32[8]{0} custom-call(%k), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/replicator_kernel_flops_30/k"}
}
"""
    costs = hlo.analyze(text, {"data": 1})
    assert costs.flops == 130 and costs.kernel_flops == 130  # not the annotation's 100


def test_a_ragged_all_to_all_is_read_as_the_rows_it_may_send():
    text = """
ENTRY %main (x: f32[16,1,128], o: f32[64,1,128], a: s32[4], b: s32[4], c: s32[4], d: s32[4]) -> f32[64,1,128] {
  %x = f32[16,1,128]{2,1,0} parameter(0)
  %o = f32[64,1,128]{2,1,0} parameter(1)
  ROOT %r = f32[64,1,128]{2,1,0:T(1,128)} ragged-all-to-all(%x, %o, %a, %b, %c, /*index=5*/%d), channel_id=1, replica_groups={{0,1,2,3}}, metadata={op_name="jit(f)/shard_map/ragged_all_to_all"}
}
"""
    (c,) = hlo.analyze(text, {"expert": 4}).collectives
    assert (c.kind, c.axes, c.bytes) == ("ragged-all-to-all", ("expert",), 16 * 128 * 4)
    assert c.wire_bytes == 3 / 4 * c.bytes  # at most: the sizes are the run's


def test_a_send_across_slices_is_read_as_a_collective_over_dcn_data():
    """The TPU's part of a collective across slices: a ``send`` to the DCN runtime (as libtpu
    0.0.50.1 writes it for two v5p-16 slices), once per loop trip; its ``recv`` is not counted
    again."""
    send = (
        "(f32[32,8,128]{2,1,0:T(8,128)}, u32[]{:S(2)}, token[]) send(%b, %t), channel_id=18, "
        "is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="
        '"xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.8_0",'
        '_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:7}",'
        '_xla_megascale_transfer_type="ALL_REDUCE"}'
    )
    text = f"""
ENTRY %main (b: f32[32,8,128]) -> f32[32,8,128] {{
  %b = f32[32,8,128]{{2,1,0}} parameter(0)
  %t = token[] after-all()
  %s = {send}
  %r = (f32[32,8,128]{{2,1,0}}, u32[], token[]) recv(%t), channel_id=19, is_host_transfer=true
  ROOT %c = f32[32,8,128]{{2,1,0}} copy(%b)
}}
"""
    (c,) = hlo.analyze(text, {"dcn_data": 2, "data": 8}).collectives
    assert (c.kind, c.axes, c.group_size, c.dtype) == ("all-reduce", ("dcn_data",), 2, "f32")
    assert c.bytes == 32 * 8 * 128 * 4 and c.wire_bytes == c.bytes  # 2 (S-1)/S, S = 2
    gather = send.replace('"ALL_REDUCE"', '"ALL_GATHER"')
    (g,) = hlo.analyze(text.replace(send, gather), {"dcn_data": 2, "data": 8}).collectives
    assert g.kind == "all-gather" and g.bytes == 2 * c.bytes  # gathered from both slices
    assert g.wire_bytes == c.bytes  # this device's shard, sent to the other slice
    step = CompiledStep({"dcn_data": 2, "data": 8}, {}, 0.0, (
        CollectiveCost(c.kind, c.axes, c.wire_bytes, c.count),))  # fmt: skip
    hw = dataclasses.replace(rp.planner.HARDWARE_PROFILES["tpu-v5p"], island_size=8)  # a slice
    assert model_time(step, hw).dcn > 0 and model_time(step, hw).ici == 0


def test_replica_groups_in_every_hlo_form():
    assert hlo.replica_groups("replica_groups={{0,4},{1,5},{2,6},{3,7}}", 8) == [
        [0, 4], [1, 5], [2, 6], [3, 7],
    ]  # fmt: skip
    assert hlo.replica_groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [
        [0, 4], [1, 5], [2, 6], [3, 7],
    ]  # fmt: skip
    assert hlo.replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
    mesh = {"data": 2, "stage": 4}
    assert hlo.axes_spanned([[0, 4], [1, 5]], mesh) == ("data",)
    assert hlo.axes_spanned([[0, 1, 2, 3]], mesh) == ("stage",)
    assert hlo.axes_spanned([list(range(8))], mesh) == ("data", "stage")
    assert hlo.shape_bytes("(f32[8,32]{1,0}, bf16[4]{0}, /*index=2*/s32[])") == 1024 + 8 + 4


def test_a_while_loop_and_a_marked_conditional_are_counted_per_trip():
    text = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %y = f32[8]{0} add(%x, %x)
  %c = f32[8]{0} conditional(%pred, %x), branch_computations={%send, %keep}, metadata={op_name="jit(f)/while/body/replicator_runs_1_of_4/cond"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %c)
}
%send (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %s = f32[8]{0} collective-permute(%a), source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(f)/while/body/replicator_runs_1_of_4/cond/branch_1_fun/ppermute"}
}
%keep (a: f32[8]) -> f32[8] {
  ROOT %a = f32[8]{0} parameter(0)
}
%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
}
"""
    costs = hlo.analyze(text, {"stage": 2})
    (send,) = costs.collectives
    assert (send.kind, send.axes, send.bytes, send.count) == (
        "collective-permute",
        ("stage",),
        32,
        3,
    )
    assert send.conditional
    assert costs.flops == 12 * 8 + 13 * 1  # the add per trip, the compare per test


def test_a_per_stage_switch_counts_the_collectives_of_the_branch_a_device_runs():
    """Each device of the ``stage`` axis runs one branch of a ``lax.switch`` on its stage index,
    each branch all-reducing a different size over ``data``: a device sends one branch's bytes
    (the largest), not the sum over the branches."""
    mesh = jax.make_mesh((2, 4), ("data", "stage"), devices=jax.devices()[:8])
    sizes = (8, 64, 16, 32)

    def branch(n):
        return lambda x: jax.lax.psum(jnp.sin(x[:n]).sum() * jnp.ones(n), "data").sum()

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P("stage"))
    def f(x):
        return jax.lax.switch(jax.lax.axis_index("stage"), [branch(n) for n in sizes], x)[None]

    text = f.lower(jnp.arange(64.0)).compile().as_text()
    costs = hlo.analyze(text, {"data": 2, "stage": 4})
    data = [c for c in costs.collectives if c.axes == ("data",)]
    assert data and all(c.conditional for c in data)
    assert sum(c.bytes * c.count for c in data) == 64 * 4  # the 64-wide branch's, f32
