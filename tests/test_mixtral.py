"""Mixtral on the GPT's machinery (a Llama whose MLPs are mixtures of SwiGLU experts, top-2,
dropless): its logits, loss and every gradient equal transformers' ``MixtralForCausalLM`` with
the same weights; its parameters convert both ways (the files' per-expert names and
transformers 5's fused experts); on meshes with ``expert``, ``model`` and ZeRO-3 three SGD steps
equal one device."""

import copy
import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from oracle import rel_err, torch_loss_and_grads
from test_gpt_moe import make_repl, oracle, shard_shapes, train

from replicator.models import gpt, hf, llama

TOL = {"logits": 1e-5, "grads": 1e-4, "mesh": 1e-5}
LR = 0.1  # SGD
HF_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)


@functools.cache
def hf_model():
    """A random fp32 ``MixtralForCausalLM`` (vocab 128, hidden 64, 4 heads, 2 key/value heads,
    3 layers of 4 experts of 96 hidden units, top-2), weights of std 0.2 so that attention and
    routing are far from uniform, norm scales 1 +- 0.1; and its converted parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.MixtralConfig(
        **HF_SIZES, rms_norm_eps=1e-5, initializer_range=0.2, attn_implementation="eager"
    )
    model = transformers.MixtralForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    config = hf.decoder_config(hf_config.to_dict(), seq_len=16)
    params = llama.params_from_state_dict(model.state_dict(), config=config)
    return model, config, params


def hf_batch(seed=3):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, 128, size=(2, 17)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def test_decoder_config_of_a_mixtral_is_a_dropless_top2_llama_of_experts():
    _, config, params = hf_model()
    assert (config.num_experts, config.top_k, config.capacity_factor) == (4, 2, None)
    assert (config.activation, config.gated, config.norm, config.num_kv_heads, config.bias) == (
        "silu",
        True,
        "rms",
        2,
        False,
    )
    assert (config.aux_weight, config.rope_theta) == (0.0, 1e6)
    experts = params["blocks"]["moe"]["moe"]
    assert {k: v.shape for k, v in experts.items()} == {
        "router": (3, 64, 4),
        "gate": (3, 4, 64, 96),
        "up": (3, 4, 64, 96),
        "down": (3, 4, 96, 64),
    }


@pytest.mark.slow  # 3-6 s (imports torch and transformers)
def test_logits_equal_transformers():
    torch = pytest.importorskip("torch")
    model, config, params = hf_model()
    tokens, _ = hf_batch()
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    got = np.asarray(jax.jit(functools.partial(gpt.apply, config=config))(params, tokens))
    assert rel_err(got, want) <= TOL["logits"], rel_err(got, want)
    # The comparison can fail: top-1 routing gives other logits.
    wrong = dataclasses.replace(config, top_k=1)
    assert rel_err(gpt.apply(params, tokens, config=wrong), want) > 1e-3


@pytest.mark.slow  # 2-4 s
def test_loss_and_every_gradient_equal_torch_autograd():
    """The next-token cross-entropy and the gradient of every transformers parameter (the
    router's through the renormalised top-2 gates included), against torch's autograd."""
    pytest.importorskip("torch")
    model, config, params = hf_model()
    tokens, targets = hf_batch(seed=4)
    want_loss, grads = torch_loss_and_grads(model, tokens, targets)
    want = llama.params_from_state_dict(grads, config=config)  # fused -> our tree
    loss_fn = functools.partial(gpt.loss, config=config)
    loss, got = jax.jit(jax.value_and_grad(loss_fn))(params, tokens, targets)
    assert rel_err(float(loss), want_loss) <= TOL["grads"]
    errs = jax.tree.map(rel_err, jax.tree.map(np.asarray, got), want)
    worst = max(jax.tree.leaves(errs))
    assert worst <= TOL["grads"], errs
    assert float(np.abs(got["blocks"]["moe"]["moe"]["router"]).max()) > 1e-4  # routers learn


@pytest.mark.slow  # 3-6 s
def test_three_sgd_steps_equal_torch():
    """Three SGD steps of the dropless experts (the routed rows sorted by expert, a grouped
    matmul each) against three of ``torch.optim.SGD`` on transformers' Mixtral, each step its
    own batch: every parameter after them, converted back to the files' names."""
    torch = pytest.importorskip("torch")
    model, config, params = hf_model()
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grad = jax.jit(jax.grad(functools.partial(gpt.loss, config=config)))
    for seed in (5, 6, 7):
        tokens, targets = hf_batch(seed)
        opt.zero_grad()
        logits = model(input_ids=torch.from_numpy(tokens).long()).logits
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, config.vocab_size), torch.from_numpy(targets).long().reshape(-1)
        ).backward()
        opt.step()
        params = jax.tree.map(lambda p, g: p - LR * g, params, grad(params, tokens, targets))
    want = llama.params_from_state_dict(model.state_dict(), config=config)
    got = jax.tree.map(np.asarray, params)
    assert rel_err(got, want) <= TOL["grads"], rel_err(got, want)
    assert rel_err(got, hf_model()[2]) > 1e-3  # the steps moved them


