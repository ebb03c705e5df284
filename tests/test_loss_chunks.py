"""`GPTConfig.loss_chunks`: the head's cross-entropy a chunk of tokens at a time (MaxText's
``num_vocab_tiling``) trains as one device does with the whole head, holds less, and refuses a
count that does not divide the tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from oracle import rel_err
from test_llama import CONFIG, batches, check_against_oracle, make_repl, train

import replicator as rp
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


def _refused(config, key: str, match: str) -> None:
    """``config``'s loss is refused when traced (``match``), and ``key=0`` by the config file."""
    batch = batches(1)[0]
    params = gpt.init(config, jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        gpt.loss(params, jnp.asarray(batch["tokens"]), jnp.asarray(batch["targets"]), config=config)
    with pytest.raises(ValueError, match=rf"model\.{key}"):
        config_lib.from_dict(config_lib.TrainConfig, {"model": {key: 0}})


def test_a_count_that_does_not_divide_the_tokens_is_refused_naming_it():
    config = dataclasses.replace(CONFIG, loss_chunks=5)
    _refused(config, "loss_chunks", r"loss_chunks=5 must divide the 128 tokens.*such as 4")
    with pytest.raises(ValueError, match="loss_chunks"):
        gpt.GPTConfig(loss_chunks=0)


# 5 layers: a shuffle of 4, 8 or 16 sequences a layer made would not undo itself over them
MIXTURE = dataclasses.replace(CONFIG, num_layers=5, num_experts=4, top_k=2, capacity_factor=None)


@pytest.mark.parametrize(
    "mesh, zero_stage, capacity_factor",
    [({"data": 2, "expert": 2}, 3, None), ({"data": 4}, 0, 1.25)],
    ids=["dropless-expert-axis", "capacity"],
)
def test_experts_in_chunks_train_as_one_device_in_one_pass(mesh, zero_stage, capacity_factor):
    """Three SGD steps with the mixture taking each device's sequences two chunks at a time
    equal three on one device with every sequence at once (dropless over an ``expert`` axis
    under ZeRO-3; with a capacity, tokens dropped as one device drops them), 1e-5."""
    config = dataclasses.replace(MIXTURE, capacity_factor=capacity_factor)
    want, want_losses, _ = train(make_repl({"data": 1}), config)
    got, losses, _ = train(
        make_repl(mesh), dataclasses.replace(config, moe_chunks=2), zero_stage=zero_stage
    )
    assert rel_err(got, want) <= 1e-5 and rel_err(losses, want_losses) <= 1e-5
    assert rel_err(got, gpt.init(config, jax.random.key(0))) > 1e-3  # training moved them


def test_chunks_of_sequences_that_do_not_divide_them_are_refused_naming_the_key():
    config = dataclasses.replace(MIXTURE, moe_chunks=3)
    _refused(config, "moe_chunks", r"moe_chunks=3 must divide the 16 sequences")


def test_plan_prices_the_chunks_as_less_memory_and_the_experts_pass_again():
    """`rp.planner` prices a chunked head (Llama 3 8B's 128,256 logits a token) and chunked
    experts (Mixtral 8x7B's, dropless at 36 sequences a chip) below the whole ones' peak; each
    chunk of experts' forward again in the FLOPs, and the head's FLOPs unchanged (its chunks'
    gradients are taken in the forward pass)."""
    from replicator._src.planner import pricing

    common = dict(num_layers=32, d_model=4096, num_heads=32, kv_heads=8, head_dim=128,
                  hidden=14336, seq_len=4096, gated=True, bias=False, layer_norm=False,
                  learned_positions=False, compute_bytes=2, attention="splash")  # fmt: skip
    llama = dict(common, vocab=128256, global_batch=512)
    mixtral = dict(common, vocab=32000, global_batch=4608, experts=8, top_k=2,
                   capacity_factor=None)  # fmt: skip
    full = rp.planner.Layout(data=128, zero_stage=3, remat=True)
    dots = rp.planner.Layout(data=128, zero_stage=3, remat="dots")
    for shape, chunks in ((llama, {"loss_chunks": 8}), (mixtral, {"moe_chunks": 4})):
        for layout in (full, dots):
            whole = pricing.price(layout, rp.planner.ModelShape(**shape))
            chunked = pricing.price(layout, rp.planner.ModelShape(**shape, **chunks))
            assert chunked.peak_bytes < whole.peak_bytes - 2**32, chunks  # 4 GiB less, at least
            if layout.remat is not True and "moe_chunks" in chunks:
                assert whole.flops < chunked.flops < 1.25 * whole.flops, (chunks, layout)
            else:  # full remat's pass again leaves the mixture out: the chunks' pass is it
                assert chunked.flops == whole.flops
