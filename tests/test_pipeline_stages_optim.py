"""Stages that differ (`pipeline.sequential`) under optimizers that look at a leaf as a whole:
weight-decay masks by name and by rank, LAMB, Adafactor, ``multi_transform`` by name, and
global-norm clipping in a chain. Parameters after three steps of DP x PP against optax on one
device, on the stages' own trees, with the full batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle import rel_err
from test_pipeline_stages import (
    CNN,
    CNN4_V2,
    cnn_batch,
    cnn_params,
    cross_entropy,
    make_repl,
)

import replicator as rp
from replicator import pipeline

STEPS = 3
SCHEDULES = {
    "gpipe": pipeline.GPipe(),
    "1f1b": pipeline.OneFOneB(),
    "zb": pipeline.ZeroBubble(),
    "circular": pipeline.Circular(repeats=2),
    "interleaved": pipeline.Interleaved1F1B(repeats=2),
}


def by_rank(params):  # the usual LLM recipe: no decay on vectors (biases, norms)
    return jax.tree.map(lambda a: np.ndim(a) > 1, params)


def by_name(params):  # no decay on leaves named "b..." or "scale"
    def decayed(path, _):
        name = jax.tree_util.keystr(path[-1:])
        return not (name.startswith("['b") or name == "['scale']")

    return jax.tree_util.tree_map_with_path(decayed, params)


def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "sgd" if jax.tree_util.keystr(path[-1:]).startswith("['b") else "adam",
        params,
    )


TRANSFORMS = {
    "adamw_mask_by_name": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=by_name),
    "adamw_mask_by_rank": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=by_rank),
    "lamb": lambda: optax.lamb(1e-2, weight_decay=1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)}, labels
    ),
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "sgd": lambda: optax.sgd(0.1),
}
TOL = {"sgd": 1e-5}  # Adam-type updates divide by small second moments: 1e-4


def train(tx, schedule, *, mesh=None, plain_dict=False, zero_stage=0):
    """Three steps of DP x PP on the CNN's stages; returns (got, want) stage trees."""
    model = CNN4_V2 if schedule.repeats > 1 else CNN
    mesh = mesh or ({"data": 2, "stage": 2} if schedule.repeats > 1 else {"data": 2, "stage": 4})
    repl = make_repl(mesh)
    wrapped = repl.wrap_optimizer(tx, zero_stage=zero_stage)
    f = pipeline.value_and_grad(model, cross_entropy, num_microbatches=4, schedule=schedule)

    def step(state, x, t):
        loss, (g, _, _) = f(rp.gather_params(state["params"]), x, t)  # ZeRO-3: whole rows
        p = state["params"]
        if plain_dict:  # what the optimizer saw before: one buffer per dtype and stage
            g, p = dict(g), dict(p)
        updates, opt = wrapped.update(g, state["opt"], p)
        new = jax.tree.leaves(optax.apply_updates(p, updates))
        params = jax.tree.unflatten(jax.tree.structure(state["params"]), new)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    params = jax.tree.map(jnp.asarray, cnn_params())
    packed = repl.place(model.pack(params), pipeline.stage_spec(schedule.repeats))
    if zero_stage == 3:  # stored split, each stage's leaves over the replicas
        packed = wrapped.shard_params(packed)
    state = {"params": packed, "opt": wrapped.init(dict(packed) if plain_dict else packed)}
    want, opt = params, tx.init(params)
    for i in range(STEPS):
        x, t = cnn_batch(seed=10 + i)
        state, out = repl.run(step, state, x, t)
        loss, g = jax.value_and_grad(lambda p, x=x, t=t: cross_entropy(None, model.run(p, x), t))(
            want
        )
        if not plain_dict:
            assert rel_err(out["loss"], np.full(repl.num_replicas, loss)) <= 1e-5
        updates, opt = tx.update(g, opt, want)
        want = optax.apply_updates(want, updates)
    held = state["params"].packed() if zero_stage == 3 else state["params"]
    got = model.unpack(jax.tree.map(np.asarray, dict(held)))
    assert rel_err(got, params) > 1e-3  # it trained
    return got, want


@pytest.mark.slow
def test_a_weight_decay_mask_by_name_equals_one_device():
    got, want = train(TRANSFORMS["adamw_mask_by_name"](), SCHEDULES["1f1b"])
    assert rel_err(got, want) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in TRANSFORMS if n != "adamw_mask_by_name"])
def test_every_transformation_equals_one_device(name):
    got, want = train(TRANSFORMS[name](), SCHEDULES["1f1b"])
    assert rel_err(got, want) <= TOL.get(name, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(  # 1f1b runs every transformation; each schedule, one of the three
    "name, schedule",
    [("adamw_mask_by_rank", "gpipe"), ("lamb", "zb"), ("clip_by_global_norm", "circular"),
     ("adamw_mask_by_rank", "interleaved")],
)  # fmt: skip
def test_every_schedule_equals_one_device(name, schedule):
    got, want = train(TRANSFORMS[name](), SCHEDULES[schedule])
    assert rel_err(got, want) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{"data": 4}, {"data": 2, "stage": 2, "model": 2}])
