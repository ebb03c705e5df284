"""Pipelines of any model (`pipeline.sequential`): stages with their own functions, parameters
and activation shapes, against the model run on one device with the whole batch."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cases import each_value, pairwise
from oracle import rel_err

import replicator as rp
from replicator import pipeline
from replicator.models import gpt

TOL = 1e-5
MESH = {"data": 2, "stage": 4}
SCHEDULES = {"gpipe": pipeline.GPipe(), "1f1b": pipeline.OneFOneB(), "zb": pipeline.ZeroBubble()}


def make_repl(mesh_shape=MESH):
    n = int(np.prod(list(mesh_shape.values())))
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


# -- a CNN with downsampling: 4 stages of different parameter structures and shapes -----------


def conv(x, w, stride=1):
    return jax.lax.conv_general_dilated(
        x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def stem(p, x):  # the embedding: images [b, 8, 8, 3] -> [b, 8, 8, 8]
    return jax.nn.relu(conv(x, p["w"]) + p["b"])


def down(p, x):  # [b, 8, 8, 8] -> [b, 4, 4, 16]
    h = jax.nn.relu(conv(x, p["conv1"], stride=2))
    return h + conv(h, p["conv2"]) * p["scale"]


def pool_mlp(p, x):  # [b, 4, 4, 16] -> [b, 32]
    h = x.mean(axis=(1, 2))
    return jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]


def head(p, x):  # [b, 32] -> logits [b, 10]
    return x @ p["w"] + p["b"]


def cross_entropy(_, logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def cnn_params(seed=0):
    r = np.random.default_rng(seed)

    def n(*shape, scale=1.0):
        return (scale * r.normal(size=shape) / np.sqrt(np.prod(shape[:-1]))).astype(np.float32)

    return [
        {"w": n(3, 3, 3, 8), "b": n(8, scale=0.1) * 10},
        {"conv1": n(3, 3, 8, 16), "conv2": n(3, 3, 16, 16), "scale": np.float32(0.5)},
        {"w1": n(16, 32), "b1": n(32, scale=0.1) * 10, "w2": n(32, 32)},
        {"w": n(32, 10), "b": np.zeros(10, np.float32) + 0.1},
    ]


def cnn_batch(n=16, seed=1):
    r = np.random.default_rng(seed)
    return r.normal(size=(n, 8, 8, 3)).astype(np.float32), r.integers(0, 10, size=n)


CNN = pipeline.sequential([stem, down, pool_mlp, head], cnn_params())


def pipeline_step(model, schedule, m, remat=True):
    f = pipeline.value_and_grad(
        model, cross_entropy, num_microbatches=m, schedule=schedule, remat=remat
    )

    def step(state, x, t):
        loss, (g, g_x, _) = f(state["params"], x, t)
        loss, g = rp.all_reduce((loss, g), "mean")  # per-replica means -> the global mean
        return {**state, "grads": g}, {"loss": loss, "g_x": g_x}  # g_x: this replica's half

    return step


def grads_in_state(f):
    """A step that keeps the replica-mean gradients in the state (placed like the params)."""

    def step(state, x, t):
        loss, (g, g_x, _) = f(state["params"], x, t)
        if x.dtype == np.int32:
            assert g_x.dtype == jax.dtypes.float0  # token ids have no gradient
        loss, g = rp.all_reduce((loss, g), "mean")
        return {**state, "grads": g}, {"loss": loss}

    return step


@pytest.mark.parametrize(  # every schedule x policy: test_pipeline.py
    "name, remat", each_value(name=list(SCHEDULES), remat=[True, "none", "dots"])
)
@pytest.mark.slow
def test_cnn_stages_loss_and_every_gradient_equal_the_model_on_one_device(name, remat):
    """Stages of different shapes, packed into one buffer per device, under each remat
    policy: what a stage keeps for its backward pass never changes the numbers."""
    repl = make_repl()
    params = cnn_params()
    x, t = cnn_batch()

    def oracle(params, x):
        return cross_entropy(None, CNN.run(params, x), t)

    want_loss, (want, want_x) = jax.value_and_grad(oracle, argnums=(0, 1))(params, x)
    packed = repl.place(CNN.pack(params), pipeline.stage_spec())
    state = {"params": packed, "grads": jax.tree.map(jnp.zeros_like, packed)}
    state, out = repl.run(pipeline_step(CNN, SCHEDULES[name], 4, remat), state, x, t)
    got = CNN.unpack(jax.tree.map(np.asarray, state["grads"]))
    assert rel_err(out["loss"], np.full(2, want_loss)) <= TOL
    for j in range(4):
        assert rel_err(got[j], want[j]) <= TOL, j
        assert min(np.abs(np.asarray(a)).max() for a in jax.tree.leaves(got[j])) > 0, j
    # each replica's input gradient is its half of the batch's, times 2 (the mean of 2 replicas)
    assert rel_err(np.asarray(out["g_x"]).reshape(x.shape) / 2, want_x) <= TOL


def two_stage_cnn_params(seed=0):
    """The CNN's four parts in two stages of different structures: stem + down, pool + head."""
    p = cnn_params(seed)
    return [{"stem": p[0], "down": p[1]}, {"pool": p[2], "head": p[3]}]


