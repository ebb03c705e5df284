"""The families added as one module each (`replicator.models.families`): Gemma 2, Gemma 3's
text model, Qwen3, Qwen3-MoE and Mistral, against transformers on tiny random models with their
norms away from their defaults (nothing is downloaded). For each: the logits equal
transformers', every gradient equals torch's autograd, a checkpoint saved by `hf.save` reads
back in ``from_pretrained`` bit for bit, and three SGD steps on ``{data: 2, model: 2}``, with
and without ZeRO-3, equal one device.

The configs exercise what each family adds: heads wider than ``hidden_size / heads``, sliding
windows shorter than the sequence (Gemma 2's alternating layers, Gemma 3's pattern with a last
group short of a layer, Mistral's every layer), soft caps, query/key norms, Gemma's ``1 + w``
norms, and Qwen3-MoE's many experts with raw top-k weights."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest
from oracle import decoder_sgd_steps, rel_err, torch_loss_and_grads

from replicator.models import gpt, hf, llama
from replicator.models.families import FAMILIES

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SEQ = 16
SIZES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=1e4,
)  # fmt: skip
GEMMA = dict(query_pre_attn_scalar=20, sliding_window=6, hidden_activation="gelu_pytorch_tanh")
MODELS = {  # model_type: (config class, its options, the model class)
    "gemma2": ("Gemma2Config", GEMMA | dict(attn_logit_softcapping=5.0,
                                            final_logit_softcapping=3.0), "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", GEMMA | dict(
        sliding_window_pattern=2, final_logit_softcapping=3.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e5},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}},
    ), "Gemma3ForCausalLM"),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True), "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3,
                                         moe_intermediate_size=32, norm_topk_prob=False),
                  "Qwen3MoeForCausalLM"),
    "mistral": ("MistralConfig", dict(sliding_window=5), "MistralForCausalLM"),
}  # fmt: skip
FAMILY_NAMES = list(MODELS)


def randomised(model):
    """``model`` with its norms away from their defaults (1, or 0 for Gemma's ``1 + w``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


@functools.cache
def hf_model(model_type: str):
    """A random fp32 transformers model of the family (weights std 0.2), its `GPTConfig` and
    parameters."""
    config_class, options, model_class = MODELS[model_type]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(
        **SIZES, **options, initializer_range=0.2, attn_implementation="eager"
    )
    model = randomised(getattr(transformers, model_class)(cfg).float().eval())
    config = hf.decoder_config(cfg.to_dict(), seq_len=SEQ)
    family = FAMILIES[model_type]
    params = llama.params_from_state_dict(model.state_dict(), config=config, family=family)
    return model, config, params


def hf_batch(seed=3, batch=2):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, SIZES["vocab_size"], size=(batch, SEQ + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def test_each_family_is_one_module_and_its_config_what_the_family_adds():
    assert {"gemma2", "gemma3_text", "qwen3", "qwen3_moe", "mistral"} <= set(FAMILIES)
    g2, g3 = hf_model("gemma2")[1], hf_model("gemma3_text")[1]
    assert (g2.attention_pattern, g2.sliding_window, g2.head_dim) == (("local", "global"), 6, 24)
    assert (g2.norm_offset, g2.post_norms, g2.scale_embeddings, g2.gated) == (1.0, True, True, True)
    assert (g2.attn_softcap, g2.final_softcap, g2.query_scale) == (5.0, 3.0, 20**-0.5)
    assert (g3.attention_pattern, g3.qk_norm, g3.rope_theta, g3.local_rope_theta) == (
        ("local", "global"), True, 1e5, 1e3,
    )  # fmt: skip
    q = hf_model("qwen3_moe")[1]
    assert (q.num_experts, q.top_k, q.normalize_top_k, q.hidden, q.qk_norm) == (
        8,
        3,
        False,
        32,
        True,
    )
    assert hf_model("mistral")[1].attention_pattern == ("local",)
    # what a mesh cannot build, `plan` leaves out before compiling it
    from replicator._src.planner.layouts import Layout
    from replicator._src.planner.pricing import unbuildable

    shape = gpt.model_shape(g2, 8)
    assert (shape.window, shape.local_layers, shape.head_dim) == (6, 2 / 3, 24)
    assert "whole sequences" in unbuildable(Layout(data=2, context=2), shape)
    assert "one kind" in unbuildable(
        Layout(data=2, stage=2, schedule="1f1b", microbatches=4), shape
    )
    assert unbuildable(Layout(data=2, model=2), shape) is None


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_logits_equal_transformers(model_type):
    model, config, params = hf_model(model_type)
    tokens, _ = hf_batch()
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    apply = jax.jit(functools.partial(gpt.apply, config=config))
    assert rel_err(apply(params, tokens), want) <= 1e-5, rel_err(apply(params, tokens), want)
    # The comparison can fail: attending over every key, the logits differ.
    if config.sliding_window:
        wide = dataclasses.replace(config, attention_pattern=("global",), sliding_window=None)
        assert rel_err(gpt.apply(params, tokens, config=wide), want) > 1e-3


@pytest.mark.slow  # 2-6 s each
@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_loss_and_every_gradient_equal_torch_autograd(model_type):
    """Every transformers parameter's gradient against torch's autograd (fp64 in both; fp32
    for Qwen3-MoE, whose experts' grouped matmuls torch computes in fp32 at most)."""
    model, config, params = hf_model(model_type)
    family = FAMILIES[model_type]
    wide = not config.num_experts
    model = model.double() if wide else model
    try:
        tokens, targets = hf_batch(seed=4)
        want_loss, grads = torch_loss_and_grads(model, tokens, targets)
        want = {name: g.numpy() for name, g in grads.items()}
    finally:
        model.float()
    want = dict(llama.files_state_dict(want, config=config, family=family))
    dtype = np.float64 if wide else np.float32
    with jax.enable_x64(wide):
        values = jax.tree.map(lambda x: np.asarray(x, dtype), params)
        loss_fn = functools.partial(gpt.loss, config=dataclasses.replace(config, dtype=dtype))
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(values, tokens, targets)
        loss, grads = float(loss), jax.tree.map(np.asarray, grads)
    got = llama.state_dict_from_params(grads, config=config, family=family)
    assert sorted(got) == sorted(
        set(want) - ({"lm_head.weight"} if config.tie_embeddings else set())
    )
    assert rel_err(loss, want_loss) <= 1e-6
    errs = {name: rel_err(got[name], want[name]) for name in got}
    assert max(errs.values()) <= 1e-4, errs


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_a_state_dict_without_its_family_is_refused_not_named_as_a_llamas(model_type):
    """Without ``family=`` the conversion guesses from the config's experts and biases only: a
    config beyond Llama's block (these families') is refused, where Llama's names would have
    dropped its query/key and Gemma's extra norms from the state dict, and named its norms as
    a Llama names them."""
    _, config, params = hf_model(model_type)
    with pytest.raises(ValueError, match=r"beyond Llama's block, .* pass family="):
        llama.state_dict_from_params(params, config=config)
    family = FAMILIES[model_type]
    names = llama.state_dict_from_params(params, config=config, family=family)
    leaves = len(jax.tree.leaves(params)) - 1  # the blocks' leaves are one tensor a layer
    assert len(names) >= leaves


def numpy_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_hf_save_reads_back_in_from_pretrained_bit_for_bit(tmp_path, model_type):
    model, _, params = hf_model(model_type)
    source = tmp_path / "source"
    model.save_pretrained(source, safe_serialization=True)
    read = hf.read_config(source)
    assert read["model_type"] == model_type
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    loaded = hf.load(source, hf.abstract(read, mesh))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), params)
    out = hf.save(tmp_path / "out", params, read)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [FAMILIES[model_type].architecture]
    model_class = getattr(transformers, MODELS[model_type][2])
    again = model_class.from_pretrained(out, attn_implementation="eager").float().eval()
    state, want = numpy_state(again), numpy_state(model)
    assert state.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    # without model_type, the tree tells the family where its leaves do (a Mistral's are a
    # Llama's; a Qwen3's are Gemma 3's less Gemma's norms)
    sizes = {
        k: read[k] for k in ("num_attention_heads", "head_dim", "num_experts_per_tok") if k in read
    }
    untyped = json.loads((hf.save(tmp_path / "untyped", params, sizes) / "config.json").read_text())
    assert untyped["model_type"] == {"mistral": "llama"}.get(model_type, model_type)


