"""`GPTConfig.loss_chunks`: the head's cross-entropy a chunk of tokens at a time (MaxText's
``num_vocab_tiling``) trains as one device does with the whole head, holds less, and refuses a
count that does not divide the tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from test_llama import CONFIG, batches, check_against_oracle, make_repl, train

from replicator.cli import config as config_lib
from replicator.models import gpt


@pytest.mark.parametrize(
    "mesh, zero_stage, chunks",
    [({"data": 4}, 0, 4), ({"data": 2, "model": 2}, 3, 2)],
    ids=["dp", "fsdp-tp"],
)
def test_chunked_loss_trains_as_one_device_with_the_whole_head(mesh, zero_stage, chunks):
    """Three SGD steps with the head's loss in chunks (the tied token table gathered once for
    them under ZeRO-3) equal three on one device with the whole head, 1e-5."""
    config = dataclasses.replace(CONFIG, loss_chunks=chunks)
    check_against_oracle(*train(make_repl(mesh), config, zero_stage=zero_stage)[:2])


def test_chunks_hold_one_chunks_logits():
    """The compiled step's peak falls by about the logits the chunks leave out: a head of 2,048
    classes over 1,024 tokens (8 MiB of fp32 logits, and as much again for their gradient)."""
    config = gpt.GPTConfig(vocab_size=2048, d_model=32, num_heads=2, num_layers=1, seq_len=128)
    repl = make_repl({"data": 1})
    params = gpt.init(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 128), 0, 2048)
    peaks = {}
    for chunks in (1, 8):
        c = dataclasses.replace(config, loss_chunks=chunks)
        grad = jax.grad(lambda p, t, c=c: gpt.loss(p, t, t, config=c))
        peaks[chunks] = repl.explain(lambda p, t, g=grad: (p, g(p, t)), params, tokens).memory.peak
    logits = 8 * 128 * 2048 * 4
    assert peaks[1] - peaks[8] >= logits, (peaks, logits)


def test_a_count_that_does_not_divide_the_tokens_is_refused_naming_it():
    config = dataclasses.replace(CONFIG, loss_chunks=5)
    batch = batches(1)[0]
    params = gpt.init(config, jax.random.key(0))
    with pytest.raises(ValueError, match=r"loss_chunks=5 must divide the 128 tokens.*such as 4"):
        gpt.loss(params, jnp.asarray(batch["tokens"]), jnp.asarray(batch["targets"]), config=config)
    with pytest.raises(ValueError, match="loss_chunks"):
        gpt.GPTConfig(loss_chunks=0)
    with pytest.raises(ValueError, match=r"model\.loss_chunks"):
        config_lib.from_dict(config_lib.TrainConfig, {"model": {"loss_chunks": 0}})
