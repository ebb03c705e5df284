"""`replicator.models.generate`: decoding with a key/value cache. Its logits are the model's
(`gpt.apply` on the whole sequence), its greedy tokens transformers' ``generate``'s (Llama,
Qwen2, Gemma 2), on one device and over ``model``; sampling is seeded and stays in the top-p
nucleus; and ``replicator sample`` prints text from a run or a Hugging Face checkpoint."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
import pytest

import replicator as rp
from replicator.models import generate, gpt
from replicator.models.generation import _forced_logits

ROOT = pathlib.Path(__file__).resolve().parent.parent

CONFIGS = {
    "gpt2": gpt.GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=4, num_layers=2),
    "llama": gpt.GPTConfig(
        vocab_size=64, seq_len=16, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2,
        d_ff=48, norm="rms", position="rope", mlp="swiglu", bias=False, tie_embeddings=True,
    ),
    # Gemma 2's and 3's options, 3 layers (a group of the pattern and a tail), the sequence
    # longer than the window
    "windowed": gpt.GPTConfig(
        vocab_size=64, seq_len=16, d_model=32, num_heads=4, num_kv_heads=2, head_width=16,
        num_layers=3, d_ff=48, norm="rms", position="rope", mlp="geglu", bias=False,
        norm_offset=1.0, scale_embeddings=True, post_norms=True, qk_norm=True,
        query_scale=0.2, attn_softcap=5.0, final_softcap=3.0, local_rope_theta=100.0,
        attention_pattern=("local", "global"), sliding_window=4,
    ),
    "moe": gpt.GPTConfig(
        vocab_size=64, seq_len=16, d_model=32, num_heads=4, num_kv_heads=2, num_layers=4,
        d_ff=48, norm="rms", position="rope", mlp="swiglu", bias=False, num_experts=4,
        top_k=2, capacity_factor=None, moe_every=2,
    ),
}  # fmt: skip


def perturbed(config, seed=0, scale=0.05):
    """`gpt.init`'s parameters with every leaf moved off its initial value (norm scales off
    one, biases off zero)."""
    params = gpt.init(config, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    moved = [np.asarray(a) + scale * rng.standard_normal(a.shape, np.float32) for a in leaves]
    return jax.tree.unflatten(tree, moved)


@pytest.mark.parametrize(
    "name", [n if n in ("gpt2", "llama") else pytest.param(n, marks=pytest.mark.slow)
             for n in CONFIGS],  # the windowed and mixture configs: 6 s each
)  # fmt: skip
def test_cached_logits_equal_the_model(name):
    config = CONFIGS[name]
    params = perturbed(config)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 12)).astype(np.int32)
    want = np.asarray(gpt.apply(params, tokens, config=config))[:, 4:]
    got = np.asarray(_forced_logits(params, tokens, config=config, prompt_len=5))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # greedy: each new token the argmax of the model's logits before it
    out = np.asarray(generate(params, config, tokens[:, :5], 7))
    assert (out[:, :5] == tokens[:, :5]).all()
    logits = np.asarray(gpt.apply(params, out, config=config))
    assert (out[:, 5:] == logits[:, 4:-1].argmax(-1)).all()


def numpy_nucleus(logits, top_p):
    """transformers' top-p: the most probable tokens until their sum reaches top_p."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, -1)
    before = np.cumsum(ranked, -1) - ranked
    keep = np.zeros(p.shape, bool)
    np.put_along_axis(keep, order, before < top_p, -1)
    return keep


def test_sampling_is_seeded_and_stays_in_the_nucleus():
    prompt = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)

    def sample(config, params, seed):
        out = generate(params, config, prompt, 12, temperature=0.8, top_p=0.9, seed=seed)
        return np.asarray(out)

    config = CONFIGS["llama"]
    params = perturbed(config)
    a = sample(config, params, 0)
    assert (a == sample(config, params, 0)).all()
    assert (a != sample(config, params, 1)).any()  # near-uniform over 64: 24 draws alike ~1e-40
    # a peaked model (its head scaled up; a nucleus of some 10 of its 64 tokens, which about one
    # draw in ten leaves at top_p=1): every draw in the nucleus of its step, as numpy finds it
    config = CONFIGS["gpt2"]
    params = perturbed(config)
    sharp = {**params, "head": {**params["head"], "w": params["head"]["w"] * 8}}
    sizes = []
    for seed in range(3):
        out = sample(config, sharp, seed)
        logits = np.asarray(gpt.apply(sharp, out, config=config))[:, 3:-1] / 0.8
        keep = numpy_nucleus(logits, 0.9)
        assert np.take_along_axis(keep, out[:, 4:, None], -1).all(), (seed, out)
        sizes.append(keep.sum(-1))
    assert 1 < np.mean(sizes) < config.vocab_size / 4, sizes  # the nucleus leaves tokens out