def test_without_a_stage_axis_or_with_model_it_equals_one_device(mesh):
    """On ``{"data": 4}`` every device holds all the rows; with ``model``, XLA's axis, the
    update is replicated over it."""
    schedule = SCHEDULES["circular"] if mesh.get("stage") == 2 else SCHEDULES["1f1b"]
    got, want = train(TRANSFORMS["lamb"](), schedule, mesh=mesh)
    assert rel_err(got, want) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw_mask_by_rank", "lamb"])
def test_negative_control_the_buffers_as_plain_dicts_differ(name):
    """The test can fail: the same steps with the optimizer given the packed buffers as plain
    dicts (what it saw before) differ from one device by far more than the tolerance."""
    got, want = train(TRANSFORMS[name](), SCHEDULES["1f1b"], plain_dict=True)
    assert rel_err(got, want) > 1e-3


def test_the_state_is_each_stages_own_and_the_step_count_shared():
    repl = make_repl()
    opt = repl.wrap_optimizer(optax.adamw(1e-2, mask=by_rank))
    packed = repl.place(CNN.pack(cnn_params()), pipeline.stage_spec())
    state = opt.init(packed)
    assert [np.shape(x) for x in state.shared] == [()]  # Adam's count, once
    (rows,) = state.rows.values()
    assert rows.shape[0] == 4 and rows.sharding.spec == jax.sharding.PartitionSpec("stage")
    # each stage's row holds its two moments: 2 x the largest stage's parameters
    n = max(sum(np.size(a) for a in jax.tree.leaves(p)) for p in cnn_params())
    assert rows.shape[1] == 2 * n


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_with_a_mask_by_name_equals_one_device(zero_stage):
    got, want = train(TRANSFORMS["adamw_mask_by_name"](), SCHEDULES["1f1b"], zero_stage=zero_stage)
    assert rel_err(got, want) <= 1e-4


_ZEROED = [n for n in TRANSFORMS if n != "adamw_mask_by_name"]


@pytest.mark.slow
@pytest.mark.parametrize(  # every transformation under ZeRO-1 or ZeRO-2, alternately
    "name, zero_stage", [(n, 1 + i % 2) for i, n in enumerate(_ZEROED)]
)
def test_zero_with_every_transformation_equals_one_device(name, zero_stage):
    got, want = train(TRANSFORMS[name](), SCHEDULES["1f1b"], zero_stage=zero_stage)
    assert rel_err(got, want) <= TOL.get(name, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name, schedule", [("clip_by_global_norm", "1f1b")])
def test_zero_3_stores_each_stages_leaves_split_and_equals_one_device(name, schedule):
    """ZeRO-3 on packed stages: each stage's leaves split over the replicas (a segment each),
    gathered once a step by rp.gather_params; the update runs on the parts."""
    got, want = train(TRANSFORMS[name](), SCHEDULES[schedule], zero_stage=3)
    assert rel_err(got, want) <= TOL.get(name, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "zb", "circular", "interleaved"])
def test_zero_under_every_schedule_equals_one_device(schedule):
    got, want = train(TRANSFORMS["lamb"](), SCHEDULES[schedule], zero_stage=1)
    assert rel_err(got, want) <= 1e-4


def test_zero_keeps_each_stages_state_split_over_the_replicas():
    """ZeRO-1 on packed stages: each stage's moments split over the 2 replicas (a segment
    each), the step count once."""
    repl = make_repl()
    opt = repl.wrap_optimizer(optax.adamw(1e-2, mask=by_rank), zero_stage=1)
    packed = repl.place(CNN.pack(cnn_params()), pipeline.stage_spec())
    state = opt.init(packed).inner
    (rows,) = state.rows.values()
    assert rows.sharding.spec == jax.sharding.PartitionSpec("stage", "data")
    n = max(sum(np.size(a) for a in jax.tree.leaves(p)) for p in cnn_params())
    # each replica holds its parts: half of each leaf that splits, whole the rest
    assert n <= rows.shape[1] // 2 <= n + 64
    assert [np.shape(x) for x in state.shared] == [()]


def test_zero_3_of_whole_rows_and_norm_clipping_options_are_refused_naming_the_fix():
    repl = make_repl()
    packed = repl.place(CNN.pack(cnn_params()), pipeline.stage_spec())
    opt = repl.wrap_optimizer(optax.adam(1e-2), zero_stage=3)
    with pytest.raises(ValueError, match=r"zero_stage=3.*stored whole.*opt.shard_params\(params\)"):
        opt.init(packed)
    opt = repl.wrap_optimizer(optax.adam(1e-2), zero_stage=1, clip_global_norm=1.0)
    with pytest.raises(ValueError, match=r"clip_global_norm.*optax.clip_by_global_norm"):
        opt.init(packed)