def test_state_dict_round_trip_per_expert_and_fused():
    config = llama.config(vocab_size=32, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                          d_ff=24, num_experts=3, top_k=2, capacity_factor=None)  # fmt: skip
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), shapes)
    state = llama.state_dict_from_params(params, config=config)
    assert state["model.layers.1.block_sparse_moe.gate.weight"].shape == (3, 16)
    assert state["model.layers.1.block_sparse_moe.experts.2.w1.weight"].shape == (24, 16)
    assert state["model.layers.0.block_sparse_moe.experts.0.w2.weight"].shape == (16, 24)
    assert len(state) == 1 + 2 * (6 + 1 + 3 * 3) + 2
    back = llama.params_from_state_dict(state, config=config)
    assert rel_err(back, params) == 0
    np.testing.assert_array_equal(  # w3 is the up projection of expert 2, transposed
        state["model.layers.1.block_sparse_moe.experts.2.w3.weight"],
        params["blocks"]["moe"]["moe"]["up"][1, 2].T,
    )
    fused = {k: v for k, v in state.items() if "block_sparse_moe" not in k}
    for i in range(2):
        e = lambda w, i=i: np.stack(
            [state[f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight"] for j in range(3)]
        )
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate(
            [e("w1"), e("w3")], axis=1
        )
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = e("w2")
        fused[f"model.layers.{i}.mlp.gate.weight"] = state[
            f"model.layers.{i}.block_sparse_moe.gate.weight"
        ]
    assert rel_err(llama.params_from_state_dict(fused, config=config), params) == 0
    del state["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    with pytest.raises(ValueError, match=r"2-layer Mixtral.*missing \['model.layers.1.block_spa"):
        llama.params_from_state_dict(state, config=config)


def test_mixtral_configs_the_gpt_cannot_compute_are_refused():
    base = {**HF_SIZES, "model_type": "mixtral"}
    with pytest.raises(ValueError, match=r"sliding_window=8 is shorter than seq_len=16"):
        hf.decoder_config(base | {"sliding_window": 8}, seq_len=16)
    assert hf.decoder_config(base | {"sliding_window": 16}, seq_len=16).seq_len == 16
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.01: the router's multiplicative"):
        hf.decoder_config(base | {"router_jitter_noise": 0.01})
    with pytest.raises(
        ValueError, match=r"model_type='qwen2_moe'; this reads the configs of llama, mixtral, qwen2"
    ):
        hf.decoder_config(base | {"model_type": "qwen2_moe"})


MIXTRAL = llama.config(
    vocab_size=64, seq_len=16, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=48,
    num_experts=4, top_k=2, capacity_factor=None, aux_weight=0.01,
)  # fmt: skip


@pytest.mark.slow  # 10-15 s each
@pytest.mark.parametrize(
    "mesh, zero_stage",
    [({"data": 2, "expert": 2, "model": 2}, 0), ({"data": 2, "expert": 4}, 3)],
)
def test_mixtral_on_expert_model_and_zero3_meshes_trains_as_one_device(mesh, zero_stage):
    """The SwiGLU experts (``gate``, ``up``, ``down``, no biases) split by expert over
    ``expert``, their hidden units over ``model``, and with ZeRO-3 over ``data``; GQA with RoPE
    around them; three SGD steps, dropless (none dropped), equal one device."""
    got, losses, stats, stored = train(make_repl(mesh), MIXTRAL, zero_stage)
    want, want_losses, want_stats = oracle(MIXTRAL)
    assert rel_err(got, want) <= TOL["mesh"], rel_err(got, want)
    assert rel_err(losses, want_losses) <= TOL["mesh"], (losses, want_losses)
    assert [int(s["dropped"]) for s in stats] == [int(s["dropped"]) for s in want_stats] == [0] * 3
    gate = stored["blocks"]["moe"]["moe"]["gate"]
    if zero_stage == 0:
        assert gate.sharding.spec == P(None, "expert", None, "model")
        assert shard_shapes(gate) == {(2, 2, 32, 24)}
    else:
        assert shard_shapes(gate.value) == {(2, 1, 16, 48)}


def test_a_mixture_of_experts_with_biases_is_refused_by_the_conversion():
    """transformers' Mixtral has no biases: with ``bias=True`` the attention biases would have
    no name, so converting them is refused rather than left out (or left uninitialised)."""
    config = llama.config(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                          d_ff=24, num_experts=2, top_k=2, bias=True)  # fmt: skip
    params = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    with pytest.raises(ValueError, match=r"bias=False: a Mixtral has no biases"):
        llama.state_dict_from_params(params, config=config)
    with pytest.raises(ValueError, match=r"bias=False: a Mixtral has no biases"):
        llama.params_from_state_dict({}, config=config)
