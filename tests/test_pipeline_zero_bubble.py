"""ZeroBubble's engine (B and W split, one scan) against the single-device sequential oracle.

The library's ``ZeroBubble()`` runs through ``rp.pipeline.value_and_grad``; plans built here
(1F1B's tables with every W delayed by d ticks, and random valid tables, with ring sizes found
by simulating the rings) run the engine directly, with the wiring ``value_and_grad`` gives it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle import rel_err
from test_pipeline import D_IN, D_OUT, D, layer_fn, loss_fn, make_batch

import replicator as rp
from replicator import pipeline
from replicator._src.core.collectives import sum_over_axes
from replicator._src.pipeline import schedules as S
from replicator._src.pipeline import zero_bubble
from replicator._src.pipeline.call import PipelineCall
from replicator._src.pipeline.residuals import as_remat

K, M = 4, 8
MESH = {"data": 2, "stage": 4}
TOL = 1e-5  # the model (layer_fn, loss_fn, make_batch) is tests/test_pipeline.py's


# -- test plans -----------------------------------------------------------------------------------


def ring_sizes(fwd, bwd, wgt):
    """The smallest rings (stash, grads) in which no live micro-batch is overwritten, found by
    running the tables' events in order and trying ring sizes 1, 2, ... for each stage."""
    t_count, k = fwd.shape

    def events(s):  # (kind, micro-batch) in execution order; kind: 's'/'g' = written, 'w' = W
        out = []
        for t in range(t_count):
            if fwd[t, s] >= 0 and s == 0:
                out.append(("s", fwd[t, s]))
            if fwd[t, s] >= 0 and s == k - 1:
                out.append(("g", fwd[t, s]))
            if wgt[t, s] >= 0:
                out.append(("w", wgt[t, s]))
            if s > 0 and fwd[t, s - 1] >= 0:  # arrivals at the end of the tick
                out.append(("s", fwd[t, s - 1]))
            if s < k - 1 and bwd[t, s + 1] >= 0:
                out.append(("g", bwd[t, s + 1]))
        return out

    def fits(ring, kind, s):
        live = set()
        for what, i in events(s):
            if what == "w":
                live.discard(i)
            elif what == kind:
                if any(j % ring == i % ring for j in live):
                    return False
                live.add(i)
        return True

    m = int(fwd.max()) + 1
    return tuple(
        max(min(r for r in range(1, m + 1) if fits(r, kind, s)) for s in range(k)) for kind in "sg"
    )


def make_plan(fwd, bwd, wgt):
    k, m = fwd.shape[1], int(fwd.max()) + 1
    ss, gs = ring_sizes(fwd, bwd, wgt)
    z = np.zeros_like(fwd)
    return S.Timetable("zerobubble", k, m, 1, fwd, z, bwd, stash_slots=ss, wgt=wgt, grad_slots=gs)


def delayed_plan(k, m, d):
    """1F1B's tables with each W run d ticks after its B (d idle ticks appended)."""
    base = S.OneFOneB().timetable(k, m)
    idle = np.full((d, k), -1, np.int32)
    fwd, bwd = np.concatenate([base.fwd, idle]), np.concatenate([base.bwd, idle])
    return make_plan(fwd, bwd, np.concatenate([idle, base.bwd]))


def random_plan(k, m, seed):
    """Random valid tables: each tick, each stage runs its next F, B and W (each with
    probability 1/2) when the dependencies allow."""
    rng = np.random.default_rng(seed)
    done = {p: np.full((m, k), -1) for p in "FBW"}
    nxt = {p: [0] * k for p in "FBW"}
    rows = []
    t = 0
    while min(nxt["W"]) < m:
        row = np.full((3, k), -1)
        for s in range(k):
            i = nxt["F"][s]
            if i < m and (s == 0 or 0 <= done["F"][i, s - 1] < t) and rng.random() < 0.5:
                done["F"][i, s], row[0, s] = t, i
            j = nxt["B"][s]
            if (
                j < m
                and 0 <= done["F"][j, s] <= t
                and (s == k - 1 or 0 <= done["B"][j, s + 1] < t)
                and rng.random() < 0.5
            ):
                done["B"][j, s], row[1, s] = t, j
            w = nxt["W"][s]
            if w < m and 0 <= done["B"][w, s] <= t and rng.random() < 0.5:
                done["W"][w, s], row[2, s] = t, w
            for p, r in zip("FBW", row[:, s]):
                nxt[p][s] += r >= 0
        rows.append(row)
        t += 1
    fwd, bwd, wgt = (np.stack([r[n] for r in rows]) for n in range(3))
    return make_plan(fwd, bwd, wgt)