CNN2 = pipeline.sequential(
    [lambda p, x: down(p["down"], stem(p["stem"], x)),
     lambda p, x: head(p["head"], pool_mlp(p["pool"], x))],
    two_stage_cnn_params(),
)  # fmt: skip
CNN4_V2 = pipeline.sequential([stem, down, pool_mlp, head], cnn_params(), repeats=2)
THREE_D = {"data": 2, "stage": 2, "model": 2}
ALL_SCHEDULES = {**SCHEDULES, "circular": pipeline.Circular(repeats=2),
                 "interleaved": pipeline.Interleaved1F1B(repeats=2)}  # fmt: skip


def _three_sgd_steps(name, remat, mesh):
    """Three SGD steps of a CNN whose stages differ, on ``mesh``, against one device. One stage
    per device: the CNN's four stages on a 4-stage mesh, or two stages of different structures
    (stem + down, pool + head) on a 2-stage mesh. Circular and Interleaved1F1B run the four
    stages as two virtual stages on each of 2 devices ({"data": 2, "stage": 4} becomes
    {"data": 2, "stage": 2}; the 8-stage models below cover 4 devices)."""
    schedule = ALL_SCHEDULES[name]
    k = mesh["stage"]
    if schedule.repeats > 1:
        model, params = CNN4_V2, cnn_params()
        mesh = {**mesh, "stage": 2} if k == 4 else mesh
    else:
        model, params = (CNN, cnn_params()) if k == 4 else (CNN2, two_stage_cnn_params())
    repl = make_repl(mesh)
    tx = optax.sgd(0.1)
    wrapped = repl.wrap_optimizer(tx)
    f = pipeline.value_and_grad(
        model, cross_entropy, num_microbatches=4, schedule=schedule, remat=remat
    )

    def step(state, x, t):
        loss, (g, _, _) = f(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
        return new, {"loss": rp.all_reduce(loss, "mean")}

    packed = repl.place(model.pack(params), pipeline.stage_spec(schedule.repeats))
    state = {"params": packed, "opt": wrapped.init(packed)}
    want, opt = params, tx.init(params)
    for i in range(3):
        x, t = cnn_batch(seed=10 + i)
        state, out = repl.run(step, state, x, t)
        want_loss, g = jax.value_and_grad(
            lambda p, x=x, t=t: cross_entropy(None, model.run(p, x), t)
        )(want)
        assert rel_err(out["loss"], np.full(repl.num_replicas, want_loss)) <= TOL
        updates, opt = tx.update(g, opt, want)
        want = optax.apply_updates(want, updates)
    got = model.unpack(jax.tree.map(np.asarray, state["params"]))
    assert rel_err(got, want) <= TOL
    assert rel_err(got, params) > 1e-3  # training moved them


@pytest.mark.parametrize("name", ["1f1b", "zb"])
@pytest.mark.slow  # 6.6 s
def test_cnn_three_sgd_steps_of_dp_x_pp_equal_single_device_training(name):
    _three_sgd_steps(name, True, MESH)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, remat, mesh",
    pairwise(
        name=list(ALL_SCHEDULES),
        remat=["none", "full", "dots"],
        mesh={"2x4": MESH, "2x2x2": THREE_D},
    ),
)
def test_stages_that_differ_train_as_on_one_device_under_every_schedule_and_policy(
    name, remat, mesh
):
    """Stages of different structures and shapes, every schedule and remat policy, on
    {"data": 2, "stage": 4} and on {"data": 2, "stage": 2, "model": 2} (the stages replicated
    over ``model``): losses and parameters after 3 SGD steps equal one device's."""
    _three_sgd_steps(name, remat, mesh)