def test_a_plain_dict_of_rows_is_refused_by_value_and_grad():
    """A plain dict of the rows would hide the stages from the optimizer: refused."""
    repl = make_repl()
    packed = dict(repl.place(CNN.pack(cnn_params()), pipeline.stage_spec()))
    f = pipeline.value_and_grad(CNN, cross_entropy, num_microbatches=4)
    with pytest.raises(ValueError, match=r"plain dict of packed rows.*model.pack\(params\)"):
        repl.run(lambda s, x, t: (s, {"loss": f(s, x, t)[0]}), packed, *cnn_batch())


# -- stages with integer inputs, a tuple activation, and runs of layers ------------------------


def embed(p, tokens):  # int32 ids [b, T] -> (h [b, T, 8], a float mask [b, T])
    return p["table"][tokens], (tokens > 0).astype(jnp.float32)


def widen(p, hm):  # (h [.., 8], m) -> (h [.., 12], m)
    h, m = hm
    return jnp.tanh(h @ p["w"] + p["b"]) * m[..., None], m


def mix(p, hm):  # runs of this layer, stacked
    h, m = hm
    return h + jnp.tanh(h @ p["w"]) * p["gain"], m


def logits(p, hm):  # -> [b, T, 16]
    h, _ = hm
    return h @ p["w"] + p["b"]


def token_loss(_, out, targets):
    logp = jax.nn.log_softmax(out, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def own_model():
    r = np.random.default_rng(7)

    def n(*shape):
        return jnp.asarray(r.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)

    mixes = [{"w": n(12, 12), "gain": n(12)} for _ in range(3)]
    layers = [
        {"table": n(16, 8)},
        {"w": n(8, 12), "b": n(12)},
        *mixes,
        {"w": n(12, 16), "b": n(16)},
    ]
    fns = [embed, widen, mix, mix, mix, logits]
    stage_fns, stage_params = pipeline.stages_from_layers(fns, layers, (1, 2, 2, 1))
    return pipeline.sequential(stage_fns, stage_params), stage_params


@pytest.mark.parametrize("name", ["adamw_mask_by_rank", "clip_by_global_norm"])
@pytest.mark.slow
def test_integer_inputs_a_tuple_activation_and_runs_of_layers_equal_one_device(name):
    """Token ids into stage 0, a tuple (activation, mask) between stages, and stages that are
    runs of a layer (parameters stacked: the mask by rank sees them as one device does)."""
    model, params = own_model()
    repl = make_repl()
    tx = TRANSFORMS[name]()
    wrapped = repl.wrap_optimizer(tx)
    f = pipeline.value_and_grad(
        model, token_loss, num_microbatches=4, schedule=pipeline.ZeroBubble()
    )

    def step(state, tokens, targets):
        _, (g, _, _) = f(state["params"], tokens, targets)
        updates, opt = wrapped.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    packed = repl.place(model.pack(params), pipeline.stage_spec())
    state = {"params": packed, "opt": wrapped.init(packed)}
    want, opt = params, tx.init(params)
    r = np.random.default_rng(3)
    for _ in range(STEPS):
        tokens = r.integers(0, 16, size=(16, 6)).astype(np.int32)
        targets = np.roll(tokens, -1, axis=1)
        state, _ = repl.run(step, state, tokens, targets)
        g = jax.grad(lambda p, x=tokens, t=targets: token_loss(None, model.run(p, x), t))(want)
        updates, opt = tx.update(g, opt, want)
        want = optax.apply_updates(want, updates)
    got = model.unpack(jax.tree.map(np.asarray, dict(state["params"])))
    assert rel_err(got, want) <= 1e-4
    assert rel_err(got, params) > 1e-3


@pytest.mark.parametrize(
    "zero_stage",
    [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(3, marks=pytest.mark.slow)],
)
def test_the_state_from_shapes_and_a_checkpoint_round_trip_keep_the_packing(zero_stage, tmp_path):
    """`Replicator.abstract` gives the real state's shapes and shardings, and a checkpoint
    restores the packed parameters as `PackedStages` (so the optimizer still sees stages)."""
    repl = make_repl()
    opt = repl.wrap_optimizer(optax.adamw(1e-2, mask=by_name), zero_stage=zero_stage)

    def init():
        packed = repl.place(
            CNN.pack(jax.tree.map(jnp.asarray, cnn_params())), pipeline.stage_spec()
        )
        if zero_stage == 3:
            packed = opt.shard_params(packed)
        return {"params": packed, "opt": opt.init(packed)}

    abstract, state = repl.abstract(init), init()
    for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(state), strict=True):
        assert (a.shape, a.sharding) == (b.shape, b.sharding)
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(1, state)
    restored, _ = ckpt.restore(abstract)
    kind = "SplitStages" if zero_stage == 3 else "PackedStages"
    assert type(restored["params"]).__name__ == kind
    assert rel_err(restored, state) == 0