class Tables:
    """A schedule object for a given timetable (what PipelineCall reads from a schedule)."""

    name = "zerobubble"
    repeats = 1

    def __init__(self, plan):
        self._plan = plan

    def timetable(self, k, m):
        assert (k, m) == (self._plan.num_stages, self._plan.num_microbatches)
        return self._plan


def engine(stage_fn, plan, *, unroll=False, remat="full"):
    """value_and_grad's wiring for a plan the library has no schedule for: the call, the
    ZeroBubble scan, the sums over 'stage'."""

    def f(stage_params, inputs, targets, head):
        call = PipelineCall.from_arguments(
            "value_and_grad", Tables(plan), plan.num_microbatches, stage_fn, stage_params,
            inputs, targets, unroll=unroll,
        )  # fmt: skip
        policy = as_remat(remat, "engine")
        loss, g_rows, g_xs, g_head = zero_bubble.value_and_grad(call, loss_fn, head, policy)
        loss, g_xs, g_head = sum_over_axes((loss, g_xs, g_head), ("stage",))
        return loss, (call.from_rows(g_rows), call.merge_batch(g_xs), g_head)

    return f


# -- the model and its oracle -------------------------------------------------------------------


def init_params(layers, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "embed": {"w": rng.normal(size=(D_IN, D)).astype(np.float32) / np.sqrt(D_IN)},
        "layers": {
            "w": rng.normal(size=(layers, D, D)).astype(np.float32) / np.sqrt(D),
            "b": 0.1 * rng.normal(size=(layers, D)).astype(np.float32),
        },
        "head": {"w": rng.normal(size=(D, D_OUT)).astype(np.float32) / np.sqrt(D)},
    }


def oracle_loss(params, x, t):
    h = x @ params["embed"]["w"]
    for i in range(params["layers"]["w"].shape[0]):
        h = layer_fn(jax.tree.map(lambda a, i=i: a[i], params["layers"]), h)
    return loss_fn(params["head"], h, t)


def stage_fn_for(lv):
    """A plain stage_fn (one layer per stage) for lv=1, else scan_layers."""
    return layer_fn if lv == 1 else pipeline.scan_layers(layer_fn)


def place(params, repl, lv):
    stacked = pipeline.stack_stages(params["layers"], num_stages=K)
    if lv == 1:  # one layer per stage: [K, 1, ...] -> [K, ...]
        stacked = jax.tree.map(lambda a: a[:, 0], stacked)
    return {
        "embed": repl.replicate(params["embed"]),
        "stages": repl.place(stacked, pipeline.stage_spec()),
        "head": repl.replicate(params["head"]),
    }


def unplace(tree, lv):
    out = jax.tree.map(np.asarray, {k: tree[k] for k in ("embed", "head")})
    stages = jax.tree.map(np.asarray, tree["stages"])  # [K, ...] (lv=1) or [K, lv, ...]
    out["layers"] = (
        stages if lv == 1 else jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stages)
    )
    return out


def pipelined_grads(f):
    def grads(params, x, t):
        h, embed_vjp = jax.vjp(lambda e: x @ e["w"], params["embed"])
        loss, (g_stages, g_h, g_head) = f(params["stages"], h, t, params["head"])
        (g_embed,) = embed_vjp(g_h)
        return loss, {"embed": g_embed, "stages": g_stages, "head": g_head}

    return grads


_REPL = {}


def repl():
    if "r" not in _REPL:
        _REPL["r"] = rp.Replicator(mesh_shape=MESH, devices=jax.devices()[:8])
    return _REPL["r"]