def test_without_a_stage_axis_the_call_is_the_model_run_stage_after_stage():
    params = cnn_params()
    x, t = cnn_batch()
    f = pipeline.value_and_grad(CNN, cross_entropy, num_microbatches=4)
    loss, (g, _, _) = jax.jit(f)(CNN.pack(params), x, t)
    want_loss, want = jax.value_and_grad(lambda p: cross_entropy(None, CNN.run(p, x), t))(params)
    assert rel_err(loss, want_loss) <= TOL
    assert rel_err(CNN.unpack(g), want) <= TOL
    y = pipeline.apply(CNN, num_microbatches=2)(CNN.pack(params), x)
    assert rel_err(y, CNN.run(params, x)) <= TOL


def test_apply_on_the_mesh_returns_the_last_stages_output():
    repl = make_repl()
    params = cnn_params()
    x, _ = cnn_batch()
    f = pipeline.apply(CNN, num_microbatches=4)
    packed = repl.place(CNN.pack(params), pipeline.stage_spec())
    _, out = repl.run(lambda s, x: (s, {"y": rp.all_gather(f(s, x))}), packed, x)
    assert rel_err(np.asarray(out["y"])[0].reshape(16, 10), CNN.run(params, x)) <= TOL


# -- 8 logical stages on 4 devices: Circular and Interleaved1F1B ------------------------------

VIRTUAL = {"circular": pipeline.Circular(repeats=2), "interleaved": pipeline.Interleaved1F1B(2)}
VIRTUAL_CASES = [
    (name, r) for name in ("circular", "interleaved") for r in ("none", "full", "dots")
]


@pytest.mark.parametrize("name, remat", VIRTUAL_CASES)
@pytest.mark.slow
def test_eight_stages_of_different_widths_on_four_devices(name, remat):
    widths = [5, 7, 3, 9, 4, 6, 8, 2, 3]
    r = np.random.default_rng(3)
    params = [
        {
            "w": (r.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "b": r.normal(size=b).astype(np.float32),
        }
        for a, b in itertools.pairwise(widths)
    ]
    model = pipeline.sequential([lambda p, x: jnp.tanh(x @ p["w"] + p["b"])] * 8, params, repeats=2)
    x = r.normal(size=(16, 5)).astype(np.float32)
    t = r.normal(size=(16, 3)).astype(np.float32)

    def mse(_, y, t):
        return jnp.mean((y - t) ** 2)

    f = pipeline.value_and_grad(model, mse, num_microbatches=4, schedule=VIRTUAL[name], remat=remat)

    repl = make_repl()
    packed = repl.place(model.pack(params), pipeline.stage_spec(2))
    state, out = repl.run(grads_in_state(f), {"params": packed, "grads": packed}, x, t)
    want_loss, want = jax.value_and_grad(lambda p: mse(None, model.run(p, x), t))(params)
    assert rel_err(out["loss"], np.full(2, want_loss)) <= TOL
    assert rel_err(model.unpack(jax.tree.map(np.asarray, state["grads"])), want) <= TOL


def mix(p, x):  # [b, 4, 4, 16] -> [b, 4, 4, 16]
    return x + jnp.tanh(conv(x, p["w"])) * p["scale"]


def dense(p, x):  # [b, 32] -> [b, 32]
    return jnp.tanh(x @ p["w"] + p["b"])


def cnn8_params(seed=2):
    """The CNN's four stages with two more of each shape: 8 stages, 2 per device. Device 0 runs
    the stem (virtual stage 0) and pool_mlp (1), device 3 a conv block and the head."""
    r = np.random.default_rng(seed)

    def n(*shape):
        return (r.normal(size=shape) / np.sqrt(np.prod(shape[:-1]))).astype(np.float32)

    stem_p, down_p, pool_p, head_p = cnn_params(seed)
    mixes = [{"w": n(3, 3, 16, 16), "scale": np.float32(0.7 - 0.2 * i)} for i in range(2)]
    denses = [{"w": n(32, 32), "b": n(32)} for _ in range(2)]
    return [stem_p, down_p, *mixes, pool_p, *denses, head_p]


CNN8 = pipeline.sequential(
    [stem, down, mix, mix, pool_mlp, dense, dense, head], cnn8_params(), repeats=2
)


@pytest.mark.parametrize("name, remat", VIRTUAL_CASES)
@pytest.mark.slow
def test_cnn_of_eight_stages_loss_and_every_gradient_equal_the_model_on_one_device(name, remat):
    """Eight stages of different functions, parameters and shapes, two per device, each device's
    two of different shapes: the loss, every stage's gradient and the input gradient equal the
    model on one device under each remat policy."""
    repl = make_repl()
    params = cnn8_params()
    x, t = cnn_batch()

    def oracle(params, x):
        return cross_entropy(None, CNN8.run(params, x), t)

    want_loss, (want, want_x) = jax.value_and_grad(oracle, argnums=(0, 1))(params, x)
    packed = repl.place(CNN8.pack(params), pipeline.stage_spec(2))
    state = {"params": packed, "grads": jax.tree.map(jnp.zeros_like, packed)}
    state, out = repl.run(pipeline_step(CNN8, VIRTUAL[name], 4, remat), state, x, t)
    got = CNN8.unpack(jax.tree.map(np.asarray, state["grads"]))
    assert rel_err(out["loss"], np.full(2, want_loss)) <= TOL
    for j in range(8):
        assert rel_err(got[j], want[j]) <= TOL, j
        assert min(np.abs(np.asarray(a)).max() for a in jax.tree.leaves(got[j])) > 0, j
    assert rel_err(np.asarray(out["g_x"]).reshape(x.shape) / 2, want_x) <= TOL


# -- the GPT split 2/1/1/2 by balance, with the embedding and the head as stages ---------------

CONFIG = gpt.GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=4, num_layers=4)


