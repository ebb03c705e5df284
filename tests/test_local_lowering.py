"""Pipelined steps under the local lowering: the pipeline guide's and a GPT step run unchanged, as the
sequential model, and equal the shard_map lowering on {"data": 2, "stage": 4}; `place` with a
spec naming a mesh axis the mesh lacks."""

import pathlib
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from oracle import rel_err

import replicator as rp
from replicator import pipeline
from replicator.models import gpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "guides" / "pipelines.md").read_text()
TOL = 1e-5
STEPS = 3
STAGED = {"data": 2, "stage": 4}


def readme_pipeline(replicator_args: str, optimizer: str) -> dict:
    """Runs the pipeline guide's example for STEPS steps on another Replicator (and optimizer);
    returns its namespace. Every replacement must hit, so an edit of the guide cannot hollow this out."""
    block = GUIDE.split("\n## Pipeline parallelism\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    for old, new in [
        ('rp.Replicator(mesh_shape={"data": 2, "stage": 4})', f"rp.Replicator({replicator_args})"),
        ("for _ in range(30):", f"for _ in range({STEPS}):"),
        ("optax.adam(0.01)", optimizer),
    ]:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    namespace = {}
    exec(compile(code, "docs/guides/pipelines.md", "exec"), namespace)
    return namespace


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("optimizer", ["optax.adam(0.01)", "optax.sgd(0.003)"])
@pytest.mark.slow
def test_readme_pipeline_example_runs_unchanged_under_local(optimizer):
    local = readme_pipeline('lowering="local"', optimizer)
    assert local["repl"].lowering == "local" and local["repl"].mesh.devices.size == 1
    assert local["state"]["params"]["stages"]["w"].sharding.spec == P()  # one device: whole
    staged = readme_pipeline(f"mesh_shape={STAGED}", optimizer)
    assert staged["state"]["params"]["stages"]["w"].sharding.spec == pipeline.stage_spec()
    want = host(local["state"]["params"])
    assert rel_err(np.array(staged["losses"]), np.array(local["losses"])) <= TOL
    assert rel_err(host(staged["state"]["params"]), want) <= TOL
    assert rel_err(want, host(local["params"])) > 1e-3  # the steps moved the parameters
    # A mesh of data axes only: stage_spec means replicated there, and the step is the same.
    data_only = readme_pipeline('mesh_shape={"data": 8}', optimizer)
    assert data_only["state"]["params"]["stages"]["w"].sharding.is_fully_replicated
    assert rel_err(np.array(data_only["losses"]), np.array(local["losses"])) <= TOL
    assert rel_err(host(data_only["state"]["params"]), want) <= TOL


CONFIG = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=16, num_heads=2, num_layers=4)


def gpt_training(repl, schedule):
    """Three SGD steps of the GPT pipeline step (tests/test_gpt.py's model) on ``repl``."""
    tx = repl.wrap_optimizer(optax.sgd(0.5))
    grad_fn = pipeline.value_and_grad(
        gpt.stage_fn(CONFIG), gpt.head_loss, num_microbatches=4, schedule=schedule
    )

    def step_fn(state, t, y):  # one data replica, every stage
        p = state["params"]
        x, embed_vjp = jax.vjp(lambda e: gpt.embed(e, t), p["embed"])
        loss, (g_stages, g_x, g_head) = grad_fn(p["stages"], x, y, p["head"])
        grads = {"embed": embed_vjp(g_x)[0], "stages": g_stages, "head": g_head}
        updates, opt = tx.update(grads, state["opt"], p)
        return {"params": optax.apply_updates(p, updates), "opt": opt}, {
            "loss": rp.all_reduce(loss, "mean")
        }

    params = gpt.init(CONFIG, jax.random.key(5))
    placed = {
        "embed": repl.replicate(params["embed"]),
        "stages": repl.place(
            pipeline.stack_stages(params["blocks"], num_stages=4), pipeline.stage_spec()
        ),
        "head": repl.replicate(params["head"]),
    }
    state = {"params": placed, "opt": tx.init(placed)}
    rng = np.random.default_rng(6)
    losses = []
    for _ in range(STEPS):
        tokens = rng.integers(0, CONFIG.vocab_size, size=(16, CONFIG.seq_len + 1)).astype(np.int32)
        state, out = repl.run(step_fn, state, tokens[:, :-1], tokens[:, 1:])
        losses.append(float(out["loss"][0]))
    got = host(state["params"])
    got["blocks"] = pipeline.unstack_stages(got.pop("stages"))
    return np.array(losses), got, params


@pytest.mark.slow
def test_gpt_pipeline_step_under_local_equals_shard_map_and_one_device():
    """Under local the schedule is not used (every stage runs in order); tests/test_gpt.py
    checks GPipe and 1F1B gradients under both lowerings."""
    local_losses, local_params, init = gpt_training(rp.Replicator(lowering="local"), "1f1b")
    staged_losses, staged_params, _ = gpt_training(rp.Replicator(mesh_shape=STAGED), "1f1b")
    assert rel_err(staged_losses, local_losses) <= TOL
    assert rel_err(staged_params, local_params) <= TOL
    # The oracle: the whole model on one device, no replicator.
    grad = jax.jit(lambda p, t, y: jax.value_and_grad(gpt.loss)(p, t, y, config=CONFIG))
    params, rng, losses = init, np.random.default_rng(6), []
    for _ in range(STEPS):
        tokens = rng.integers(0, CONFIG.vocab_size, size=(16, CONFIG.seq_len + 1)).astype(np.int32)
        loss, g = grad(params, tokens[:, :-1], tokens[:, 1:])
        params = jax.tree.map(lambda a, b: a - 0.5 * b, params, g)
        losses.append(float(loss))
    assert rel_err(local_losses, np.array(losses)) <= TOL
    assert rel_err(local_params, host(params)) <= TOL
    assert rel_err(local_params, host(init)) > 1e-3


def test_place_with_stage_spec_under_local():
    repl = rp.Replicator(lowering="local")
    rng = np.random.default_rng(0)
    layers = {"w": rng.normal(size=(8, 3, 3)).astype(np.float32)}
    for repeats in (1, 2):
        stacked = pipeline.stack_stages(layers, num_stages=4, repeats=repeats)
        placed = repl.place(stacked, pipeline.stage_spec(repeats))
        assert placed["w"].sharding.mesh == repl.mesh and placed["w"].sharding.spec == P()
        np.testing.assert_array_equal(placed["w"], stacked["w"])
    with pytest.raises(
        ValueError,
        match=r"Replicator.place: spec P\('stag',\) names axis 'stag', which is not an axis of "
        r"this mesh \(\{'data': 1\}; axes 'data'\) nor one replicator knows.*did you mean "
        r"'stage'\?",
    ):
        repl.place(stacked, P("stag"))


def test_place_on_a_mesh_without_a_stage_axis_replicates_and_refuses_typos():
    repl = rp.Replicator(mesh_shape={"data": 8})
    w = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    placed = repl.place(w, pipeline.stage_spec())
    assert placed.sharding.is_fully_replicated and placed.sharding.spec == P()
    np.testing.assert_array_equal(placed, w)
    split = repl.place(w.reshape(8, 3), P("data", "stage"))  # the axes the mesh has are kept
    assert split.sharding.spec == P("data") and split.addressable_shards[0].data.shape == (1, 3)
    with pytest.raises(ValueError, match=r"Replicator.place: spec P\(None, 'stages'\) names axis"):
        repl.place(w, P(None, "stages"))