def run_grads(f, lv, seed=0):
    """The pipeline's loss and gradients (mean over replicas) and the oracle's."""
    r = repl()
    params = init_params(K * lv, seed)
    x, t = make_batch(32, seed + 1)
    grads = pipelined_grads(f)

    def step(state, x, t):
        loss, g = rp.all_reduce(grads(state["params"], x, t), "mean")
        return {**state, "grads": g}, {"loss": loss}

    placed = place(params, r, lv)
    state = {"params": placed, "grads": jax.tree.map(jnp.zeros_like, placed)}
    state, out = r.run(step, state, x, t)
    want_loss, want = jax.value_and_grad(oracle_loss)(params, x, t)
    return np.asarray(out["loss"]), unplace(state["grads"], lv), want_loss, want


def assert_matches_oracle(f, lv):
    loss, got, want_loss, want = run_grads(f, lv)
    assert rel_err(loss, np.full(loss.shape, want_loss)) <= TOL
    for part in ("embed", "layers", "head"):  # embed: the gradient of the pipeline's inputs
        assert rel_err(got[part], want[part]) <= TOL, part
    assert np.abs(got["layers"]["w"]).min() > 0  # every layer got a gradient
    return got


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lv,plan,remat",
    [
        (1, lambda: delayed_plan(K, M, 2), "none"),
        (2, lambda: delayed_plan(K, M, 3), "full"),
        (3, lambda: random_plan(K, M, seed=3), "dots"),
        (3, lambda: random_plan(K, M, seed=3), "none"),
    ],
    ids=["plain-delay2-none", "scan2-delay3-full", "scan3-random-dots", "scan3-random-none"],
)
@pytest.mark.slow
def test_loss_and_every_gradient_equal_the_sequential_model(lv, plan, remat):
    """The residuals, the cotangents and what B keeps for W wait in their rings for as many
    ticks as the tables say, whatever the remat policy."""
    plan = plan()
    assert (plan.wgt != plan.bwd).any()  # W really runs apart from B
    assert_matches_oracle(engine(stage_fn_for(lv), plan, remat=remat), lv)


@pytest.mark.parametrize("lv,remat", [(1, "full"), (2, "none"), (2, "dots")])
def test_the_zerobubble_schedule_through_value_and_grad(lv, remat):
    schedule = S.get("zerobubble")
    assert schedule.name == "zerobubble"
    f = pipeline.value_and_grad(
        stage_fn_for(lv), loss_fn, num_microbatches=M, schedule=schedule, remat=remat
    )
    assert_matches_oracle(f, lv)


