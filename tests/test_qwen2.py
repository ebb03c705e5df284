"""Qwen2 (transformers' ``Qwen2ForCausalLM``), the family added in one file
(`replicator.models.families.qwen2`): Llama's decoder with biases on the query, key and value
projections. Its logits, loss and every gradient equal transformers' with the same random
weights (biases included); its checkpoint loads onto a mesh and saves back exactly; three SGD
steps on a mesh equal one device. `replicator train` fine-tunes it from ``init_from`` in
``test_llama_finetune.py``.

The models are tiny random ones built here with transformers: nothing is downloaded."""

import dataclasses
import functools
import json

import jax
import numpy as np
import optax
import pytest
from oracle import rel_err, torch_loss_and_grads

import replicator as rp
from replicator.models import gpt, hf, llama

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SIZES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=1e6,
)  # fmt: skip
TOL = {"logits": 1e-5, "grads": 1e-5}


def randomised(model):
    """``model`` with its norms away from 1 and its biases (transformers starts them at 0)
    random, so that a bias left out or misplaced shows; in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


@functools.cache
def hf_model(tied: bool):
    """A random fp32 ``Qwen2ForCausalLM`` (weights std 0.2), its `gpt.GPTConfig` and
    parameters."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        **SIZES, tie_word_embeddings=tied, initializer_range=0.2, attn_implementation="eager"
    )
    model = randomised(transformers.Qwen2ForCausalLM(cfg).float().eval())
    config = hf.decoder_config(cfg.to_dict(), seq_len=16)
    params = llama.params_from_state_dict(model.state_dict(), config=config)
    return model, config, params


def hf_batch(seed=3):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, SIZES["vocab_size"], size=(2, 17)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def test_a_qwen2_config_is_a_llamas_with_query_key_value_biases():
    _, config, params = hf_model(False)
    assert (config.qkv_bias, config.bias, config.rope_theta, config.norm_eps) == (
        True, False, 1e6, 1e-6,
    )  # fmt: skip
    assert sorted(params["blocks"]["attn"]) == ["k", "k_bias", "out", "q", "q_bias", "v", "v_bias"]
    assert sorted(params["blocks"]["mlp"]) == ["down", "gate", "up"]
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    assert jax.tree.map(np.shape, shapes) == jax.tree.map(np.shape, params)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_equal_transformers(tied):
    model, config, params = hf_model(tied)
    tokens, _ = hf_batch()
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    apply = jax.jit(functools.partial(gpt.apply, config=config))
    assert rel_err(apply(params, tokens), want) <= TOL["logits"], rel_err(
        apply(params, tokens), want
    )
    # The comparison can fail: without the query/key/value biases the logits differ.
    attn = params["blocks"]["attn"]
    unbiased = {k: (np.zeros_like(v) if k.endswith("_bias") else v) for k, v in attn.items()}
    wrong = {**params, "blocks": {**params["blocks"], "attn": unbiased}}
    assert rel_err(apply(wrong, tokens), want) > 1e-3


@pytest.mark.slow  # 1-5 s each
@pytest.mark.parametrize("attention", ["ring", "dot_product"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loss_and_every_gradient_equal_torch_autograd(tied, attention):
    """Every transformers parameter's gradient, the q/k/v biases' included, against torch's
    autograd (fp64 in both, so that the comparison is of the formulas, not of rounding)."""
    model, config, params = hf_model(tied)
    model = model.double()
    try:
        config = dataclasses.replace(config, attention=attention)
        tokens, targets = hf_batch(seed=4)
        want_loss, grads = torch_loss_and_grads(model, tokens, targets)
        want = {name: g.numpy() for name, g in grads.items()}
    finally:
        model.float()
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
        config64 = dataclasses.replace(config, dtype=np.float64)
        loss_fn = functools.partial(gpt.loss, config=config64)
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(wide, tokens, targets)
        loss, grads = float(loss), jax.tree.map(np.asarray, grads)
    got = llama.state_dict_from_params(grads, config=config)
    assert sorted(got) == sorted(want)  # tied: one table, both uses' gradients summed
    assert "model.layers.0.self_attn.q_proj.bias" in got
    assert rel_err(loss, want_loss) <= TOL["grads"]
    errs = {name: rel_err(got[name], want[name]) for name in want}
    assert max(errs.values()) <= TOL["grads"], errs


# -- the checkpoint, in and out ------------------------------------------------------------------


def numpy_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_checkpoint_loads_onto_a_mesh_and_saves_back_exactly(tmp_path, tied):
    """``save_pretrained``'s files, loaded by `hf.load` onto ``{data: 4, model: 2}`` (ZeRO-3's
    layout), equal the converted state dict bit for bit; `hf.save` writes them back as a
    Qwen2 that ``from_pretrained`` reads with the same tensors and logits."""
    model, config, params = hf_model(tied)
    source = tmp_path / "qwen2"
    model.save_pretrained(source, safe_serialization=True)
    read = hf.read_config(source)
    assert (read["model_type"], read["use_sliding_window"]) == ("qwen2", False)

    repl = rp.Replicator(mesh_shape={"data": 4, "model": 2})
    tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=3)
    place = lambda: tx.shard_params(
        gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config),
        stacked=gpt.zero_stacked(config),
    )
    loaded = hf.load(source, repl.abstract(place))
    host = jax.tree.map(
        lambda p: np.asarray(p.value if isinstance(p, rp.ShardedParam) else p),
        loaded,
        is_leaf=lambda x: isinstance(x, rp.ShardedParam),
    )
    jax.tree.map(np.testing.assert_array_equal, host, params)

    config_json = {k: v for k, v in read.items() if k != "model_type"}  # told by the biases
    out = hf.save(tmp_path / "out", loaded, config_json)
    written = json.loads((out / "config.json").read_text())
    assert (written["architectures"], written["model_type"]) == (["Qwen2ForCausalLM"], "qwen2")
    again = transformers.Qwen2ForCausalLM.from_pretrained(out, attn_implementation="eager")
    again = again.eval()
    state, want = numpy_state(again), numpy_state(model)
    assert state.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    tokens = torch.from_numpy(hf_batch()[0]).long()
    with torch.no_grad():
        np.testing.assert_array_equal(again(tokens).logits.numpy(), model(tokens).logits.numpy())


