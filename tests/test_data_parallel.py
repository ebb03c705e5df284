"""Oracle tests: data-parallel training equals one device with the full global batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cases import pairwise
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from oracle import OPTIMIZERS, batches, make, params_of, rel_err, single_device

import replicator as rp

MESHES = {
    "data8": {"data": 8},
    "dcn2xdata4": {"dcn_data": 2, "data": 4},
    "data4xmodel2": {"data": 4, "model": 2},
}


def train(repl, model, opt, data):
    tx = repl.wrap_optimizer(OPTIMIZERS[opt]())
    with repl.context():
        state, step = make(model, tx)
        state = repl.replicate(state)
    losses = []
    for batch in data:
        state, out = repl.run(step, state, batch)
        losses.append(np.asarray(out["loss"]))
    return state, losses


@pytest.mark.parametrize(
    "lowering, model, opt",
    pairwise(lowering=["shard_map", "pmap"], model=["mlp", "nnx"], opt=["sgd", "adam"]),
)
@pytest.mark.slow
def test_oracle_ten_steps(lowering, model, opt):
    data = batches()
    expected, expected_losses = single_device(model, OPTIMIZERS[opt](), data)
    repl = rp.Replicator(mesh_shape={"data": -1}, lowering=lowering)
    assert repl.num_replicas == 8
    state, losses = train(repl, model, opt, data)
    assert rel_err(params_of(state), params_of(expected)) <= 1e-5
    for got, want in zip(losses, expected_losses):
        assert got.shape == (8,)
        np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_oracle_other_meshes(mesh):
    data = batches()
    expected, _ = single_device("mlp", optax.sgd(0.1), data)
    repl = rp.Replicator(mesh_shape=MESHES[mesh])
    state, losses = train(repl, "mlp", "sgd", data)
    assert losses[0].shape == (repl.num_replicas,)
    assert rel_err(params_of(state), params_of(expected)) <= 1e-5


@pytest.mark.parametrize("model", ["mlp", "nnx"])
def test_local_lowering_runs_the_same_step_fn(model):
    data = batches(n=3)
    expected, _ = single_device(model, optax.sgd(0.1), data)
    repl = rp.Replicator(lowering="local")
    assert repl.num_replicas == 1
    state, losses = train(repl, model, "sgd", data)
    assert losses[0].shape == (1,)
    assert rel_err(params_of(state), params_of(expected)) <= 1e-5


def summing_optimizer(tx):
    """The bug the oracle must catch: gradients summed over replicas instead of averaged."""

    def update(grads, state, params=None):
        return tx.update(rp.all_reduce(grads, "sum"), state, params)

    return optax.GradientTransformation(tx.init, update)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_sum_instead_of_mean_fails_the_oracle(opt):
    data = batches()
    expected, _ = single_device("mlp", OPTIMIZERS[opt](), data)
    repl = rp.Replicator()
    with repl.context():
        state, step = make("mlp", summing_optimizer(OPTIMIZERS[opt]()))
        state = repl.replicate(state)
    for batch in data:
        state, _ = repl.run(step, state, batch)
    err = rel_err(params_of(state), params_of(expected))
    if opt == "sgd":
        assert err > 1e-1  # SGD shows a factor of 8 at once
    else:
        # Adam is nearly scale-invariant: the same bug moves it by about 1e-6 relative here, inside
        # the oracle's tolerance. That is why every oracle test above also runs SGD.
        assert err < 1e-3


def test_no_reduction_diverges_and_check_replicas_names_the_leaf():
    data = batches(n=2)
    repl = rp.Replicator(check_replicas=True)
    state, step = make("mlp", optax.sgd(0.1))  # plain optax: local gradients applied as they are
    state = repl.replicate(state)
    with pytest.raises(
        rp.ReplicasDivergedError, match=r"state leaf \.params\[0\]\['b'\] differs"
    ) as info:
        repl.run(step, state, data[0])
    assert "repl.wrap_optimizer" in str(info.value)
    assert info.value.state.step == 1  # nothing is lost: the new state rides on the error
    assert info.value.outputs["loss"].shape == (8,)


def test_check_replicas_passes_with_wrapped_optimizer():
    data = batches(n=3)
    repl = rp.Replicator(check_replicas=True)
    state, _ = train(repl, "mlp", "adam", data)
    assert int(state.step) == 3


def counting(step_fn):
    """``step_fn`` that counts how often it is traced (once per compiled program)."""

    def step(state, *args):
        step.traces += 1
        return step_fn(state, *args)

    step.traces = 0
    return step


@pytest.mark.parametrize("lowering", ["shard_map", "pmap"])
def test_default_check_catches_a_missing_reduction_at_the_first_run(lowering):
    data = batches(n=2)
    repl = rp.Replicator(mesh_shape={"data": 8}, lowering=lowering)  # the default check
    state, step = make("mlp", optax.sgd(0.1))  # plain optax: local gradients applied as they are
    state = repl.replicate(state)
    step = counting(step)
    with pytest.raises(
        rp.ReplicasDivergedError, match=r"state leaf \.params\[0\]\['b'\] differs"
    ) as info:
        repl.run(step, state, data[0])
    message = str(info.value)
    assert "repl.wrap_optimizer" in message
    assert "check_replicas=False" in message  # how to turn the default check off
    assert info.value.path == ".params[0]['b']"
    assert info.value.state.step == 1 and info.value.outputs["loss"].shape == (8,)
    assert step.traces == 1  # the step was not recompiled to check it


@pytest.mark.parametrize("lowering", ["shard_map", "pmap"])
def test_default_check_passes_with_wrapped_optimizer_and_compiles_the_step_once(lowering):
    data = batches(n=5)
    expected, _ = single_device("mlp", optax.sgd(0.1), data)
    repl = rp.Replicator(lowering=lowering)
    tx = repl.wrap_optimizer(optax.sgd(0.1))
    state, step = make("mlp", tx)
    state, step = repl.replicate(state), counting(step)
    for batch in data:
        state, _ = repl.run(step, state, batch)
    assert int(state.step) == 5 and step.traces == 1
    assert rel_err(params_of(state), params_of(expected)) <= 1e-5


def drifting_from(run):
    """A step whose replicated leaf ``w`` starts to differ across replicas at step ``run``."""

    def step(state, x):
        t = state["t"] + 1
        w = state["w"] + jnp.where(t >= run, rp.replica_id().astype(jnp.float32), 0.0)
        return {"t": t, "w": w}, {"t": rp.all_reduce(t, "max")}

    return step


def run_steps(repl, step, n):
    state = repl.replicate({"t": jnp.int32(0), "w": jnp.zeros(3, jnp.float32)})
    for _ in range(n):
        state, _ = repl.run(step, state, np.ones(8, np.float32))
    return state


@pytest.mark.parametrize(
    ("check_replicas", "caught_at"),
    [(None, None), (2, None), (3, 3), (5, 3), (True, 3), (0, None), (False, None)],
)
def test_check_replicas_checks_the_first_n_runs_of_each_step(check_replicas, caught_at):
    """check_replicas=n checks after each of the first n runs of each compiled step, and then
    no more; the default (None) is n=2, True checks every run inside the step, False never."""
    if check_replicas is None:
        repl = rp.Replicator()
    else:
        repl = rp.Replicator(check_replicas=check_replicas)
    step = counting(drifting_from(3))
    if caught_at is None:
        state = run_steps(repl, step, 5)  # not caught: after the checked runs, replicas drift
        assert int(state["t"]) == 5
    else:
        with pytest.raises(rp.ReplicasDivergedError, match=r"state leaf \['w'\] differs") as info:
            run_steps(repl, step, 5)
        assert int(info.value.state["t"]) == caught_at
        assert info.value.path == "['w']"
    assert step.traces == 1


def test_the_first_runs_are_counted_per_compiled_step():
    repl = rp.Replicator()
    state = run_steps(repl, drifting_from(10), 4)  # two checked runs, then unchecked ones
    with pytest.raises(rp.ReplicasDivergedError, match=r"\['w'\]") as info:
        repl.run(drifting_from(1), state, np.ones(8, np.float32))  # a new step: checked again
    assert int(info.value.state["t"]) == 5


@pytest.mark.parametrize("check_replicas", [None, True])
def test_the_check_covers_keys_complex_and_stage_blocks(check_replicas):
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 4}, check_replicas=check_replicas)
    stage = NamedSharding(repl.mesh, P("stage"))
    state = {
        "key": repl.replicate(jax.random.key(0)),
        "z": repl.replicate(jnp.ones(2, jnp.complex64)),
        "w": jax.device_put(np.ones((4, 3), np.float32), stage),  # one block per stage
    }

    def fine(state, x):
        return {**state, "z": state["z"] * 1j, "w": state["w"] + rp.all_reduce(x.sum(), "sum")}, {}

    state, _ = repl.run(fine, state, np.ones(8, np.float32))
    state, _ = repl.run(fine, state, np.ones(8, np.float32))
    np.testing.assert_array_equal(state["w"], np.full((4, 3), 17.0))

    def per_replica_key(state, x):  # a key folded with the replica id, kept as replicated
        return {**state, "key": jax.random.fold_in(state["key"], rp.replica_id())}, {}

    with pytest.raises(rp.ReplicasDivergedError, match=r"state leaf \['key'\] differs") as info:
        repl.run(per_replica_key, state, np.ones(8, np.float32))
    state = info.value.state  # the state passed in was donated

    def last_block_drifts(state, x):  # replicas differ in the last stage's block only
        last = jax.lax.axis_index("stage") == 3
        return {**state, "w": state["w"] + jnp.where(last, rp.replica_id(), 0)}, {}

    state = {**state, "key": repl.replicate(jax.random.key(0))}
    with pytest.raises(rp.ReplicasDivergedError, match=r"state leaf \['w'\] differs"):
        repl.run(last_block_drifts, state, np.ones(8, np.float32))


def test_default_check_skips_leaves_sharded_over_the_replicas():
    repl = rp.Replicator()
    state = {"shard": jax.device_put(np.zeros(8, np.float32), NamedSharding(repl.mesh, P("data")))}

    def step(state, x):  # each replica writes its own slice: nothing to compare
        return {"shard": state["shard"] + rp.replica_id().astype(jnp.float32)}, {}

    state, _ = repl.run(step, state, np.ones(8, np.float32))
    np.testing.assert_array_equal(state["shard"], np.arange(8.0))


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, r"check_replicas must be True, False, None or an int >= 0; got -1"),
        (
            "first",
            TypeError,
            r"check_replicas must be True, False, None or an int >= 0; got 'first'",
        ),
        (2.0, TypeError, r"got 2\.0"),
    ],
)
def test_check_replicas_is_validated(value, error, match):
    with pytest.raises(error, match=match):
        rp.Replicator(check_replicas=value)


def test_wrap_optimizer_rejects_non_optax():
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        rp.Replicator().wrap_optimizer(lambda g: g)


def test_jitted_oracle_is_not_vacuous():
    """The single-device oracle really trains: the loss falls and parameters move."""
    data = batches()
    state0, _ = make("mlp", optax.sgd(0.1))
    state, losses = single_device("mlp", optax.sgd(0.1), data)
    assert losses[-1] < losses[0]
    assert rel_err(params_of(state), params_of(state0)) > 1e-2
    assert jnp.all(jnp.isfinite(jnp.asarray(losses)))
