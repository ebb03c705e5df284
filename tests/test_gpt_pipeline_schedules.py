"""The GPT on {"data": 2, "stage": 2, "model": 2} under every pipeline schedule and remat policy:
three steps of training equal the same three steps on one device with the whole batch.

The model, its data, its placement and the one-device oracle are tests/test_gpt_tensor.py's
(4 blocks: 2 stages x 2 virtual stages for circular and interleaved, 2 blocks per stage for the
others), so the oracle is computed once per optimizer for both files."""

import jax
import numpy as np
import optax
import pytest
from oracle import rel_err
from test_gpt_tensor import ADAM_TOL, CONFIG, OPTIMIZERS, TOL, batches, make_repl
from test_gpt_tensor import oracle as one_device

import replicator as rp
from replicator import pipeline
from replicator.models import gpt

pytestmark = pytest.mark.slow

MESH = {"data": 2, "stage": 2, "model": 2}
SCHEDULES = {
    "gpipe": (pipeline.GPipe(), 1),
    "circular": (pipeline.Circular(repeats=2), 2),
    "1f1b": (pipeline.OneFOneB(), 1),
    "interleaved": (pipeline.Interleaved1F1B(repeats=2), 2),
    "zerobubble": (pipeline.ZeroBubble(), 1),
}


def pipeline_training(name, remat, opt):
    """Three steps of `gpt.pipeline_value_and_grad` on `gpt.place_pipeline`'s layout, as in
    tests/test_gpt_tensor.py, with the schedule and the remat policy given: the parameters in
    `gpt.init`'s layout, the losses and how often the step was traced."""
    schedule, repeats = SCHEDULES[name]
    repl = make_repl(MESH)
    grad_fn = gpt.pipeline_value_and_grad(
        CONFIG, num_microbatches=4, schedule=schedule, remat=remat
    )
    tx = repl.wrap_optimizer(OPTIMIZERS[opt]())
    traces = []

    def step(state, batch):
        traces.append(1)
        loss, grads = grad_fn(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt_state}, {"loss": rp.all_reduce(loss, "mean")}

    params = gpt.init(CONFIG, jax.random.key(0))
    placed = gpt.place_pipeline(
        repl, params, num_stages=MESH["stage"], repeats=repeats, config=CONFIG
    )
    state = {"params": placed, "opt": tx.init(placed)}
    losses = []
    for batch in batches():
        state, out = repl.run(step, state, batch)
        losses.append(float(np.asarray(out["loss"])[0]))
    got = jax.tree.map(np.asarray, state["params"])
    got["blocks"] = pipeline.unstack_stages(got.pop("stages"), repeats)
    return got, losses, len(traces)


def check_equals_one_device(name, remat, opt):
    got, losses, traces = pipeline_training(name, remat, opt)
    want, want_losses = one_device(opt)
    err = rel_err(got, want)
    tol = ADAM_TOL if opt == "adam" else TOL
    assert err <= tol, f"parameters after 3 steps: rel_err {err:.2e}"
    assert rel_err(np.array(losses), np.array(want_losses)) <= tol, (losses, want_losses)
    assert rel_err(got, gpt.init(CONFIG, jax.random.key(0))) > 1e-3  # training moved them
    assert traces == 1


# Each schedule under one of the other policies, alternating (dots: the Adam test's, which runs
# every schedule); tests/test_pipeline.py runs every schedule under every policy on its engine.
SGD_CASES = [(name, ("none", "full")[i % 2]) for i, name in enumerate(SCHEDULES)]


@pytest.mark.parametrize("name,remat", SGD_CASES)
def test_three_sgd_steps_of_each_schedule_and_remat_equal_one_device(name, remat):
    """Data x pipeline x tensor parallel: the blocks over `stage` (V virtual stages per device for
    circular and interleaved), their heads and MLP units over `model`; what a block keeps for
    its backward pass, and when each pass runs, never changes the numbers."""
    check_equals_one_device(name, remat, "sgd")


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_three_adam_steps_of_each_schedule_equal_one_device(name):
    """Adam (eps=1e-3 and the same tolerance, as in tests/test_gpt_tensor.py), remat="dots"."""
    check_equals_one_device(name, "dots", "adam")
