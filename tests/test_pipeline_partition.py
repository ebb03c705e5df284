"""Stacking layers into stages, and balancing layers of unequal cost."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from replicator import pipeline


def random_layers(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "w": rng.normal(size=(3, 2)).astype(np.float32),
            "t": (rng.normal(size=4).astype(np.float32) + 1,),
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize("k,v", [(4, 1), (2, 2), (4, 2), (1, 1)])
def test_stack_places_logical_stages_and_unstack_inverts(k, v):
    layers = random_layers(k * v * 2)
    lv = 2
    for source in (layers, jax.tree.map(lambda *a: np.stack(a), *layers)):
        stacked = pipeline.stack_stages(source, num_stages=k, repeats=v)
        lead = (k,) if v == 1 else (v, k)
        assert stacked["w"].shape == (*lead, lv, 3, 2)
        for r, s in itertools.product(range(v), range(k)):
            j = r * k + s  # logical stage
            got = stacked["w"][s] if v == 1 else stacked["w"][r, s]
            want = np.stack([layers[j * lv + i]["w"] for i in range(lv)])
            np.testing.assert_array_equal(got, want)
        back = pipeline.unstack_stages(stacked, repeats=v)
        np.testing.assert_array_equal(back["t"][0], np.stack([layer["t"][0] for layer in layers]))


@pytest.mark.parametrize("v", [1, 2])
def test_stage_spec_gives_each_device_its_stages(v):
    mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    stacked = pipeline.stack_stages(random_layers(8 * v), num_stages=4, repeats=v)
    placed = jax.device_put(stacked, NamedSharding(mesh, pipeline.stage_spec(v)))
    want = (1, 2, 3, 2) if v == 1 else (v, 1, 2, 3, 2)
    assert {s.data.shape for s in placed["w"].addressable_shards} == {want}


def test_stack_errors():
    with pytest.raises(
        ValueError,
        match=r"10 layers do not split into num_stages=4 x repeats=1 = 4.*e\.g\. 8 or 12",
    ):
        pipeline.stack_stages(random_layers(10), num_stages=4)
    with pytest.raises(ValueError, match=r"layers is empty"):
        pipeline.stack_stages([], num_stages=2)
    bad = random_layers(4)
    bad[2]["w"] = np.ones((3, 3), np.float32)
    with pytest.raises(
        ValueError, match=r"layer 2 leaf \['w'\] is float32\[3, 3\].*float32\[3, 2\]"
    ):
        pipeline.stack_stages(bad, num_stages=2)
    bad[2] = {"w": np.ones((3, 2))}
    with pytest.raises(ValueError, match=r"layer 2 has a different structure"):
        pipeline.stack_stages(bad, num_stages=2)
    with pytest.raises(ValueError, match=r"same leading layer axis"):
        pipeline.stack_stages({"a": np.ones((4, 2)), "b": np.ones((3, 2))}, num_stages=2)
    with pytest.raises(ValueError, match=r"repeats must be an int >= 1; got 0"):
        pipeline.stack_stages(random_layers(4), num_stages=2, repeats=0)


def brute_force(costs, k):
    n = len(costs)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balance_is_optimal(seed):
    rng = np.random.default_rng(seed)
    for n in range(1, 10):
        costs = rng.integers(0, 10, size=n).astype(float).tolist()
        for k in range(1, min(n, 4) + 1):
            p = pipeline.balance(costs, k)
            assert p.max_cost == brute_force(costs, k)
            assert p.boundaries[0] == 0 and p.boundaries[-1] == n and min(p.sizes) >= 1
            assert sum(p.stage_costs) == pytest.approx(sum(costs))
            assert all(f"{s:>5}" in str(p) for s in range(k))


def test_balance_errors():
    with pytest.raises(ValueError, match=r"num_stages=4 is more than the 3 layers"):
        pipeline.balance([1, 2, 3], 4)
    with pytest.raises(ValueError, match=r"finite and >= 0"):
        pipeline.balance([1, -1], 1)
    with pytest.raises(ValueError, match=r"non-empty"):
        pipeline.balance([], 1)


def test_layer_costs_by_flops_and_time():
    widths = [8, 16, 32]
    fns = [lambda p, x: jnp.tanh(x @ p) @ p.T for _ in widths]
    params = [jnp.ones((4, w)) for w in widths]
    flops = pipeline.layer_costs(fns, jnp.ones((2, 4)), params=params)
    assert 0 < flops[0] < flops[1] < flops[2]
    seconds = pipeline.layer_costs(fns, jnp.ones((2, 4)), params=params, method="time", repeats=2)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    p = pipeline.balance(flops, 2)
    assert p.boundaries == (0, 2, 3)
    with pytest.raises(ValueError, match=r"method must be 'flops' or 'time'"):
        pipeline.layer_costs(fns, jnp.ones((2, 4)), params=params, method="bytes")
