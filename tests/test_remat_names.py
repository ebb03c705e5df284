"""Remat by activation name (MaxText's presets, a per-name mapping, host offload): every policy
trains as one device, and each keeps what it names."""

import dataclasses

import jax
import pytest
from oracle import rel_err
from test_llama import CONFIG, batches, check_against_oracle, make_repl, train

import replicator as rp
from replicator._src.pipeline import remat as remat_lib
from replicator.models import gpt

#: MaxText's Llama 3.1 8B recipe on v6e-256: the layer input and the attention's projections
#: kept in host memory, the rest recomputed.
OFFLOADED = {name: "offload" for name in
             ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")}  # fmt: skip


@pytest.mark.parametrize(
    "policy, mesh, zero_stage",
    [
        ("save_dot_except_mlpwi", {"data": 4}, 3),
        ("minimal_offloaded", {"data": 2, "model": 2}, 3),
        (OFFLOADED, {"data": 4}, 0),
    ],
    ids=["save_dot_except_mlpwi-zero3", "minimal_offloaded-fsdp-tp", "custom-offload"],
)
def test_remat_by_name_trains_as_one_device(policy, mesh, zero_stage):
    """Three SGD steps under the policy equal three on one device with nothing recomputed."""
    config = dataclasses.replace(CONFIG, remat=policy)
    check_against_oracle(*train(make_repl(mesh), config, zero_stage=zero_stage)[:2])


@pytest.mark.slow  # a compile per preset
def test_every_preset_gives_one_devices_loss_and_gradients():
    """Each of MaxText's presets (and replicator's own) computes the loss and gradients that
    keeping everything does, on one device."""
    params, batch = gpt.init(CONFIG, jax.random.key(3)), batches(1, seed=4)[0]

    def grads(policy):
        config = dataclasses.replace(CONFIG, remat=policy)
        loss = lambda p: gpt.loss(p, batch["tokens"], batch["targets"], config=config)
        return jax.jit(jax.value_and_grad(loss))(params)

    want = grads("none")
    for name in rp.pipeline.REMAT_PRESETS:
        assert rel_err(grads(name), want) <= 1e-6, name


def test_each_policy_keeps_what_it_names():
    """The compiled step recomputes less the more a policy saves: full > save_out_proj >
    save_dot_except_mlpwi > minimal; a name left out is recomputed, so a policy that ignored the
    names would read as full."""
    repl, batch = make_repl({"data": 1}), batches(1)[0]
    params = gpt.init(CONFIG, jax.random.key(0))
    flops = {}
    for policy in ("full", "save_out_proj", "save_dot_except_mlpwi", "minimal"):
        config = dataclasses.replace(CONFIG, remat=policy)
        grad = jax.grad(lambda p, b, c=config: gpt.loss(p, b["tokens"], b["targets"], config=c))
        flops[policy] = repl.explain(lambda p, b, g=grad: (p, g(p, b)), params, batch).flops
    order = [flops[p] for p in ("full", "save_out_proj", "save_dot_except_mlpwi", "minimal")]
    assert order == sorted(order, reverse=True) and len(set(order)) == 4, flops


def test_policies_by_name_are_hashable_and_refuse_unknown_names():
    a = gpt.GPTConfig(remat={"out_proj": "device", "decoder_layer_input": "offload"})
    b = gpt.GPTConfig(remat={"decoder_layer_input": "offload", "out_proj": "save"})
    assert a == b and hash(a) == hash(b) and a.remat.offloaded == ("decoder_layer_input",)
    assert remat_lib.as_remat("save_qkv_proj", "f") == remat_lib.as_remat("save_qkv_proj", "g")
    with pytest.raises(ValueError, match=r"'mlp_in' the decoder does not name; use one of"):
        gpt.GPTConfig(remat={"mlp_in": "save"})
    with pytest.raises(ValueError, match=r"remat\['mlpwo'\]='host'; use 'save'"):
        gpt.GPTConfig(remat={"mlpwo": "host"})
    with pytest.raises(ValueError, match=r"'save_dot_except_mlpwi'.*got 'save_dots'"):
        gpt.GPTConfig(remat="save_dots")
    stage = lambda w, x: x @ w
    with pytest.raises(
        ValueError,
        match=r"offloads key_proj, query_proj, value_proj to host.* a pipeline's schedules",
    ):
        rp.pipeline.value_and_grad(
            stage, lambda *a: 0.0, num_microbatches=2, remat="qkv_proj_offloaded"
        )


@pytest.mark.slow
def test_offloaded_activations_move_over_the_host_link_in_the_tpu_program():
    """On a TPU target the offloaded activations live in host memory (the program's memory
    space 5): written once in the forward pass and read once in the backward, per layer. The
    report counts exactly those bytes, charges them at the chip's host link, and does not count
    the host buffers as HBM traffic."""
    pytest.importorskip("libtpu")
    import jax.numpy as jnp

    from replicator.models import llama

    base = llama.config(vocab_size=256, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2,
                        d_ff=512, seq_len=256, dtype=jnp.bfloat16)  # fmt: skip
    repl = rp.Replicator(mesh_shape={"data": 4}, devices=rp.tpu_devices("v5p-8"))
    tokens = jax.ShapeDtypeStruct((16, 256), jnp.int32)
    reports = {}
    for name, policy in (("full", "full"), ("offload", {"decoder_layer_input": "offload",
                                                        "query_proj": "offload"})):  # fmt: skip
        config = dataclasses.replace(base, remat=policy)
        grad = jax.grad(lambda p, t, c=config: gpt.loss(p, t, t, config=c))
        params = repl.abstract(lambda c=config: repl.replicate(gpt.init(c, jax.random.key(0))))
        reports[name] = repl.explain(lambda p, t, g=grad: (p, g(p, t)), params, tokens)
    r, full = reports["offload"], reports["full"]
    # per chip: 4 sequences x 256 tokens x 256 wide in bf16, two activations, two layers, twice
    # (libtpu 0.0.42.1: exactly; 0.0.50.1 adds a round trip of one activation outside the loop)
    ideal = 2 * 2 * 2 * (4 * 256 * 256 * 2)
    assert ideal <= r.host_bytes <= 1.25 * ideal and full.host_bytes == 0
    assert r.memory.host >= ideal / 2 and full.memory.host == 0
    hw = rp.planner.HARDWARE_PROFILES["tpu-v5p"]
    assert r.target.host_seconds == pytest.approx(r.host_bytes / hw.host_bandwidth)
    assert r.bytes_accessed < 1.5 * full.bytes_accessed
