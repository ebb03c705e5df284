"""The wrapped optimizer's options: ZeRO-sharded state, global-norm clipping, compressed
all-reduce; each against optax on one device with the full batch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cases import pairwise
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from oracle import batches, rel_err, zero3_loss, zero3_params, zero_spec

import replicator as rp

STEPS = 5
SIZES = (16, 24, 5, 4)  # leaves [16, 24], [24], [24, 5] split over 8; [5], [5, 4], [4] whole


def init_params(seed=1):
    keys = jax.random.split(jax.random.key(seed), len(SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.full((b,), 0.1)}
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:])
    ]


def loss_fn(params, batch):
    x = batch["x"]
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        x = jnp.tanh(x) if i < len(params) - 1 else x
    return jnp.mean((x - batch["y"]) ** 2)


def oracle(tx, data):
    params, opt = init_params(), tx.init(init_params())
    step = jax.jit(lambda p, o, b: tx.update(jax.grad(loss_fn)(p, b), o, p))
    for batch in data:
        updates, opt = step(params, opt, batch)
        params = optax.apply_updates(params, updates)
    return params


def replicated_run(repl, tx, data, **options):
    wrapped = repl.wrap_optimizer(tx, **options)
    params = repl.replicate(init_params())
    state = {"params": params, "opt": wrapped.init(params)}

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = wrapped.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    for batch in data:
        state, _ = repl.run(step, state, batch)
    return state


OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.slow
def test_zero_stages_equal_single_device_training(zero_stage, opt):
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])
    repl = rp.Replicator()
    state = replicated_run(repl, OPTIMIZERS[opt](), data, zero_stage=zero_stage)
    want = oracle(OPTIMIZERS[opt](), data)
    assert rel_err(state["params"], want) <= 1e-5
    assert rel_err(state["params"], init_params()) > 1e-3  # it trained
    if zero_stage:
        mu = state["opt"].inner[0].mu if opt == "adam" else None
        tree = state["opt"].inner if mu is None else mu
        split = 0
        for leaf in jax.tree.leaves(tree):  # in the parameter's shape, its split axis 1/8
            if leaf.ndim:
                spec = zero_spec(leaf.shape)
                assert leaf.sharding.spec == spec, (leaf.shape, leaf.sharding.spec)
                shard = leaf.sharding.shard_shape(leaf.shape)
                assert {s.data.shape for s in leaf.addressable_shards} == {shard}
                split += spec != P()
        assert split == 3 * (2 if opt == "adam" else 0) // 2


@pytest.mark.parametrize("zero_stage", [0, 1])
@pytest.mark.slow  # 4.4 s
def test_clipping_is_by_the_global_norm_of_the_whole_gradient(zero_stage):
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])
    max_norm = 0.05
    first = jax.grad(loss_fn)(init_params(), data[0])
    assert float(optax.tree.norm(first)) > 4 * max_norm  # the clip is active
    repl = rp.Replicator()
    state = replicated_run(
        repl, optax.sgd(0.5), data, zero_stage=zero_stage, clip_global_norm=max_norm
    )
    want = oracle(optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(0.5)), data)
    assert rel_err(state["params"], want) <= 1e-5
    unclipped = oracle(optax.sgd(0.5), data)
    assert rel_err(state["params"], unclipped) > 1e-2


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_bf16_compressed_all_reduce(zero_stage):
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])
    repl = rp.Replicator()
    state = replicated_run(
        repl, optax.sgd(0.1), data, zero_stage=zero_stage, grad_dtype=jnp.bfloat16
    )
    want = oracle(optax.sgd(0.1), data)
    assert rel_err(state["params"], want) <= 1e-2  # bf16 keeps 8 bits of mantissa
    # The program sends the gradients in bf16: every all-reduce (ZeRO: reduce-scatter) of the
    # lowered HLO is bf16. (XLA:CPU then upcasts bf16 reductions to f32 when it compiles, as the
    # CPU has no bf16 arithmetic for them; TPU and GPU keep them in bf16.)
    wrapped = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=zero_stage, grad_dtype=jnp.bfloat16)
    params = repl.replicate(init_params())

    def step(state, batch):
        grads = jax.grad(loss_fn)(state["params"], batch)
        updates, opt = wrapped.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    lowered = repl.lower(step, {"params": params, "opt": wrapped.init(params)}, data[0])
    text = lowered.as_text(dialect="hlo")
    scattered = re.findall(r"= (\w+)\[[^=]*? reduce-scatter\(", text)
    reduced = re.findall(r"= (\w+)\[[^=]*? all-reduce\(", text)
    # one per gradient leaf: ZeRO reduce-scatters the 3 with an axis that divides by 8
    assert set(scattered + reduced) == {"bf16"}, (scattered, reduced)
    assert (len(scattered), len(reduced)) == ((3, 3) if zero_stage else (0, 6))


def test_errors():
    repl = rp.Replicator()
    with pytest.raises(
        ValueError, match=r"zero_stage=4 is not supported; use one of \(0, 1, 2, 3\)"
    ):
        repl.wrap_optimizer(optax.sgd(0.1), zero_stage=4)
    with pytest.raises(ValueError, match=r"clip_global_norm must be > 0"):
        repl.wrap_optimizer(optax.sgd(0.1), clip_global_norm=0.0)
    sharded = jax.device_put(jnp.ones((8, 2)), NamedSharding(repl.mesh, P("data")))
    with pytest.raises(ValueError, match=r"parameter \['w'\] is sharded as .*repl.replicate"):
        repl.wrap_optimizer(optax.adam(1e-3), zero_stage=1).init({"w": sharded})


def stepped_run(repl, tx, data, **options):
    opt = repl.wrap_optimizer(tx, **options)
    params = repl.replicate(init_params())
    state = {"params": params, "opt": opt.init(params)}
    traces = []

    def step(state, batch):
        traces.append(1)
        params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    history = []
    for batch in data:
        state, metrics = repl.run(step, state, batch)
        history.append(jax.tree.map(lambda m: np.asarray(m)[0], metrics))
    assert len(traces) == 1
    return state, history


@pytest.mark.parametrize(
    "zero_stage, accumulate_steps, opt",
    pairwise(zero_stage=[0, 1, 2], accumulate_steps=[1, 4], opt=list(OPTIMIZERS)),
)
@pytest.mark.slow
def test_accumulation_equals_one_big_batch(zero_stage, accumulate_steps, opt):
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])  # 64 examples: 8 per replica
    repl = rp.Replicator()
    state, history = stepped_run(
        repl, OPTIMIZERS[opt](), data, zero_stage=zero_stage, accumulate_steps=accumulate_steps
    )
    assert rel_err(state["params"], oracle(OPTIMIZERS[opt](), data)) <= 1e-5
    want_loss = float(loss_fn(init_params(), data[0]))
    assert abs(history[0]["loss"] - want_loss) <= 1e-5 * want_loss


def test_dynamic_loss_scaling_skips_non_finite_steps_and_recovers():
    data = batches(6, din=SIZES[0], dout=SIZES[-1])
    for i, batch in enumerate(data):
        batch["poison"] = np.full((64,), np.inf if i == 2 else 1.0, np.float32)
    poisoned_loss = lambda p, b: loss_fn(p, b) * jnp.mean(b["poison"])
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.sgd(0.1), loss_scale="dynamic", loss_scale_period=2)
    params = repl.replicate(init_params())
    state = {"params": params, "opt": opt.init(params)}

    def step(state, batch):
        params, opt_state, metrics = opt.step(poisoned_loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    history, before = [], None
    for i, batch in enumerate(data):
        if i == 2:
            before = jax.tree.map(np.asarray, state["params"])
        state, metrics = repl.run(step, state, batch)
        history.append({k: float(np.asarray(v)[0]) for k, v in metrics.items()})
        if i == 2:  # the step was skipped: parameters unchanged, the scale halved
            assert rel_err(state["params"], before) == 0
    scales = [h["loss_scale"] for h in history]
    assert scales == [2.0**15, 2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**16], scales
    assert [h["skipped"] for h in history] == [0, 0, 1, 1, 1, 1]
    # Training went on: the result equals SGD on the five clean batches.
    clean = [b for i, b in enumerate(data) if i != 2]
    assert rel_err(state["params"], oracle(optax.sgd(0.1), clean)) <= 1e-5


def test_step_errors():
    repl = rp.Replicator()
    with pytest.raises(ValueError, match=r"accumulate_steps must be an int >= 1; got 0"):
        repl.wrap_optimizer(optax.sgd(0.1), accumulate_steps=0)
    with pytest.raises(
        ValueError, match=r"loss_scale must be None, a positive number or 'dynamic'"
    ):
        repl.wrap_optimizer(optax.sgd(0.1), loss_scale="auto")
    opt = repl.wrap_optimizer(optax.sgd(0.1), accumulate_steps=3)
    params = repl.replicate(init_params())
    data = batches(1, din=SIZES[0], dout=SIZES[-1])

    def step(state, batch):
        params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    with pytest.raises(
        ValueError,
        match=r"batch leaf \['x'\] of shape \(8, 16\) does not split into accumulate_steps=3",
    ):
        repl.run(step, {"params": params, "opt": opt.init(params)}, data[0])


def test_bf16_compute_with_fp32_master_params():
    policy = rp.Policy(compute_dtype=jnp.bfloat16)
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(optax.sgd(0.1))
    params = repl.replicate(init_params())
    seen = []

    def step(state, batch):
        def loss(p, b):
            seen.append(policy.cast_to_compute(p)[0]["w"].dtype)
            return policy.apply(loss_fn)(p, b)

        params, opt_state, metrics = opt.step(loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    state = {"params": params, "opt": opt.init(params)}
    for batch in data:
        state, metrics = repl.run(step, state, batch)
    assert seen[0] == jnp.bfloat16 and metrics["loss"].dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(state["params"])} == {jnp.dtype("float32")}
    want = oracle(optax.sgd(0.1), data)
    err = rel_err(state["params"], want)
    assert 1e-6 < err <= 3e-2  # bf16 arithmetic: close to fp32 training, but not equal
    with pytest.raises(ValueError, match=r"compute_dtype must be a floating dtype; got int32"):
        rp.Policy(compute_dtype=jnp.int32)


# -- ZeRO-3: parameters stored sharded, gathered one layer at a time ---------------------------


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("accumulate_steps", [1, 4])
@pytest.mark.slow
def test_zero3_equals_single_device_training(accumulate_steps, opt):
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])
    repl = rp.Replicator()
    wrapped = repl.wrap_optimizer(
        OPTIMIZERS[opt](), zero_stage=3, accumulate_steps=accumulate_steps
    )
    params = wrapped.shard_params(zero3_params(), stacked=["layers"])
    w = params["layers"]["w"]  # [layers, 8, 8]: its first layer axis is split, per layer
    assert w.value.shape == (3, 8, 8) and w.value.sharding.spec == P(None, "data")
    assert {s.data.shape for s in w.value.addressable_shards} == {(3, 1, 8)}
    assert params["head"]["b"].dim is None  # [4]: no axis divides by 8, whole
    state = {"params": params, "opt": wrapped.init(params)}
    traces = []

    def step(state, batch):
        traces.append(1)
        params, opt_state, metrics = wrapped.step(zero3_loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    for batch in data:
        state, _ = repl.run(step, state, batch)
    assert len(traces) == 1

    tx = OPTIMIZERS[opt]()
    want, opt_state = zero3_params(), tx.init(zero3_params())
    for batch in data:
        updates, opt_state = tx.update(jax.grad(zero3_loss)(want, batch), opt_state, want)
        want = optax.apply_updates(want, updates)
    got = jax.device_get(rp.gather_params(state["params"]))  # outside any replicator: local
    assert rel_err(got, want) <= 1e-5
    assert rel_err(got, zero3_params()) > 1e-3


def test_zero3_errors():
    repl = rp.Replicator()
    with pytest.raises(ValueError, match=r"init got plain parameters.*opt.shard_params"):
        repl.wrap_optimizer(optax.sgd(0.1), zero_stage=3).init(zero3_params())
    with pytest.raises(ValueError, match=r"only with zero_stage=3"):
        repl.wrap_optimizer(optax.sgd(0.1), zero_stage=1).shard_params(zero3_params())
    with pytest.raises(ValueError, match=r"grad_dtype is not supported with zero_stage=3"):
        repl.wrap_optimizer(optax.sgd(0.1), zero_stage=3, grad_dtype=jnp.bfloat16)


@pytest.mark.slow  # 4.2 s
def test_zero3_with_clipping_loss_scaling_and_accumulation_equals_optax_on_one_device():
    data = batches(STEPS, din=SIZES[0], dout=SIZES[-1])
    repl = rp.Replicator()
    opt = repl.wrap_optimizer(
        optax.sgd(0.5),
        zero_stage=3,
        clip_global_norm=0.05,
        loss_scale="dynamic",
        accumulate_steps=2,
    )
    params = opt.shard_params(zero3_params(), stacked=["layers"])
    state = {"params": params, "opt": opt.init(params)}

    def step(state, batch):
        params, opt_state, metrics = opt.step(zero3_loss, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    for batch in data:
        state, metrics = repl.run(step, state, batch)
    assert float(metrics["grad_norm"][0]) > 4 * 0.05 and int(metrics["skipped"][0]) == 0
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))
    want, opt_state = zero3_params(), tx.init(zero3_params())
    for batch in data:
        updates, opt_state = tx.update(jax.grad(zero3_loss)(want, batch), opt_state, want)
        want = optax.apply_updates(want, updates)
    assert rel_err(jax.device_get(rp.gather_params(state["params"])), want) <= 1e-5
