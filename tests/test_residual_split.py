"""`GPTConfig.residual_split`: each block's input held split over ``model`` by its width
(MaxText's ``activation_embed`` on its tensor axis) trains as one device does, and keeps a
``1 / model`` share of what a block saves of it."""

import dataclasses

import jax
import pytest
from test_llama import CONFIG, batches, check_against_oracle, make_repl, train

from replicator.models import gpt


@pytest.mark.parametrize(
    "mesh, zero_stage, remat",
    [
        ({"data": 2, "model": 2}, 3, {"decoder_layer_input": "offload"}),
        ({"data": 1, "model": 4}, 0, "full"),
    ],
    ids=["fsdp-tp-offload", "tp-full"],
)
def test_a_split_residual_trains_as_one_device(mesh, zero_stage, remat):
    """Three SGD steps with the residual stream split over ``model`` equal three on one
    device, 1e-5."""
    config = dataclasses.replace(CONFIG, residual_split=True, remat=remat)
    check_against_oracle(*train(make_repl(mesh), config, zero_stage=zero_stage)[:2])


def test_the_saved_layer_inputs_are_a_share_of_the_width():
    """Under full remat a block keeps its input: split over 4 devices of ``model`` the step's
    peak falls by at least half of what the 16 layers' inputs take whole."""
    config = gpt.GPTConfig(vocab_size=64, d_model=256, num_heads=4, num_layers=16, seq_len=256,
                           remat="full", bias=False)  # fmt: skip
    repl = make_repl({"data": 1, "model": 4})
    params = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
    tokens = batches(1)[0]["tokens"][:, :1].repeat(256, 1)[:8]
    peaks = {}
    for split in (False, True):
        c = dataclasses.replace(config, residual_split=split)
        grad = jax.grad(lambda p, t, c=c: gpt.loss(p, t, t, config=c))
        peaks[split] = repl.explain(lambda p, t, g=grad: (p, g(p, t)), params, tokens).memory.peak
    inputs = 16 * 8 * 256 * 256 * 4  # layers x tokens x width, fp32
    assert peaks[False] - peaks[True] >= inputs / 2, (peaks, inputs)
