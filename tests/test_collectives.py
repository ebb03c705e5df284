"""Placeholder collectives under each lowering, against NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp

N = 8
X = np.random.default_rng(0).normal(size=(N * 4, 3)).astype(np.float32)  # 4 rows per replica
PER = X.reshape(N, 4, 3)


def run_collective(lowering, fn):
    """Runs ``fn(local_rows)`` on every replica; returns its stacked outputs."""
    repl = rp.Replicator(lowering=lowering)
    _, out = repl.run(lambda s, x: (s, fn(x)), repl.replicate(jnp.zeros(())), X)
    return np.asarray(out)


LOWERINGS = ["shard_map", "pmap"]


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize(
    "op,reduce", [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min)]
)
def test_all_reduce(lowering, op, reduce):
    out = run_collective(lowering, lambda x: rp.all_reduce(x, op))
    np.testing.assert_allclose(out, np.broadcast_to(reduce(PER, axis=0), (N, 4, 3)), rtol=1e-6)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_all_reduce_pytree(lowering):
    out = run_collective(lowering, lambda x: rp.all_reduce({"a": x, "b": [x[0]]}, "sum")["b"][0])
    np.testing.assert_allclose(out, np.broadcast_to(PER[:, 0].sum(0), (N, 3)), rtol=1e-6)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_all_gather_stacked_and_tiled(lowering):
    out = run_collective(lowering, lambda x: rp.all_gather(x[0], axis=1))
    np.testing.assert_array_equal(out, np.broadcast_to(PER[:, 0].T[None], (N, 3, N)))
    out = run_collective(lowering, lambda x: rp.all_gather(x, tiled=True))
    np.testing.assert_array_equal(out, np.broadcast_to(X, (N, *X.shape)))


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter(lowering, op):
    data = np.arange(N * N * 2, dtype=np.float32).reshape(N, N * 2)  # replica r holds row r * (r+1)
    repl = rp.Replicator(lowering=lowering)

    def step(s, row):
        r = rp.replica_id().astype(jnp.float32)
        return s, rp.reduce_scatter(row[0] * (r + 1), op=op)

    _, out = repl.run(step, repl.replicate(jnp.zeros(())), data)
    total = (data * np.arange(1, N + 1)[:, None]).sum(0)
    if op == "mean":
        total = total / N
    np.testing.assert_allclose(np.asarray(out), total.reshape(N, 2), rtol=1e-6)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_broadcast_replica_id_num_replicas(lowering):
    out = run_collective(lowering, lambda x: rp.broadcast(x, source=3))
    np.testing.assert_array_equal(out, np.broadcast_to(PER[3], (N, 4, 3)))
    out = run_collective(lowering, lambda x: rp.broadcast(x[0, 0] > 0, source=5))
    np.testing.assert_array_equal(out, np.full(N, PER[5, 0, 0] > 0))
    out = run_collective(lowering, lambda x: rp.replica_id())
    np.testing.assert_array_equal(out, np.arange(N))
    out = run_collective(lowering, lambda x: jnp.int32(rp.num_replicas()))
    np.testing.assert_array_equal(out, np.full(N, N))


def test_outside_any_replicator_is_one_replica():
    x = jnp.arange(6.0).reshape(2, 3)
    for op in ("sum", "mean", "max", "min"):
        np.testing.assert_array_equal(rp.all_reduce(x, op), x)
    assert rp.all_gather(x).shape == (1, 2, 3)
    assert rp.all_gather(x, axis=2).shape == (2, 3, 1)
    np.testing.assert_array_equal(rp.all_gather(x, tiled=True), x)
    np.testing.assert_array_equal(rp.reduce_scatter(x), x)
    np.testing.assert_array_equal(rp.broadcast(x), x)
    assert int(rp.replica_id()) == 0 and rp.num_replicas() == 1
    assert rp.replica_axis_name() is None


def test_unknown_op_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"op='avg' is not a reduction; use one of 'sum', 'mean'"):
        rp.all_reduce(jnp.ones(2), "avg")
    with pytest.raises(ValueError, match="op='max'; use 'sum' or 'mean'"):
        rp.reduce_scatter(jnp.ones(8), op="max")


def test_bad_broadcast_source_and_scatter_shape():
    with pytest.raises(
        ValueError, match=r"source=9 is not a replica index; use an int in \[0, 8\)"
    ):
        run_collective("shard_map", lambda x: rp.broadcast(x, source=9))
    with pytest.raises(ValueError, match=r"cannot be split over 8 replicas along axis 1; pad"):
        run_collective("shard_map", lambda x: rp.reduce_scatter(x, axis=1))


def test_max_and_min_over_named_mesh_axes():
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from replicator._src.core import collectives

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "stage"))
    x = np.random.default_rng(1).normal(size=(8, 3)).astype(np.float32)  # one row per device

    def body(v):
        return (
            collectives.max_over_axes(v, ("stage",)),
            collectives.min_over_axes(v, ("data", "stage")),
            collectives.max_over_axes(v, ()),
        )

    most, least, same = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=P(("data", "stage")),
        out_specs=(P("data"), P(), P(("data", "stage"))),
        check_vma=False,
    )(x)
    np.testing.assert_array_equal(most, x.reshape(2, 4, 3).max(axis=1))
    np.testing.assert_array_equal(least, x.min(axis=0, keepdims=True))
    np.testing.assert_array_equal(same, x)
