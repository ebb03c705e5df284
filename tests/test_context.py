"""Replicator.run: placement, outputs, compile cache, donation, errors; replicate; current()."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp


def test_outputs_are_stacked_and_reduced_rows_are_equal():
    repl = rp.Replicator()
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)

    def step(state, x):
        local = jnp.sum(x**2)
        return state, {"local": local, "mean": rp.all_reduce(local, "mean"), "vec": x[0]}

    _, out = repl.run(step, repl.replicate({}), x)
    per = (x.reshape(8, 2, 3) ** 2).sum(axis=(1, 2))
    np.testing.assert_allclose(out["local"], per, rtol=1e-6)
    np.testing.assert_allclose(out["mean"], np.full(8, per.mean()), rtol=1e-6)
    assert out["vec"].shape == (8, 3) and out["vec"].sharding.spec == P("data")


def test_compiles_once_over_twenty_calls():
    repl = rp.Replicator()
    traces = []

    def step(state, x):
        traces.append(1)
        return state + rp.all_reduce(jnp.sum(x), "sum"), {"s": jnp.sum(x)}

    state = repl.replicate(jnp.float32(0))
    batches = repl.distribute(lambda ctx: (np.full((16,), i, np.float32) for i in range(20)))
    for batch in batches:
        state, _ = repl.run(step, state, batch)
    assert len(traces) == 1
    assert float(state) == 16 * sum(range(20))


def test_state_keeps_its_sharding_and_is_donated():
    repl = rp.Replicator(mesh_shape={"data": 4, "model": 2})
    rows = NamedSharding(repl.mesh, P("model"))
    state = {"w": jax.device_put(jnp.ones((4, 3)), rows), "b": repl.replicate(jnp.zeros(3))}
    old = state["w"]

    def step(state, x):
        assert state["w"].shape == (4, 3)  # whole along `model`, which XLA partitions
        return jax.tree.map(lambda v: v + 1, state), {}

    new, out = repl.run(step, state, jnp.ones((8, 3)))
    assert new["w"].sharding == rows and new["b"].sharding.spec == P()
    np.testing.assert_array_equal(new["w"], 2 * np.ones((4, 3)))
    assert out == {}
    assert old.is_deleted()
    kept = rp.Replicator(donate=False)
    s = kept.replicate(jnp.zeros(3))
    kept.run(lambda s, x: (s + 1, None), s, jnp.ones((8,)))
    assert not s.is_deleted()


def test_arguments_placement():
    repl = rp.Replicator()
    seen = {}

    def step(state, batch, scale, table):
        seen.update(batch=batch.shape, scale=scale.shape, table=table.shape)
        return state, {"y": jnp.sum(batch) * scale + table[0]}

    table = repl.replicate(jnp.arange(5.0))
    _, out = repl.run(step, repl.replicate(jnp.zeros(())), np.ones((16, 2)), np.float32(2), table)
    assert seen == {"batch": (2, 2), "scale": (), "table": (5,)}
    np.testing.assert_allclose(out["y"], np.full(8, 8.0))


def test_argument_that_does_not_split():
    repl = rp.Replicator()
    with pytest.raises(
        ValueError,
        match=r"argument leaf args\[1\]\['k'\] of shape \(2,\) is taken as a global batch.*repl.replicate",
    ):
        repl.run(
            lambda s, b, o: (s, None),
            repl.replicate(jnp.zeros(())),
            np.ones((8,)),
            {"k": np.ones(2)},
        )


@pytest.mark.parametrize(
    "result,match",
    [
        (
            lambda s: s,
            r"must return a pair \(state, outputs\) of pytrees, but it returned a single array",
        ),
        (lambda s: (s, {}, 1), r"returned a tuple of length 3"),
        (
            lambda s: (s, {"name": "loss"}),
            r"output \['name'\] of step_fn .* is a str, not an array",
        ),
        (lambda s: (s, object()), r"output \(the outputs\) of step_fn .* is a object"),
        (lambda s: ({"w": s}, {}), r"returned a state whose structure differs"),
        (
            lambda s: (s.astype(jnp.int32), {}),
            r"changed state leaf  from float32\[3\] to int32\[3\].*astype\(float32\)",
        ),
    ],
)
@pytest.mark.parametrize("lowering", ["shard_map", "local"])
def test_step_fn_must_return_state_and_outputs(result, match, lowering):
    repl = rp.Replicator(lowering=lowering)
    with pytest.raises((TypeError, ValueError), match=match):
        repl.run(lambda s, x: result(s), repl.replicate(jnp.zeros(3)), np.ones((8,)))


def test_replicate_and_current():
    repl = rp.Replicator()
    assert rp.current() is None
    with repl.context() as entered:
        assert entered is repl and rp.current() is repl
        with rp.Replicator(lowering="local").context() as inner:
            assert rp.current() is inner
        assert rp.current() is repl
        assert rp.num_replicas() == 1  # entering a context does not bind the collectives
    assert rp.current() is None
    tree = repl.replicate({"a": np.ones(3), "n": 2})
    assert tree["a"].sharding == NamedSharding(repl.mesh, P())
    assert len(tree["a"].addressable_shards) == 8 and int(tree["n"]) == 2


def test_replica_axis_name_is_bound_during_tracing():
    names = []

    def step(state, x):
        names.append(rp.replica_axis_name())
        return state, None

    for shape, lowering in [
        ({"data": 8}, "shard_map"),
        ({"data": 8}, "pmap"),
        ({"dcn_data": 2, "data": 4}, "shard_map"),
        ({"data": 1}, "local"),
    ]:
        repl = rp.Replicator(
            mesh_shape=shape,
            lowering=lowering,
            devices=jax.devices()[: 8 if lowering != "local" else 1],
        )
        repl.run(step, repl.replicate(jnp.zeros(())), np.ones(8))
    assert names == ["data", "data", ("dcn_data", "data"), None]


def test_replicate_copies_so_donation_keeps_the_callers_arrays():
    repl = rp.Replicator()
    on_device0 = jnp.arange(3.0)  # jax.device_put would reuse this buffer for replica 0
    already = repl.replicate(jnp.ones(3))  # and return an array already in place as is
    state = repl.replicate({"a": on_device0, "b": already})
    new, _ = repl.run(lambda s, x: (jax.tree.map(lambda v: v + 1, s), None), state, np.ones(8))
    assert state["a"].is_deleted() and not on_device0.is_deleted() and not already.is_deleted()
    np.testing.assert_array_equal(on_device0, [0, 1, 2])
    np.testing.assert_array_equal(new["b"], 2 * np.ones(3))


def test_many_steps_without_blocking_complete():
    # XLA's CPU collectives deadlock when many 8-device programs are queued (jax 0.10.2); run()
    # bounds them there by default, and leaves them unbounded on jax 0.12, where they do not.
    from replicator._src.core import compat

    repl = rp.Replicator()
    bounded = repl._steps._max_in_flight
    assert bounded == 2 if compat.CPU_COLLECTIVES_HANG_WHEN_QUEUED else bounded > 10**6, bounded
    state = repl.replicate(jnp.zeros(()))
    x = jax.device_put(np.ones(64, np.float32), NamedSharding(repl.mesh, P("data")))
    step = lambda s, x: (s + rp.all_reduce(jnp.sum(x), "sum"), {"m": rp.all_reduce(x, "mean")})
    for _ in range(300):
        state, _ = repl.run(step, state, x)
    assert float(state) == 300 * 64


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_max_in_flight_is_checked(bad):
    with pytest.raises(ValueError, match=r"max_in_flight must be an int >= 1.*got"):
        rp.Replicator(max_in_flight=bad)


def test_lower_gives_the_program_without_running_it():
    repl = rp.Replicator()
    traces = []

    def step(state, x):
        traces.append(1)
        return state + rp.all_reduce(jnp.sum(x), "mean"), {"s": jnp.sum(x)}

    state = repl.replicate(jnp.ones(256))
    compiled = repl.lower(step, state, np.ones((16, 4), np.float32)).compile()
    assert not state.is_deleted()
    assert compiled.memory_analysis().argument_size_in_bytes >= 256 * 4
    assert "all-reduce" in compiled.as_text()
    new, _ = repl.run(step, state, np.ones((16, 4), np.float32))
    np.testing.assert_allclose(new, np.full(256, 1 + 8.0))
    with pytest.raises(ValueError, match=r"lowering='local' runs step_fn eagerly"):
        rp.Replicator(lowering="local").lower(step, jnp.zeros(()), np.ones(4))


def test_replicate_drops_weak_types_so_the_second_step_reuses_the_program():
    repl = rp.Replicator()
    traces = []

    def step(state, x):
        traces.append(1)
        return {"b": state["b"] + jnp.sum(x)}, {}

    state = repl.replicate({"b": jnp.full((3,), 0.1)})  # jnp.full with a float: weakly typed
    assert not state["b"].weak_type
    for _ in range(3):
        state, _ = repl.run(step, state, np.ones(8, np.float32))
    assert len(traces) == 1