def _repl(mesh_shape):
    n = int(np.prod(list(mesh_shape.values())))
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


@pytest.mark.slow  # 4 s each; the greedy tokens on a mesh are checked against transformers' too
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generate_on_a_mesh_equals_one_device(name):
    config = CONFIGS[name]
    params = perturbed(config)
    prompt = np.random.default_rng(2).integers(0, 64, (2, 6)).astype(np.int32)
    for kw in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}):
        want = np.asarray(generate(params, config, prompt, 8, **kw))
        got = generate(params, config, prompt, 8, repl=_repl({"data": 2, "model": 2}), **kw)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_cache_is_split_over_data_and_model():
    """On {data: 2, model: 2} each device holds its prompt's and its key/value head's cache:
    ``[layers, B / 2, P + N, KV / 2, head_dim]``, in the compiled program."""
    import re

    from replicator.models import generation

    config = CONFIGS["llama"]  # 2 layers, 2 key/value heads of 8
    prompt = np.ones((2, 4), np.int32)
    params, prompt, cache = generation._on_mesh(
        _repl({"data": 2, "model": 2}), perturbed(config), prompt, config
    )
    plan = generation._Plan(config, 8, False, cache)
    key, zero, one = jax.random.key(0), np.float32(0), np.float32(1)
    text = generation._program.lower(params, prompt, key, zero, one, plan).compile().as_text()
    assert set(re.findall(r"f32\[2,\d+,12,\d+,8\]", text)) == {"f32[2,1,12,1,8]"}


def test_generate_checks_its_arguments():
    config = CONFIGS["gpt2"]
    params = gpt.init(config, jax.random.key(0))
    cases = [
        (dict(max_new_tokens=-1), r"max_new_tokens=-1 is negative"),
        (dict(temperature=-0.5), r"temperature=-0.5; use 0 for greedy"),
        (dict(top_p=0.0), r"top_p=0.0 is outside \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 is outside \(0, 1\]"),
        (dict(max_new_tokens=13), r"4 tokens plus max_new_tokens=13 is 17 tokens, but the "
         r"learned position table allows seq_len=16; use max_new_tokens <= 12"),
        (dict(prompt_ids=[1.5, 2.0]), r"prompt_ids must be \[batch, length\] int token ids"),
        (dict(prompt_ids=[1, 99]), r"ids from 1 to 99, outside the vocabulary's 0 to 63"),
    ]  # fmt: skip
    for overrides, match in cases:
        kw = {"prompt_ids": [1, 2, 3, 4], "max_new_tokens": 2} | overrides
        with pytest.raises(ValueError, match=match):
            generate(params, config, kw.pop("prompt_ids"), kw.pop("max_new_tokens"), **kw)
    rope = dataclasses.replace(CONFIGS["llama"], seq_len=8)
    with pytest.raises(ValueError, match=r"dataclasses.replace\(config, seq_len=...\)"):
        generate(perturbed(rope), rope, [1, 2, 3], 6)
    with pytest.raises(ValueError, match=r"generation runs over 'data' .* and 'model'"):
        generate(params, config, [1, 2], 2, repl=_repl({"data": 2, "stage": 2}))
    assert np.asarray(generate(params, config, [1, 2], 0)).tolist() == [1, 2]


def _hf_models():
    t = pytest.importorskip("transformers")
    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**sizes, tie_word_embeddings=False)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**sizes, tie_word_embeddings=True)),
        # the sequence (12 + 32) longer than the local layers' window; caps that bite
        "gemma2": lambda: t.Gemma2ForCausalLM(
            t.Gemma2Config(
                **sizes, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
            )
        ),
    }  # fmt: skip