def gpt_layers():
    p = gpt.init(CONFIG, jax.random.key(0))
    blocks = [jax.tree.map(lambda a, i=i: a[i], p["blocks"]) for i in range(CONFIG.num_layers)]
    block = lambda q, x: gpt.block(q, x, config=CONFIG)
    fns = [gpt.embed, *[block] * CONFIG.num_layers, gpt.head_logits]
    return fns, [p["embed"], *blocks, p["head"]]


def token_loss(_, logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@pytest.mark.parametrize("name", ["1f1b", "zb"])  # GPipe: the CNN above
@pytest.mark.slow
def test_gpt_split_two_one_one_two_by_balance_equals_one_device(name):
    fns, layer_params = gpt_layers()
    tokens = np.random.default_rng(4).integers(0, 64, size=(16, 16)).astype(np.int32)
    costs = pipeline.layer_costs(fns, tokens[:2], params=layer_params)
    split = pipeline.balance(costs, num_stages=4)
    assert split.sizes == (2, 1, 1, 2)  # embedding + block, block, block, block + head
    stage_fns, stage_params = pipeline.stages_from_layers(fns, layer_params, split)
    model = pipeline.sequential(stage_fns, stage_params)
    targets = np.roll(tokens, -1, axis=1)

    def oracle(params):
        return token_loss(None, model.run(params, tokens), targets)

    want_loss, want = jax.value_and_grad(oracle)(stage_params)
    repl = make_repl()
    packed = repl.place(model.pack(stage_params), pipeline.stage_spec())
    f = pipeline.value_and_grad(model, token_loss, num_microbatches=4, schedule=SCHEDULES[name])

    state, out = repl.run(grads_in_state(f), {"params": packed, "grads": packed}, tokens, targets)
    assert rel_err(out["loss"], np.full(2, want_loss)) <= TOL
    assert rel_err(model.unpack(jax.tree.map(np.asarray, state["grads"])), want) <= TOL


# -- what is refused ----------------------------------------------------------------------------


def test_sequential_refuses_bad_models_with_the_fix():
    with pytest.raises(
        ValueError, match=r"params must be a list with one parameter tree per stage; got 3 for 4"
    ):
        pipeline.sequential([stem, down, pool_mlp, head], cnn_params()[:3])
    with pytest.raises(ValueError, match=r"4 stages do not split into repeats=3"):
        pipeline.sequential([stem, down, pool_mlp, head], cnn_params(), repeats=3)
    with pytest.raises(ValueError, match=r"params\[1\]\['ids'\] is int32.*must be floating"):
        pipeline.sequential([stem, down], [cnn_params()[0], {"ids": np.zeros(3, np.int32)}])
    with pytest.raises(ValueError, match=r"params\[2\] is .* but the model was built with"):
        CNN.pack([*cnn_params()[:2], {"w": np.zeros((3, 3))}, cnn_params()[3]])


def test_a_model_that_does_not_fit_the_mesh_or_its_inputs_is_refused_before_a_step():
    repl = make_repl({"data": 4, "stage": 2})
    packed = repl.place(CNN.pack(cnn_params()), pipeline.stage_spec())
    f = pipeline.value_and_grad(CNN, cross_entropy, num_microbatches=2)
    x, t = cnn_batch()
    with pytest.raises(
        ValueError, match=r"4 stages = 4 per repeat, but the mesh's 'stage' axis has 2"
    ):
        repl.run(lambda s, x, t: (s, {"l": f(s, x, t)[0]}), packed, x, t)
    g = pipeline.value_and_grad(CNN, cross_entropy, num_microbatches=2)
    with pytest.raises(
        ValueError,
        match=r"stage 0 \(stem\) fails on its input float32\[8, 8, 8, 2\] \(the inputs\)",
    ):
        jax.eval_shape(g, CNN.pack(cnn_params()), x[:, :, :, :2], t)
    with pytest.raises(ValueError, match=r"stage_params must be its packed parameters"):
        jax.eval_shape(g, cnn_params(), x, t)
    wide = [
        *cnn_params()[:3],
        {"w": np.zeros((32, 200), np.float32), "b": np.zeros(200, np.float32)},
    ]
    other = pipeline.sequential([stem, down, pool_mlp, head], wide)
    with pytest.raises(
        ValueError,
        match=r"stage_params\['float32'\] has shape \(4, 6600\), but this model packs each stage into rows of 3457",
    ):
        jax.eval_shape(g, other.pack(wide), x, t)
    with pytest.raises(
        ValueError, match=r"unpack: packed\['float32'\] has shape \(4, 6600\).*rows of 3457"
    ):
        CNN.unpack(other.pack(wide))
    with pytest.raises(ValueError, match=r"built with repeats=1 but the schedule runs 2"):
        jax.eval_shape(
            pipeline.value_and_grad(CNN, cross_entropy, num_microbatches=4, schedule="circular"),
            CNN.pack(cnn_params()), x, t,
        )  # fmt: skip


def test_explain_reports_the_padding_and_the_packed_activation_sent_each_tick():
    repl = make_repl()
    packed = repl.place(CNN.pack(cnn_params()), pipeline.stage_spec())
    f = pipeline.value_and_grad(CNN, cross_entropy, num_microbatches=4, schedule="1f1b")
    report = repl.explain(grads_in_state(f), {"params": packed, "grads": packed}, *cnn_batch())
    (note,) = report.pipelines
    # one micro-batch is 2 examples on each replica; the widest boundary is the stem's output
    assert note.activation_bytes == 4 * 2 * 8 * 8 * 8
    sizes = [224, 1152 + 2304 + 1, 16 * 32 + 32 + 32 * 32, 32 * 10 + 10]  # parameters per stage
    padding = 4 * (4 * max(sizes) - sum(sizes))
    assert f"parameters {4 * max(sizes):,} bytes per stage row" in note.padding
    assert f"of which {padding:,} bytes padding over all 4 stages" in note.padding
    assert "activations 4,096 bytes per micro-batch (boundaries use 80-4,096)" in note.padding
    assert " ".join(note.padding.split()) in " ".join(str(report).split())
    plan = pipeline.OneFOneB().timetable(4, 4)
    assert report.bytes_by(kind="collective-permute") == 2 * plan.num_ticks * 4096


def test_python_scalars_and_integer_inputs_pack_exactly():
    table = np.arange(12.0, dtype=np.float32).reshape(6, 2)
    params = [{"table": table, "s": 2.0}, np.eye(2, dtype=np.float32)]
    model = pipeline.sequential(
        [lambda p, x: p["table"][x["ids"]] * p["s"], lambda p, y: y @ p], params
    )
    packed = model.pack(params)
    assert packed["float32"].shape == (2, 13)
    assert model.unpack(packed)[0]["s"] == 2.0
    ids = np.array([[5, 0], [3, 2]], np.int32)
    y = pipeline.apply(model, num_microbatches=2)(packed, {"ids": ids})
    assert np.array_equal(y, table[ids] * 2)


def test_a_stage_that_pools_over_the_batch_is_refused():
    """Micro-batching would change what it computes: the pipeline would differ from one device."""
    p = [np.eye(4, dtype=np.float32), np.ones((4, 2), np.float32)]
    model = pipeline.sequential([lambda w, x: jnp.tanh(x @ w).mean(0), lambda w, h: h @ w], p)
    f = pipeline.value_and_grad(model, lambda _, y, t: jnp.mean((y - t) ** 2), num_microbatches=2)
    x = np.ones((8, 4), np.float32)
    with pytest.raises(ValueError, match=r"stage 0 returns .*float32\[4\].*leading axis"):
        f(model.pack(p), x, np.ones((8, 2), np.float32))


# -- stages made of runs of layers: one step per layer ---------------------------------------


def runs_model():
    """An input projection, six tanh layers and an output projection, split 3/2/1/2: runs of
    two layers (scanned) and single layers (plain) next to the projections."""
    rng = np.random.default_rng(5)
    fns = [lambda w, x: x @ w] + [lambda w, x: jnp.tanh(x @ w)] * 6 + [lambda w, x: x @ w]
    fns[-1] = fns[0]
    shapes = [(3, 4)] + [(4, 4)] * 6 + [(4, 2)]
    params = [(rng.normal(size=s) / 2).astype(np.float32) for s in shapes]
    return pipeline.stages_from_layers(fns, params, (3, 2, 1, 2))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb", "none"])
@pytest.mark.slow
def test_runs_of_layers_step_one_layer_per_iteration_and_equal_one_device(name):
    stage_fns, stage_params = runs_model()
    model = pipeline.sequential(stage_fns, stage_params)
    assert model.params_layout.lv == 3  # stage 0: the projection, then its run's two layers
    rng = np.random.default_rng(6)
    x, t = rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    loss = lambda _, y, t: jnp.mean((y - t) ** 2)
    want_loss, want = jax.value_and_grad(lambda p: loss(None, model.run(p, x), t))(stage_params)
    if name == "none":
        repl, spec = make_repl({"data": 2}), None
    else:
        repl, spec = make_repl(), pipeline.stage_spec()
    packed = model.pack(stage_params)
    packed = repl.replicate(packed) if spec is None else repl.place(packed, spec)
    kw = {} if name == "none" else {"schedule": SCHEDULES[name]}
    f = pipeline.value_and_grad(model, loss, num_microbatches=4, **kw)
    state, out = repl.run(grads_in_state(f), {"params": packed, "grads": packed}, x, t)
    assert rel_err(out["loss"], np.full(2, want_loss)) <= TOL
    assert rel_err(model.unpack(jax.tree.map(np.asarray, state["grads"])), want) <= TOL
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(model.unpack(model.pack(stage_params))), jax.tree.leaves(stage_params)
    ))  # fmt: skip


def test_steps_that_compute_the_same_share_one_branch_of_the_program():
    """One function on parameters, inputs and outputs of one layout is compiled once, not per
    stage or per layer: the program is the same whatever the number of layers per stage."""
    mm = lambda w, x: jnp.tanh(x @ w)
    w4, w8 = np.eye(4, dtype=np.float32), np.ones((4, 8), np.float32)
    x = np.ones((2, 4), np.float32)

    def table(fns, params):
        model = pipeline.sequential(fns, params)
        return model.params_layout._branches(model.wire(x))[0].tolist()  # 0: passes x on

    assert table([mm, mm, mm, mm], [w4, w4, w4, w8]) == [[1], [1], [1], [2]]
    assert table([mm, lambda w, x: jnp.tanh(x @ w)], [w4, w4]) == [[1], [2]]  # another object
    fns, ps = pipeline.stages_from_layers(mm, [w4] * 6, (2, 2, 1, 1))  # runs, then plain layers
    assert table(fns, ps) == [[1, 1], [1, 1], [2, 0], [2, 0]]
    fns, ps = pipeline.stages_from_layers(mm, [w4] * 20, (4, 16))
    assert table(fns, ps) == [[1] * 4 + [0] * 12, [1] * 16]
