"""Measured stage costs: F, B, W and the fused backward of each pipeline stage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replicator import pipeline
from replicator.models import gpt

stage_costs = pipeline.stage_costs
stage_costs_stacked = pipeline.stage_costs_stacked

B, D, E, F = 4, 8, 16, 6
PASSES = ("forward", "backward_input", "backward_weight", "backward")


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def assert_relations(c, j):
    """What splitting the backward implies, stage j: B and W together do the fused backward's
    work (W reads what B computed; nothing runs twice), and each does some of it."""
    bi, bw, both = c.backward_input[j], c.backward_weight[j], c.backward[j]
    assert 0 < bi < both and 0 < bw < both, (bi, bw, both)
    assert abs(bi + bw - both) <= 0.02 * both, (bi, bw, both)


def test_linear_stages_match_hand_counted_matmul_flops_exactly():
    # [B, D] -> [B, E] -> [B, F]. A linear stage's gradients do not need its output, so XLA
    # drops the recompute: B is dx alone, W is dw alone, the fused backward both.
    fns = [lambda w, x: x @ w, lambda w, x: x @ w]
    params = [sds(D, E), sds(E, F)]
    c = stage_costs(fns, params, sds(B, D))
    mm0, mm1 = 2 * B * D * E, 2 * B * E * F
    assert c.unit == "flops"
    assert c.forward == (mm0, mm1)
    assert c.backward_input == (mm0, mm1)
    assert c.backward_weight == (mm0, mm1)
    assert c.backward == (2 * mm0, 2 * mm1)
    for field in (c.forward, c.backward_input, c.backward_weight, c.backward):
        assert isinstance(field, tuple) and all(isinstance(v, float) for v in field)


def test_nonlinear_stage_pays_its_recompute_once():
    # tanh(x @ w) @ v under remat="full": B recomputes x @ w (the second matmul is dead code for
    # dx) and runs two matmuls back (dh, dx); W runs dv and dw from the h and dh B kept, with
    # no recompute of its own. tanh is a transcendental, not a flop; its derivative adds a few
    # elementwise flops per element.
    fns = [lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]]
    c = stage_costs(fns, [{"w": sds(D, E), "v": sds(E, F)}], sds(B, D))
    xw, hv = 2 * B * D * E, 2 * B * E * F
    assert c.forward == (xw + hv,)
    elementwise = 8 * B * E
    assert xw + hv + xw <= c.backward_input[0] <= xw + hv + xw + elementwise
    assert c.backward_weight[0] == hv + xw
    # The fused backward recomputes x @ w once, then dh, dv, dw and dx.
    assert 3 * xw + 2 * hv <= c.backward[0] <= 3 * xw + 2 * hv + elementwise
    assert_relations(c, 0)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_without_recompute_the_backward_is_twice_the_forward(remat):
    # Kept residuals (all of them, or the products' outputs, from which tanh's derivative
    # needs no recompute of a matmul): B is dh and dx, W is dv and dw.
    fns = [lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]]
    c = stage_costs(fns, [{"w": sds(D, E), "v": sds(E, F)}], sds(B, D), remat=remat)
    xw, hv = 2 * B * D * E, 2 * B * E * F
    elementwise = 8 * B * E
    assert hv + xw <= c.backward_input[0] <= hv + xw + elementwise
    assert c.backward_weight[0] == hv + xw
    assert 2 * (xw + hv) <= c.backward[0] <= 2 * (xw + hv) + elementwise
    assert_relations(c, 0)


def test_two_stages_whose_shapes_change():
    # stage 0: {"a", "b"} [B, D] -> [B, 2, E]; stage 1: [B, 2, E] -> ([B, F], [B, 1]).
    def stage0(p, x):
        h = jnp.tanh(x["a"] @ p["w"]) * jax.nn.sigmoid(x["b"] @ p["w"])
        return jnp.stack([h, jnp.sin(h)], axis=1)

    def stage1(p, h):
        z = jax.nn.relu(h.reshape(B, 2 * E) @ p)
        return z, jnp.sum(z * z, axis=1, keepdims=True)

    params = [{"w": np.ones((D, E), np.float32)}, np.ones((2 * E, F), np.float32)]
    x = {"a": np.ones((B, D), np.float32), "b": sds(B, D)}
    c = stage_costs([stage0, stage1], params, x)
    assert len(c.forward) == len(c.backward) == 2
    assert c.forward[0] >= 2 * (2 * B * D * E) and c.forward[1] >= 2 * B * 2 * E * F
    for j in range(2):
        assert_relations(c, j)
    # The forward is what layer_costs measures for the same stages.
    assert list(c.forward) == pipeline.layer_costs([stage0, stage1], x, params=params)
    # Arrays and ShapeDtypeStructs give the same counts.
    abstract = jax.tree.map(lambda a: sds(*np.shape(a), dtype=a.dtype), (params, x))
    assert stage_costs([stage0, stage1], *abstract) == c


@pytest.mark.slow
def test_integer_token_embedding_stage_and_gpt_block():
    config = gpt.GPTConfig(vocab_size=256, seq_len=32, d_model=64, num_heads=4, num_layers=1)
    params = gpt.init(config, jax.random.key(0))
    block = jax.tree.map(lambda a: a[0], params["blocks"])
    fns = [gpt.embed, lambda p, x: gpt.block(p, x, config=config)]
    tokens = sds(4, 32, dtype=jnp.int32)
    c = stage_costs(fns, [params["embed"], block], tokens)
    # The tokens get no gradient: the embedding's B is empty, its backward is its W.
    assert c.backward_input[0] == 0.0
    assert c.backward[0] == c.backward_weight[0] > 0
    assert_relations(c, 1)
    b, s, d, h = 4, 32, 64, 4 * 64
    matmuls = (
        2 * b * s * d * 3 * d + 2 * 2 * b * s * s * d + 2 * b * s * d * d + 2 * 2 * b * s * d * h
    )
    assert matmuls <= c.forward[1] <= 1.1 * matmuls
    seconds = stage_costs(fns, [params["embed"], block], tokens, method="time", repeats=2)
    assert seconds.unit == "seconds" and len(seconds.backward) == 2
    assert all(v > 0 for v in seconds.forward + seconds.backward_weight + seconds.backward)


def test_integer_leaves_of_an_input_are_not_differentiated():
    def stage(w, x):
        return (x["h"] @ w) * x["mask"]  # mask: int32 [B, E]

    x = {"h": sds(B, D), "mask": sds(B, E, dtype=jnp.int32)}
    c = stage_costs([stage], [sds(D, E)], x)
    assert c.forward[0] >= 2 * B * D * E
    assert c.backward_input[0] >= 2 * B * D * E and c.backward_weight[0] >= 2 * B * D * E


def test_scan_layers_stage_is_measured_per_layer():
    # XLA counts a loop body once; a scan_layers stage is measured one layer at a time, times
    # its layers, as the engine runs it.
    layer = lambda w, x: jnp.tanh(x @ w)
    one = stage_costs([layer], [sds(D, D)], sds(B, D))
    three = stage_costs([pipeline.scan_layers(layer)], [sds(3, D, D)], sds(B, D))
    for field in PASSES:
        assert getattr(three, field) == (3 * getattr(one, field)[0],)
    assert three.forward == (3 * 2 * B * D * D,)


def test_a_stage_with_a_loop_is_refused_for_flops_and_timed():
    def looped(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    with pytest.raises(ValueError, match=r"stage_costs: stage 0's forward compiles to a loop"):
        stage_costs([looped], [sds(3, D, D)], sds(B, D))
    with pytest.raises(ValueError, match=r"layer_costs: layer 0 compiles to a loop.*scan_layers"):
        pipeline.layer_costs([looped], sds(B, D), params=[sds(3, D, D)])
    c = stage_costs([looped], [np.ones((3, D, D), np.float32)], sds(B, D), method="time")
    assert c.unit == "seconds" and c.forward[0] > 0
    # Unrolled, the loop is exact again.
    unrolled = lambda w, x: jax.lax.scan(lambda h, wi: (h @ wi, None), x, w, unroll=True)[0]
    assert stage_costs([unrolled], [sds(3, D, D)], sds(B, D)).forward == (3 * 2 * B * D * D,)


@pytest.mark.slow
def test_stacked_stages_repeat_stage_zero():
    config = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=16, num_heads=2, num_layers=4)
    params = gpt.init(config, jax.random.key(1))
    stage_fn = gpt.stage_fn(config)
    x = sds(2, 8, 16)
    stacked = pipeline.stack_stages(params["blocks"], num_stages=2)
    c = stage_costs_stacked(stage_fn, stacked, x)
    row = jax.tree.map(lambda a: a[0], stacked)
    one = stage_costs([stage_fn], [row], x)
    for field in PASSES:
        assert getattr(c, field) == getattr(one, field) * 2
    assert c.unit == "flops"
    # Parameters placed over a stage axis: only their shapes and dtypes are read.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    placed = jax.device_put(stacked, jax.sharding.NamedSharding(mesh, pipeline.stage_spec()))
    assert stage_costs_stacked(stage_fn, placed, x) == c
    circular = pipeline.stack_stages(params["blocks"], num_stages=2, repeats=2)
    c4 = stage_costs_stacked(stage_fn, circular, x, virtual_stages=2)
    assert len(c4.forward) == 4 and c4.forward[0] == one.forward[0] / 2  # 1 layer per stage
    with pytest.raises(ValueError, match=r"virtual_stages=2 but the leaves' leading axis is 3"):
        stage_costs_stacked(stage_fn, {"w": sds(3, 2, 16, 16)}, x, virtual_stages=2)
    with pytest.raises(ValueError, match=r"same leading stage axes \[K, \.\.\.\]"):
        stage_costs_stacked(stage_fn, {"w": sds(2, 16), "v": sds(3, 16)}, x)
    with pytest.raises(ValueError, match=r"stage_fn maps .* must keep its shapes and dtypes"):
        stage_costs_stacked(lambda w, x: x @ w, sds(2, 16, 4), x)


def test_errors_name_the_api_argument_and_fix():
    fn = lambda w, x: x @ w
    x = sds(B, D)
    with pytest.raises(ValueError, match=r"stage_costs: fns must be a list with one callable per"):
        stage_costs(fn, [sds(D, D)], x)
    with pytest.raises(ValueError, match=r"stage_costs: fns is empty"):
        stage_costs([], [], x)
    with pytest.raises(ValueError, match=r"fns\[1\] is a int, not a callable"):
        stage_costs([fn, 3], [sds(D, D)] * 2, x)
    with pytest.raises(ValueError, match=r"got 2 fns and 1 params\. Pass 2 entries"):
        stage_costs([fn, fn], [sds(D, D)], x)
    with pytest.raises(ValueError, match=r"params must be a list .* got 1 fns and dict"):
        stage_costs([fn], {"w": sds(D, D)}, x)
    with pytest.raises(ValueError, match=r"method must be 'flops' or 'time'; got 'bytes'"):
        stage_costs([fn], [sds(D, D)], x, method="bytes")
    with pytest.raises(ValueError, match=r"stage_costs: repeats must be an int >= 1; got 0"):
        stage_costs([fn], [sds(D, D)], x, method="time", repeats=0)
    with pytest.raises(ValueError, match=r"example_input must be one micro-batch .* got"):
        stage_costs([fn], [sds(D, D)], {"x": x, "t": sds()})
    summed = lambda w, x: jnp.sum(x @ w)
    with pytest.raises(ValueError, match=r"stage 1's output float32\[\] has no leading batch"):
        stage_costs([fn, summed], [sds(D, D)] * 2, x)
    flat = lambda w, x: (x @ w).reshape(-1)
    with pytest.raises(ValueError, match=r"stage 0's output float32\[32\] has no leading batch"):
        stage_costs([flat], [sds(D, D)], x)
    with pytest.raises(TypeError) as info:
        stage_costs([fn, fn], [sds(D, D), sds(3, 3)], x)
    assert "raised by stage 1 (fns[1]) on the input float32[4, 8]" in "\n".join(
        info.value.__notes__
    )
