"""Fine-tuning a Hugging Face Llama, Mixtral or Qwen2 with `replicator train`: ``init_from``
points at a directory that transformers wrote (config.json, safetensors, and a tokenizer.json
trained here on local text). The first step's loss is the reference's loss on the same batch,
and the run trains."""

import json
import pathlib
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_tokenizers import documents, train_bpe, write_documents  # noqa: E402

from replicator.cli import config as config_lib  # noqa: E402
from replicator.cli import jobs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def hf_dir(tmp_path, name: str, make_model):
    """A transformers model (``make_model(vocab_size)``, seed 0) saved in ``tmp_path / name``
    with a BPE tokenizer of its vocabulary, and text to train on: (directory, corpus, model)."""
    corpus = write_documents(tmp_path / "docs", n=40)
    directory = tmp_path / name
    directory.mkdir()
    tokenizer = train_bpe(directory / "tokenizer.json", documents(corpus), vocab_size=300)
    torch.manual_seed(0)
    model = make_model(tokenizer.get_vocab_size()).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory, corpus, model


def overrides(directory, corpus, tmp_path) -> list[str]:
    """A short fine-tuning run from ``directory`` on ``corpus``: 12 steps of 8 x 32 tokens."""
    return [
        f"init_from={directory}", f"data.path={corpus}", f"data.tokenizer={directory}/tokenizer.json",
        "data.extensions=.txt", "model.seq_len=32", "global_batch=8", "steps=12", "log_every=1",
        "learning_rate=0.01", "plot=false", f"out_dir={tmp_path / 'runs'}",
    ]  # fmt: skip


def logged_losses(tmp_path, name: str) -> list[float]:
    lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.fixture
def llama_dir(tmp_path):
    """A transformers Llama of llama_tiny's sizes, with a BPE tokenizer of its vocabulary."""
    return hf_dir(tmp_path, "hf", lambda vocab: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=176, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=128,
            tie_word_embeddings=False,
        )
    ))  # fmt: skip


def reference_loss(model, batch) -> float:
    with torch.no_grad():
        logits = model(torch.from_numpy(np.asarray(batch["tokens"], np.int64))).logits
    logp = torch.log_softmax(logits.double(), -1)
    targets = torch.from_numpy(np.asarray(batch["targets"], np.int64))
    return float(-logp.gather(-1, targets[..., None]).mean())


@pytest.mark.slow
def test_replicator_train_init_from_starts_at_the_references_loss_and_trains(tmp_path, llama_dir):
    directory, corpus, model = llama_dir
    config = config_lib.load(
        ROOT / "configs" / "llama_tiny.yaml", overrides(directory, corpus, tmp_path)
    )
    assert (config.model.family, config.model.vocab) == ("llama", model.config.vocab_size)
    repl, _, _, input_fn, _ = jobs.build(config)  # FSDP (ZeRO-3) x TP, as llama_tiny.yaml says
    first = next(iter(input_fn(repl.input_context())))
    want = reference_loss(model, first)
    jobs.run(config)
    losses = logged_losses(tmp_path, "llama_tiny")
    assert abs(losses[0] - want) <= 1e-5 * want, (losses[0], want)
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses


def test_init_from_takes_the_checkpoints_sizes_and_refuses_others(tmp_path, llama_dir):
    directory = llama_dir[0]
    config = config_lib.load(ROOT / "configs" / "llama_tiny.yaml", [f"init_from={directory}"])
    m = config.model
    assert (m.kind, m.family, m.d_model, m.layers, m.heads, m.kv_heads, m.d_ff) == (
        "gpt", "llama", 64, 4, 4, 2, 176,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"model.d_model=128, but the checkpoint's config.json has "
                       r"hidden_size=64; remove model.d_model"):  # fmt: skip
        config_lib.load(
            ROOT / "configs" / "llama_tiny.yaml", [f"init_from={directory}", "model.d_model=128"]
        )
    with pytest.raises(ValueError, match=r"init_from='.*nowhere'"):
        config_lib.load(ROOT / "configs" / "llama_tiny.yaml", [f"init_from={tmp_path}/nowhere"])