def test_three_sgd_steps_of_dp_x_pp_equal_single_device_training():
    lv = 2
    r = repl()
    tx = optax.sgd(0.1)
    wrapped = r.wrap_optimizer(tx)
    grads = pipelined_grads(pipeline.value_and_grad(
        stage_fn_for(lv), loss_fn, num_microbatches=M, schedule="zerobubble"
    ))  # fmt: skip
    traces = []

    def step(state, x, t):
        traces.append(1)
        loss, g = grads(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    params = init_params(K * lv)
    placed = place(params, r, lv)
    state = {"params": placed, "opt": wrapped.init(placed)}
    want, opt = params, tx.init(params)
    for i in range(3):
        x, t = make_batch(32, seed=10 + i)
        state, _ = r.run(step, state, x, t)
        updates, opt = tx.update(jax.grad(oracle_loss)(want, x, t), opt, want)
        want = optax.apply_updates(want, updates)
    assert len(traces) == 1
    assert rel_err(unplace(state["params"], lv), want) <= TOL
    assert rel_err(unplace(state["params"], lv), params) > 1e-2  # training moved them


@pytest.mark.slow
def test_the_unrolled_debug_loop_runs_the_same_ticks():
    lv, plan = 1, delayed_plan(K, 4, 1)
    results = []
    for unroll in (False, True):
        loss, got, _, _ = run_grads(engine(stage_fn_for(lv), plan, unroll=unroll), lv)
        results.append((got, loss))
    assert rel_err(results[1], results[0]) <= 1e-6


def test_ring_sizes_are_what_the_ring_simulation_needs():
    """The library's ring bound equals the simulated rings, on 1F1B-like, random and ZeroBubble
    plans, and a plan whose ring is one slot short is refused before a step runs."""
    plans = [delayed_plan(K, M, d) for d in (0, 1, 4)] + [
        random_plan(k, m, seed) for seed, (k, m) in enumerate([(2, 3), (4, 8), (3, 7), (4, 5)])
    ]
    plans += [S.ZeroBubble().timetable(k, m) for k, m in ((2, 2), (4, 8), (3, 10))]
    for plan in plans:
        got = S.ring_slots(plan.fwd, plan.bwd, plan.wgt)
        assert got == ring_sizes(plan.fwd, plan.bwd, plan.wgt)
        assert got == (plan.stash_slots, plan.grad_slots)
        S.check_dependencies(plan)
    plan = delayed_plan(K, M, 2)
    assert plan.stash_slots > 2 * K - 1  # W two ticks late keeps two more inputs
    short = S.Timetable(
        plan.schedule, K, M, 1, plan.fwd, plan.fwd_repeat, plan.bwd,
        stash_slots=plan.stash_slots - 1, wgt=plan.wgt, grad_slots=plan.grad_slots,
    )  # fmt: skip
    with pytest.raises(ValueError, match=rf"needs? stash_slots >= {plan.stash_slots}"):
        run_grads(engine(stage_fn_for(1), short), 1)


def test_plans_that_break_a_dependency_are_refused():
    plan = delayed_plan(K, M, 2)
    early_w = np.concatenate([plan.bwd[1:], plan.bwd[:1]])  # W one tick before its B
    bad = S.Timetable(
        "zerobubble", K, M, 1, plan.fwd, plan.fwd_repeat, plan.bwd,
        stash_slots=M, wgt=early_w, grad_slots=M,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"W of micro-batch 0.* needs B on the same stage"):
        run_grads(engine(stage_fn_for(1), bad), 1)


def test_apply_and_the_remat_option():
    lv = 2
    params = init_params(K * lv)
    x, _ = make_batch(32)
    want = x @ params["embed"]["w"]
    h = want
    for i in range(K * lv):
        want = layer_fn(jax.tree.map(lambda a, i=i: a[i], params["layers"]), want)
    f = pipeline.apply(stage_fn_for(lv), num_microbatches=M, schedule="zerobubble")
    r = repl()
    _, out = r.run(lambda s, h: (s, {"y": f(s["stages"], h)}), place(params, r, lv), h)
    assert rel_err(np.asarray(out["y"]).reshape(want.shape), want) <= TOL


# Matmuls per layer and micro-batch: one forward, the input gradient in B, the weight gradient
# in W, and with "full" the forward again in B (W uses what B recomputed). "dots" keeps the
# product's output, so it recomputes only the tanh.
MATMULS = {"none": 3, "full": 4, "dots": 3}


@pytest.mark.parametrize("remat", list(MATMULS))
def test_explain_counts_the_busy_phases_and_two_shifts_per_tick(remat):
    """Each stage runs M of the T ticks' F, B and W phases, with the work of one fused
    backward between B and W; the head's three matmuls run M times on the last stage."""
    lv, b = 2, 2  # b: rows of one micro-batch on one device
    r = repl()
    params = init_params(K * lv)
    f = pipeline.value_and_grad(
        stage_fn_for(lv), loss_fn, num_microbatches=M, schedule=S.ZeroBubble(), remat=remat
    )

    def step(state, h, t):
        loss, (g, _, g_head) = f(state["stages"], h, t, state["head"])
        return {**state, "stages": g, "head": rp.all_reduce(g_head, "mean")}, {"loss": loss}

    placed = place(params, r, lv)
    h = np.ones((2 * M * b, D), np.float32)
    report = r.explain(step, placed, h, np.ones((2 * M * b, D_OUT), np.float32))
    plan = S.ZeroBubble().timetable(K, M)
    (note,) = report.pipelines
    assert (note.schedule, note.ticks, note.sends_per_step) == ("zerobubble", plan.num_ticks,
                                                                2 * plan.num_ticks)  # fmt: skip
    assert report.bytes_by(kind="collective-permute") == 2 * plan.num_ticks * 4 * b * D
    per_layer, head = 2 * b * D * D, 2 * b * D * D_OUT
    assert report.matmul_flops == M * lv * MATMULS[remat] * per_layer + M * 3 * head