def test_save_refuses_biases_a_qwen2_does_not_have(tmp_path):
    params = hf_model(False)[2]
    attn = params["blocks"]["attn"]
    out_bias = np.zeros(attn["out"].shape[::2], np.float32)
    biased = {**params, "blocks": {**params["blocks"], "attn": attn | {"out_bias": out_bias}}}
    sizes = {"model_type": "qwen2", "num_attention_heads": 4}
    with pytest.raises(ValueError, match=r"biases on k, out, q, v .* Qwen2 has biases on q, k"):
        hf.save(tmp_path / "out", biased, sizes)


def test_sliding_windows_shorter_than_the_sequence_are_refused():
    cfg = transformers.Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match=r"sliding_window=8 is shorter than seq_len=16"):
        hf.decoder_config(cfg.to_dict(), seq_len=16)
    assert hf.decoder_config(cfg.to_dict(), seq_len=8).qkv_bias  # whole: computed exactly


# -- on a mesh: three SGD steps equal one device ---------------------------------------------------


def batches(config, n=3, seed=7):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        t = rng.integers(0, config.vocab_size, size=(8, config.seq_len + 1)).astype(np.int32)
        yield {"tokens": t[:, :-1], "targets": t[:, 1:]}


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_three_sgd_steps_on_data_and_model_axes_equal_one_device(zero_stage):
    """``{data: 2, model: 2}``: the q/k/v biases split over ``model`` with their heads (and over
    ``data`` too under ZeRO-3); parameters after 3 SGD steps equal one device's."""
    _, config, params = hf_model(False)
    loss_fn = lambda p, b: gpt.loss(p, b["tokens"], b["targets"], config=config)

    def one_device():
        p, tx = params, optax.sgd(0.1)
        opt, step = tx.init(p), jax.jit(jax.value_and_grad(loss_fn))
        for batch in batches(config):
            _, grads = step(p, batch)
            updates, opt = tx.update(grads, opt, p)
            p = optax.apply_updates(p, updates)
        return p

    repl = rp.Replicator(mesh_shape={"data": 2, "model": 2}, devices=jax.devices()[:4])
    tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=zero_stage)
    placed = gpt.place(repl, params, config=config)
    if zero_stage == 3:
        placed = tx.shard_params(placed, stacked=gpt.zero_stacked(config))
    q_bias = placed["blocks"]["attn"]["q_bias"]
    q_bias = q_bias.value if isinstance(q_bias, rp.ShardedParam) else q_bias
    assert {s.data.shape[-1] for s in q_bias.addressable_shards} == {64 // 2}  # heads on model

    def step(state, batch):
        p, opt, _ = tx.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": p, "opt": opt}, {}

    state = {"params": placed, "opt": tx.init(placed)}
    for batch in batches(config):
        state, _ = repl.run(step, state, batch)
    is_sharded = lambda x: isinstance(x, rp.ShardedParam)
    got = jax.tree.map(
        lambda p: np.asarray(p.value if is_sharded(p) else p), state["params"], is_leaf=is_sharded
    )
    want = one_device()
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    assert rel_err(got, params) > 1e-3  # training moved them
    # The biases' own updates, which are small next to the biases: a bias gradient off by a
    # factor (summed over `model` twice, say) fails here. (k's bias has no gradient: a shift of
    # every key a query sees leaves its softmax as it was.)
    moved = lambda tree, name: (
        np.asarray(tree["blocks"]["attn"][name]) - params["blocks"]["attn"][name]
    )
    for name in ("q_bias", "v_bias"):
        assert np.abs(moved(want, name)).max() > 1e-4, name
        assert rel_err(moved(got, name), moved(want, name)) <= 1e-3, name


def test_qwen2_weights_labelled_llama_are_refused_with_the_fix_that_loads_them(tmp_path):
    """A Qwen2's files under ``"model_type": "llama"``: the refusal names the fix (Qwen2's
    biases are on q, k and v only; a Llama's ``attention_bias`` would want one on o too), and
    the files load once config.json says so."""
    model, _, params = hf_model(False)
    source = tmp_path / "qwen2"
    model.save_pretrained(source, safe_serialization=True)
    path = source / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": "llama"}))

    def load():
        cfg = hf.decoder_config(hf.read_config(source), seq_len=16)
        repl = rp.Replicator(mesh_shape={"data": 2}, devices=jax.devices()[:2])
        init = lambda: gpt.place(repl, gpt.init(cfg, jax.random.key(0)), config=cfg)
        return hf.load(source, repl.abstract(init))

    with pytest.raises(ValueError, match=r"they are a Qwen2's \(biases on q, k and v only\): "
                       r'set "model_type": "qwen2"'):  # fmt: skip
        load()
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": "qwen2"}))
    loaded = jax.tree.map(np.asarray, load())
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