@pytest.fixture
def mixtral_dir(tmp_path):
    """A transformers Mixtral of mixtral_tiny's sizes (4 experts, top-2), with a BPE tokenizer."""
    return hf_dir(tmp_path, "hf-mixtral", lambda vocab: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=3, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1,
        )
    ))  # fmt: skip


@pytest.mark.slow
def test_a_mixtral_fine_tunes_on_expert_and_model_axes_from_the_references_loss(
    tmp_path, mixtral_dir
):
    """``init_from`` a Mixtral: the checkpoint sets the experts, top-2 and dropless routing
    without a load-balancing loss (the reference's loss is the cross-entropy alone), the
    experts load onto ``{data: 2, expert: 2, model: 2}``; the first loss is transformers'."""
    directory, corpus, model = mixtral_dir
    load = lambda *more: config_lib.load(
        ROOT / "configs" / "mixtral_tiny.yaml", [*overrides(directory, corpus, tmp_path), *more]
    )
    config = load()
    m = config.model
    assert (m.experts, m.top_k, m.layers, m.d_ff) == (4, 2, 3, 96)  # the file says 4 layers
    model_config = jobs.gpt_config(config)
    assert (model_config.capacity_factor, model_config.aux_weight) == (None, 0.0)
    chosen = jobs.gpt_config(load("model.capacity_factor=1.5", "model.aux_weight=0.1"))
    assert (chosen.capacity_factor, chosen.aux_weight) == (1.5, 0.1)  # set: kept
    repl, _, _, input_fn, _ = jobs.build(config)
    first = next(iter(input_fn(repl.input_context())))
    want = reference_loss(model, first)
    jobs.run(config)
    losses = logged_losses(tmp_path, "mixtral_tiny")
    assert abs(losses[0] - want) <= 1e-5 * want, (losses[0], want)
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses


@pytest.mark.slow
def test_replicator_train_init_from_a_qwen2_starts_at_its_loss_and_trains(tmp_path):
    """``replicator train configs/llama_tiny.yaml init_from=<a Qwen2>``: the checkpoint sets
    the family (its query/key/value biases, random here, and its tied head), loads onto
    llama_tiny's FSDP x TP layout, and the first step's loss is transformers' on the batch."""
    from test_qwen2 import randomised

    from replicator import cli

    directory, corpus, model = hf_dir(tmp_path, "qwen2", lambda vocab: randomised(
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=176, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=128,
            tie_word_embeddings=True,
        ))
    ))  # fmt: skip
    args = overrides(directory, corpus, tmp_path)
    config = config_lib.load(ROOT / "configs" / "llama_tiny.yaml", args)
    assert jobs.gpt_config(config).qkv_bias
    repl, _, _, input_fn, _ = jobs.build(config)
    want = reference_loss(model, next(iter(input_fn(repl.input_context()))))
    assert cli.main(["train", str(ROOT / "configs" / "llama_tiny.yaml"), *args]) == 0
    losses = logged_losses(tmp_path, "llama_tiny")
    assert abs(losses[0] - want) <= 1e-5 * want, (losses[0], want)
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses


@pytest.mark.slow
def test_init_from_under_the_launcher_equals_one_process(tmp_path, llama_dir):
    """Two processes read their own slices of the checkpoint straight into ZeRO-3's parts (no
    device holds a whole weight first) and train as one process does."""
    import subprocess

    directory, corpus, _ = llama_dir
    args = [
        "train", "configs/llama_tiny.yaml", f"init_from={directory}", f"data.path={corpus}",
        f"data.tokenizer={directory}/tokenizer.json", "data.extensions=.txt", "model.seq_len=32",
        "global_batch=8", "steps=3", "log_every=1", "plot=false",
    ]  # fmt: skip
    launch = [sys.executable, "-m", "replicator.launch", "-n", "2", "--devices-per-process", "4"]
    losses = {}
    for name, prefix in (("one", [sys.executable]), ("two", [*launch, "--", sys.executable])):
        cmd = [*prefix, "-m", "replicator.cli", *args, f"out_dir={tmp_path / name}"]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        lines = (tmp_path / name / "llama_tiny" / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in lines]
    assert len(losses["one"]) == 3
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=1e-5)