def hf_model(family: str):
    """A tiny transformers model in fp32, eager attention, its norms' weights and its biases
    moved off their initial values, and generation that never stops early (no EOS)."""
    import torch

    torch.manual_seed(0)
    model = _hf_models()[family]()
    model.config._attn_implementation = "eager"  # Gemma 2's soft caps need it
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                w.add_(0.1 * torch.randn_like(w))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_params(model, seq_len=64):
    """Our config and parameters of a transformers model: `hf.decoder_config`'s and
    `llama.params_from_state_dict`'s."""
    from replicator.models import hf, llama
    from replicator.models.families import FAMILIES

    hf_config = model.config.to_dict()
    config = hf.decoder_config(hf_config, seq_len=seq_len)
    family = FAMILIES[hf_config["model_type"]]
    return config, llama.params_from_state_dict(model.state_dict(), config=config, family=family)


@pytest.mark.parametrize("mesh", [None, {"data": 1, "model": 2}])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_greedy_tokens_equal_transformers(family, mesh):
    import torch

    model = hf_model(family)
    config, params = hf_params(model)
    prompt = np.random.default_rng(0).integers(3, 96, (2, 12))
    with torch.no_grad():
        want = model.generate(
            torch.from_numpy(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            do_sample=False, max_new_tokens=32, min_new_tokens=32,
        ).numpy()  # fmt: skip
    assert want.shape == (2, 44)
    got = generate(params, config, prompt, 32, repl=None if mesh is None else _repl(mesh))
    np.testing.assert_array_equal(np.asarray(got), want)


def _sample(capsys, *args) -> str:
    """``replicator sample ARGS`` in this process: what it printed (exit code 0)."""
    from replicator import cli

    code = cli.main(["sample", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return out


@pytest.mark.slow  # trains llama_tiny two steps first (ZeRO-3 x TP on 8 devices): ~10 s
def test_replicator_sample_continues_a_runs_prompt(tmp_path, capsys):
    from replicator import cli

    config = ROOT / "configs" / "llama_tiny.yaml"
    args = ["steps=2", "checkpoint_every=2", "global_batch=8", "plot=false"]
    assert cli.main(["train", str(config), f"out_dir={tmp_path}", *args]) == 0
    capsys.readouterr()
    run = tmp_path / "llama_tiny"
    greedy = _sample(capsys, config, "--run", run, "--prompt", "hello", "--max-new-tokens", 8)
    assert greedy.startswith("hello") and len(greedy) > len("hello\n"), greedy
    # the config's own run directory by default; sampled, seeded
    sampled = [
        _sample(capsys, config, f"out_dir={tmp_path}", "--prompt", "hello", "--max-new-tokens",
                8, "--temperature", "0.8", "--top-p", "0.9", "--seed", seed)
        for seed in (1, 1)
    ]  # fmt: skip
    assert sampled[0] == sampled[1] and sampled[0].startswith("hello")
    code = cli.main(["sample", str(config), f"out_dir={tmp_path}", "model.d_model=32",
                     "--prompt", "hello", "--max-new-tokens", "8"])  # fmt: skip
    assert code == 2
    assert "does not hold the config's model: params['blocks']['attn']['k'] is [4, 64, 32], and " \
        "the config gives [4, 32, 16]" in capsys.readouterr().err  # fmt: skip
    code = cli.main(["sample", str(config), f"out_dir={tmp_path}", "--prompt", "hello",
                     "--max-new-tokens", "80"])  # fmt: skip
    assert code == 2
    assert "over model.seq_len=64; give --max-new-tokens 59 or fewer" in capsys.readouterr().err


def test_replicator_sample_init_from_a_hugging_face_checkpoint(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from test_tokenizers import documents, train_bpe, write_documents

    from replicator.models import hf

    corpus = write_documents(tmp_path / "docs", n=12)
    directory = tmp_path / "hf"
    tokenizer = train_bpe(tmp_path / "tokenizer.json", documents(corpus), vocab_size=300)
    sizes = {"model_type": "llama", "vocab_size": tokenizer.get_vocab_size(), "hidden_size": 32,
             "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2, "max_position_embeddings": 64}  # fmt: skip
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(s.dtype), hf.shapes(sizes))
    hf.save(directory, params, sizes)
    (directory / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text())
    prompt = "the quick brown fox"
    out = _sample(capsys, ROOT / "configs" / "llama_tiny.yaml", f"init_from={directory}",
                  "--prompt", prompt, "--max-new-tokens", 8)  # fmt: skip
    config = hf.decoder_config(sizes, seq_len=64)
    ids = tokenizer.encode(prompt).ids  # with its BOS, as a Hugging Face model reads it
    want = tokenizer.decode(np.asarray(generate(params, config, ids, 8)).tolist())
    assert out == want + "\n" and out.startswith(prompt), (out, want)