def batches(config, n=3, seed=7):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        t = rng.integers(0, config.vocab_size, size=(8, config.seq_len + 1)).astype(np.int32)
        yield {"tokens": t[:, :-1], "targets": t[:, 1:]}


@pytest.mark.slow  # 5-15 s each
@pytest.mark.parametrize("zero_stage", [0, 3])
@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_three_sgd_steps_on_data_and_model_axes_equal_one_device(model_type, zero_stage):
    _, config, params = hf_model(model_type)
    got, want = decoder_sgd_steps(params, config, zero_stage, batches(config))
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    assert rel_err(got, params) > 1e-3  # training moved them


@pytest.mark.slow  # 10 s
def test_a_gemma_block_in_a_pipeline_equals_one_device():
    """Gemma's options through `gpt.pipeline_value_and_grad` on ``{data: 2, stage: 2}``
    (1F1B): the scaled embeddings travel to the first stage as one device scales them; the
    loss and every gradient equal one device's. (Pipelines take one kind of layer: here every
    layer local, over a window shorter than the sequence.)"""
    import replicator as rp
    from replicator import pipeline

    config = dataclasses.replace(
        hf_model("gemma2")[1], attention_pattern=("local",), num_layers=4, qk_norm=True
    )
    params = gpt.init(config, jax.random.key(1))
    params = jax.tree.map(
        lambda a: a + 0.1 * np.random.default_rng(0).standard_normal(a.shape), params
    )
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    tokens, targets = hf_batch(seed=5, batch=8)
    loss_fn = functools.partial(gpt.loss, config=config)
    want_loss, want = jax.jit(jax.value_and_grad(loss_fn))(params, tokens, targets)
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 2}, devices=jax.devices()[:4])
    grad_fn = gpt.pipeline_value_and_grad(config, num_microbatches=2, schedule="1f1b")

    def step(p, batch):
        loss, grads = grad_fn(p, batch)
        return p, {"loss": rp.all_reduce(loss, "mean"), "grads": rp.all_reduce(grads, "mean")}

    placed = gpt.place_pipeline(repl, params, num_stages=2, config=config)
    _, out = repl.run(step, placed, {"tokens": tokens, "targets": targets})
    got = jax.tree.map(lambda a: np.asarray(a)[0], out["grads"])
    got["blocks"] = pipeline.unstack_stages(got.pop("stages"))
    assert rel_err(np.asarray(out["loss"])[0], want_loss) <= 1e-6
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
