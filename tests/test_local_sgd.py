"""Local SGD / DiLoCo (`wrap_optimizer(local_steps=H)`) against one device.

The slices are emulated as an ordinary mesh axis: ``{dcn_data: 2, data: 4}`` on 8 CPU devices.
The one-device oracles: synchronous training for H = 1 (the issue's acceptance), and for H > 1
each worker's H steps on its own half of the batch, written out by hand, then the
outer step on the mean of their moves.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp

MESH = {"dcn_data": 2, "data": 4}
WORKERS, REPLICAS = 2, 8


def init_params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "w1": jax.random.normal(k1, (6, 16)) * 0.5,
        "b1": jax.random.normal(k2, (16,)) * 0.1,
        "w2": jax.random.normal(k3, (16, 3)) * 0.5,
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def data(steps, per_step, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(per_step, 6)).astype(np.float32),
            "y": rng.normal(size=(per_step, 3)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def train(repl, opt, batches, params=None):
    def step_fn(state, batch):
        p, o, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": p, "opt": o}, metrics

    with repl.context():
        params = repl.replicate(init_params() if params is None else params)
        state = {"params": params, "opt": opt.init(params)}
    losses = []
    for batch in batches:
        state, out = repl.run(step_fn, state, batch)
        losses.append(np.asarray(out["loss"]))
    return state, losses


def rel(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y)) for x, y in zip(a, b))


def one_device_sync(tx, batches):
    params, state = init_params(), tx.init(init_params())
    for batch in batches:
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def one_device_diloco(inner_tx, outer_tx, batches, H):
    """DiLoCo written out: worker w's replicas hold rows [w*B/2, (w+1)*B/2) of each inner
    batch (the batch is split over the replicas, dcn_data outermost); each worker steps alone
    on its rows' mean gradient, with its own inner state, then the outer step."""
    params = init_params()
    inner = [inner_tx.init(params) for _ in range(WORKERS)]
    outer = outer_tx.init(params)
    for batch in batches:
        per_replica = jax.tree.map(lambda a: a.reshape(REPLICAS, -1, *a.shape[1:]), batch)
        moved = []
        for w in range(WORKERS):
            mine = jax.tree.map(lambda a, w=w: a[w * 4 : (w + 1) * 4], per_replica)
            p = params
            for h in range(H):  # replica r's inner batch h: rows h*b/H.. of its own rows
                part = jax.tree.map(
                    lambda a, h=h: a.reshape(4, H, -1, *a.shape[2:])[:, h].reshape(
                        -1, *a.shape[2:]
                    ),
                    mine,
                )
                grads = jax.grad(loss_fn)(p, part)
                updates, inner[w] = inner_tx.update(grads, inner[w], p)
                p = optax.apply_updates(p, updates)
            moved.append(jax.tree.map(jnp.subtract, params, p))
        mean = jax.tree.map(lambda a, b: (a + b) / 2, *moved)
        updates, outer = outer_tx.update(mean, outer, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("inner", ["sgd", "momentum"])
def test_one_local_step_and_an_sgd_outer_step_is_synchronous_training(inner):
    """H = 1 with optax.sgd(1.0) outside equals the synchronous step over 5 steps (the
    inner optimizer linear in the gradients: the mean of the workers' moves is the move of
    the mean gradient)."""
    make = {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.1, momentum=0.9)}
    batches = data(5, 32)
    want = one_device_sync(make[inner](), batches)
    repl = rp.Replicator(mesh_shape=MESH)
    opt = repl.wrap_optimizer(make[inner](), local_steps=1, outer_optimizer=optax.sgd(1.0))
    state, losses = train(repl, opt, batches)
    assert rel(state["params"], want) <= 1e-5
    assert rel(state["params"], init_params()) > 1e-2  # it trained
    sync, sync_losses = train(repl, repl.wrap_optimizer(make[inner]()), batches)
    assert rel(state["params"], sync["params"]) <= 1e-5
    np.testing.assert_allclose(np.stack(losses), np.stack(sync_losses), rtol=1e-5)


