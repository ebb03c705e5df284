"""InputContext and Replicator.distribute: global arrays, prefetching, and checked batches."""

import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import replicator as rp


def make_input_fn(shapes, seed=0):
    def input_fn(ctx):
        rng = np.random.default_rng(seed + ctx.input_pipeline_id)
        for shape in shapes:
            yield {"x": rng.normal(size=shape).astype(np.float32), "y": np.arange(shape[0])}

    return input_fn


@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_are_global_arrays_split_over_data(prefetch):
    repl = rp.Replicator()
    expected = list(make_input_fn([(16, 3)] * 4)(repl.input_context()))
    got = list(repl.distribute(make_input_fn([(16, 3)] * 4), prefetch=prefetch))
    assert len(got) == 4
    for g, e in zip(got, expected):
        assert isinstance(g["x"], jax.Array)
        assert g["x"].sharding.spec == P("data") and g["x"].sharding.mesh == repl.mesh
        assert len(g["x"].addressable_shards) == 8
        assert g["x"].addressable_shards[3].data.shape == (2, 3)
        np.testing.assert_array_equal(np.asarray(g["x"]), e["x"])
        np.testing.assert_array_equal(np.asarray(g["y"]), e["y"])


def test_batch_split_over_dcn_and_data_replicated_over_stage():
    repl = rp.Replicator(mesh_shape={"dcn_data": 2, "data": 2, "stage": 2})
    batch = next(iter(repl.distribute(make_input_fn([(8, 3)]))))
    assert batch["x"].sharding.spec == P(("dcn_data", "data"))
    assert {s.data.shape for s in batch["x"].addressable_shards} == {(2, 3)}


def test_input_context():
    repl = rp.Replicator()
    seen = []

    def input_fn(ctx):
        seen.append(ctx)
        yield {"x": np.zeros((ctx.per_pipeline_batch_size(32), 2), np.float32)}

    batch = next(iter(repl.distribute(input_fn)))
    assert batch["x"].shape == (32, 2)
    (ctx,) = seen
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 8)
    assert ctx.per_replica_batch_size(32) == 4
    with pytest.raises(
        ValueError,
        match=r"global batch of 30 examples does not split over 8 replicas; use a multiple of 8 \(e.g. 32\)",
    ):
        ctx.per_replica_batch_size(30)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_batch_that_does_not_divide(prefetch):
    it = rp.Replicator().distribute(make_input_fn([(16, 3), (12, 3)]), prefetch=prefetch)
    next(it)
    with pytest.raises(
        ValueError,
        match=r"batch 1, leaf \['x'\] of shape \(12, 3\) has 12 examples.*does not split over the 8 replicas",
    ):
        next(it)


def test_non_array_leaf_names_its_path():
    def input_fn(ctx):
        yield {"x": np.zeros((8, 2)), "meta": {"names": ["a"] * 8}}

    with pytest.raises(
        TypeError, match=r"batch 0, leaf \['meta'\]\['names'\]\[0\] is a str, not an array"
    ):
        next(iter(rp.Replicator().distribute(input_fn)))


def test_shapes_and_structure_must_not_change():
    it = rp.Replicator().distribute(make_input_fn([(16, 3), (16, 4)]))
    next(it)
    with pytest.raises(
        ValueError,
        match=r"batch 1, leaf \['x'\] is float32\[16, 4\], but batch 0 had float32\[16, 3\]",
    ):
        next(it)

    def changing(ctx):
        yield {"x": np.zeros((8, 2))}
        yield {"x": np.zeros((8, 2)), "z": np.zeros((8,))}

    it = rp.Replicator().distribute(changing)
    next(it)
    with pytest.raises(ValueError, match="batch 1 has structure .* but batch 0 had"):
        next(it)


def test_input_fn_errors_reach_the_caller_and_iteration_ends():
    def input_fn(ctx):
        yield {"x": np.zeros((8, 2))}
        raise OSError("disk gone")

    it = rp.Replicator().distribute(input_fn, prefetch=2)
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_input_fn_must_return_an_iterable_and_prefetch_is_checked():
    with pytest.raises(TypeError, match="input_fn must return an iterable of batches"):
        rp.Replicator().distribute(lambda ctx: 3)
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        rp.Replicator().distribute(make_input_fn([]), prefetch=-1)


def test_close_stops_the_prefetch_thread():
    def endless(ctx):
        while True:
            yield {"x": np.zeros((8, 2), np.float32)}

    it = rp.Replicator().distribute(endless, prefetch=2)
    next(it)
    it.close()
    it._thread.join(timeout=5)
    assert not it._thread.is_alive()


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_prefetch_reads_ahead_onto_the_devices(prefetch):
    pulled = []

    def input_fn(ctx):
        for i in range(10):
            pulled.append(i)
            yield {"x": np.full((8, 2), i, np.float32)}

    it = rp.Replicator().distribute(input_fn, prefetch=prefetch)
    first = next(it)
    deadline = time.monotonic() + 10
    # The background thread fills the queue with placed batches that nobody has asked for.
    while prefetch and it._queue.qsize() < prefetch and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pulled) >= 1 + prefetch and (prefetch or len(pulled) == 1)
    if prefetch:
        ready, _position = it._queue.queue[0]
        assert isinstance(ready["x"], jax.Array) and ready["x"].sharding.spec == P("data")
    assert float(first["x"][0, 0]) == 0 and float(next(it)["x"][0, 0]) == 1
    it.close()
