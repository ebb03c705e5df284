"""The GPT reference model: scanned blocks, stages, causality, learning, and its pipeline oracle."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle import rel_err

import replicator as rp
from replicator import pipeline
from replicator.models import gpt

CONFIG = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=16, num_heads=2, num_layers=4)


def tokens(batch=4, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, CONFIG.vocab_size, size=(batch, CONFIG.seq_len + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


@pytest.mark.slow
def test_scanned_blocks_equal_a_loop_of_blocks_with_gradients():
    params = gpt.init(CONFIG, jax.random.key(0))
    x = gpt.embed(params["embed"], tokens()[0])

    def looped(stacked, x):
        for i in range(CONFIG.num_layers):
            x = gpt.block(jax.tree.map(lambda a, i=i: a[i], stacked), x, config=CONFIG)
        return jnp.sum(x**2)

    scanned = lambda stacked, x: jnp.sum(gpt.blocks(stacked, x, config=CONFIG) ** 2)
    scanned, looped = jax.jit(jax.value_and_grad(scanned)), jax.jit(jax.value_and_grad(looped))
    assert rel_err(scanned(params["blocks"], x), looped(params["blocks"], x)) <= 1e-5


@pytest.mark.parametrize("num_stages", [2, 4])
def test_stages_in_order_equal_the_blocks(num_stages):
    params = gpt.init(CONFIG, jax.random.key(1))
    x = gpt.embed(params["embed"], tokens()[0])
    stages = pipeline.stack_stages(params["blocks"], num_stages=num_stages)
    h = x
    for s in range(num_stages):
        h = gpt.stage_fn(CONFIG)(jax.tree.map(lambda a, s=s: a[s], stages), h)
    assert rel_err(h, gpt.blocks(params["blocks"], x, config=CONFIG)) <= 1e-6


@pytest.mark.slow
def test_remat_gives_the_same_loss_and_gradients_for_more_flops():
    """GPTConfig(remat=True) recomputes each block in the backward pass: one SGD step equals the
    step that keeps the activations, and the compiled step does more FLOPs."""
    params = gpt.init(CONFIG, jax.random.key(5))
    t, y = tokens(batch=4, seed=6)
    repl = rp.Replicator(devices=jax.devices()[:1])
    steps, flops = {}, {}
    for remat in (False, True):
        config = dataclasses.replace(CONFIG, remat=remat)

        def step(state, t, y, config=config):
            loss, g = jax.value_and_grad(gpt.loss)(state, t, y, config=config)
            return jax.tree.map(lambda p, g: p - 0.5 * g, state, g), {"loss": loss}

        steps[remat] = repl.run(step, repl.replicate(params), t, y)
        flops[remat] = repl.explain(step, repl.replicate(params), t, y).flops
    assert rel_err(steps[True], steps[False]) <= 1e-6
    assert rel_err(steps[True][0], params) > 1e-2
    assert flops[True] > flops[False]


def test_causal():
    params = gpt.init(CONFIG, jax.random.key(2))
    t, _ = tokens(batch=1)
    changed = t.copy()
    changed[0, 5] = (changed[0, 5] + 1) % CONFIG.vocab_size
    a, b = gpt.apply(params, t, config=CONFIG), gpt.apply(params, changed, config=CONFIG)
    np.testing.assert_allclose(a[0, :5], b[0, :5], rtol=1e-6, atol=1e-6)
    assert np.abs(a[0, 5:] - b[0, 5:]).max() > 1e-4


@pytest.mark.slow  # 4.6 s
def test_fresh_loss_is_log_vocab_and_training_on_stdlib_text_lowers_it():
    config = gpt.GPTConfig(vocab_size=256, seq_len=32, d_model=32, num_heads=4, num_layers=2)
    params = gpt.init(config, jax.random.key(0))
    text = gpt.stdlib_text(200_000)
    assert isinstance(text, bytes) and len(text) == 200_000 and text == gpt.stdlib_text(200_000)
    batches = gpt.token_batches(text, batch_size=16, seq_len=32, seed=0)
    first = next(batches)
    np.testing.assert_array_equal(first["tokens"][:, 1:], first["targets"][:, :-1])
    loss0 = float(gpt.loss(params, first["tokens"], first["targets"], config=config))
    assert abs(loss0 - np.log(256)) < 0.1 * np.log(256)
    tx = optax.adam(3e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch):
        loss, g = jax.value_and_grad(gpt.loss)(
            params, batch["tokens"], batch["targets"], config=config
        )
        updates, opt = tx.update(g, opt)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for _, batch in zip(range(60), batches):
        params, opt, loss = step(params, opt, batch)
        losses.append(float(loss))
    assert np.mean(losses[-10:]) < 0.8 * loss0


def test_config_errors():
    with pytest.raises(
        ValueError, match=r"d_model=30 must divide by num_heads=4; use e.g. d_model=32"
    ):
        gpt.GPTConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match=r"num_layers must be an int >= 1; got 0"):
        gpt.GPTConfig(num_layers=0)


@pytest.mark.parametrize("lowering", ["shard_map", "local"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.slow
def test_gpt_pipeline_equals_the_single_device_model(schedule, lowering):
    """DP x PP on {"data": 2, "stage": 2}: the embedding before the stages, the head in loss_fn.
    The same step and placement run unchanged under the local lowering (the sequential model)."""
    if lowering == "local":
        repl = rp.Replicator(lowering="local")
    else:
        repl = rp.Replicator(mesh_shape={"data": 2, "stage": 2}, devices=jax.devices()[:4])
    params = gpt.init(CONFIG, jax.random.key(3))
    t, y = tokens(batch=8, seed=4)
    want_loss, want = jax.value_and_grad(gpt.loss)(params, t, y, config=CONFIG)
    f = pipeline.value_and_grad(
        gpt.stage_fn(CONFIG), gpt.head_loss, num_microbatches=2, schedule=schedule
    )

    def step(state, t, y):
        p = state["params"]
        x, embed_vjp = jax.vjp(lambda e: gpt.embed(e, t), p["embed"])
        loss, (g_stages, g_x, g_head) = f(p["stages"], x, y, p["head"])
        grads = {"embed": embed_vjp(g_x)[0], "stages": g_stages, "head": g_head}
        return {**state, "grads": rp.all_reduce(grads, "mean")}, {
            "loss": rp.all_reduce(loss, "mean")
        }

    stages = pipeline.stack_stages(params["blocks"], num_stages=2)
    placed = {
        "embed": repl.replicate(params["embed"]),
        "stages": repl.place(stages, pipeline.stage_spec()),
        "head": repl.replicate(params["head"]),
    }
    state = {"params": placed, "grads": jax.tree.map(jnp.zeros_like, placed)}
    state, out = repl.run(step, state, t, y)
    got = dict(state["grads"])
    got["blocks"] = pipeline.unstack_stages(got.pop("stages"))
    assert rel_err(out["loss"][0], want_loss) <= 1e-5
    for part in ("embed", "blocks", "head"):
        assert rel_err(got[part], want[part]) <= 1e-5, part