@pytest.mark.parametrize("inner", ["adam", "momentum"])
def test_eight_local_steps_equal_each_worker_stepping_alone(inner):
    """H = 8, DiLoCo's Nesterov outer step, 3 outer steps: equal to the workers written out
    on one device, each with its own inner state (Adam's moments stay per worker)."""
    make = {"adam": lambda: optax.adam(1e-2), "momentum": lambda: optax.sgd(0.05, momentum=0.9)}
    H, batches = 8, data(3, 8 * 16)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    want = one_device_diloco(make[inner](), outer, batches, H)
    repl = rp.Replicator(mesh_shape=MESH)
    opt = repl.wrap_optimizer(make[inner](), local_steps=H)  # the default outer step
    state, losses = train(repl, opt, batches)
    assert rel(state["params"], want) <= 1e-5
    assert rel(state["params"], init_params()) > 1e-2
    # each worker's inner state is its own: row w is worker w's, and they differ
    rows = jax.tree.leaves(state["opt"].inner)
    assert all(r.shape[0] == WORKERS for r in rows)
    assert any(float(jnp.max(jnp.abs(r[0] - r[1]))) > 0 for r in rows if r.ndim > 1)
    assert len(losses) == 3 and losses[0].shape == (REPLICAS,)
    assert np.all(losses[0] == losses[0][0])  # the mean over inner steps and workers


def test_the_parameters_are_the_same_on_every_replica():
    repl = rp.Replicator(mesh_shape=MESH, check_replicas=True)
    opt = repl.wrap_optimizer(optax.adam(1e-2), local_steps=4)
    state, _ = train(repl, opt, data(2, 64))  # check_replicas raises on a drift
    for leaf in jax.tree.leaves(state["params"]):
        assert leaf.sharding.is_fully_replicated


def test_refusals_name_the_fix():
    repl = rp.Replicator(mesh_shape=MESH)
    with pytest.raises(ValueError, match="zero_stage=0"):
        repl.wrap_optimizer(optax.adam(1e-3), local_steps=4, zero_stage=1)
    with pytest.raises(ValueError, match="static loss_scale"):
        repl.wrap_optimizer(optax.adam(1e-3), local_steps=4, loss_scale="dynamic")
    with pytest.raises(ValueError, match="int >= 1"):
        repl.wrap_optimizer(optax.adam(1e-3), local_steps=0)
    with pytest.raises(ValueError, match="give zero_stage=1, 2 or 3"):  # not dropped
        repl.wrap_optimizer(optax.adam(1e-3), local_steps=4, zero_axes=("data",))
    with pytest.raises(TypeError, match="outer_optimizer"):
        repl.wrap_optimizer(optax.adam(1e-3), local_steps=2, outer_optimizer="sgd")
    opt = repl.wrap_optimizer(optax.sgd(0.1), local_steps=4)
    with pytest.raises(ValueError, match=r"call opt.step"):
        opt.update({}, None)
    with pytest.raises(ValueError, match="multiple of 4"):
        train(repl, opt, data(1, 8 * 6))  # 6 rows a replica: not 4 inner batches
    flat = rp.Replicator(mesh_shape={"data": 8})
    opt = flat.wrap_optimizer(optax.sgd(0.1), local_steps=2)
    with pytest.raises(ValueError, match="'dcn_data' axis"):
        train(flat, opt, data(1, 32))


@pytest.mark.slow  # three gpt jobs, about 11 s
def test_the_gpt_config_with_one_local_step_equals_synchronous_training():
    """``local_steps: 1`` with an outer SGD step of 1.0 and no momentum trains the gpt job as
    synchronous training does (SGD with momentum inside), and ``local_steps: 2`` does not: the
    keys reach the optimizer."""
    from test_cli_gpt_layouts import build_and_train, gpt_job

    mesh = {"dcn_data": 2, "data": 4}
    _, want = build_and_train(gpt_job(mesh))
    local = lambda **keys: dataclasses.replace(gpt_job(mesh), **keys)
    state, got = build_and_train(local(local_steps=1, outer_learning_rate=1.0, outer_momentum=0))
    assert rel(got, want) <= 1e-5
    assert state["job"]["opt"].inner is not None
    _, two = build_and_train(local(local_steps=2))
    assert rel(two, want) > 1e-4


@pytest.mark.parametrize(
    "keys, match",
    [
        ({"zero_stage": 1}, "zero_stage"),
        ({"offload_params": True}, "offload_params"),
        ({"model": {"kind": "cnn"}}, "model.kind='cnn'"),
        ({"local_steps": 0}, "local_steps"),
        ({"outer_momentum": -1.0}, "outer_momentum"),
    ],
)
def test_the_config_refuses_what_local_steps_does_not_take(keys, match):
    from replicator.cli.config import ModelConfig, TrainConfig

    kwargs = {"mesh": {"dcn_data": 2, "data": 4}, "local_steps": 4} | keys
    if "model" in kwargs:
        kwargs["model"] = ModelConfig(**kwargs["model"])
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)
