"""`replicator train`'s data.tokenizer: text encoded by a Hugging Face tokenizer.json or a
SentencePiece model, each document followed by the tokenizer's EOS, packed into windows, and
served as the byte path serves bytes. The tokenizers are trained here, on local text."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator import cli
from replicator.cli import config as config_lib
from replicator.cli import data as data_lib
from replicator.cli.data import DataConfig
from replicator.cli.data import tokenizer as data_tokenizer

tokenizers = pytest.importorskip("tokenizers")
sentencepiece = pytest.importorskip("sentencepiece")

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIKE_GPT = {"tokens": np.zeros((2, 8), np.int32), "targets": np.zeros((2, 8), np.int32)}
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda",
         "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "mesh", "replica",
         "shard", "gradient", "pipeline", "Python", "JAX", "42", "1989", "why?", "(sic)"]  # fmt: skip


def write_documents(directory, n=12, seed=0):
    """``n`` text files of a few sentences (one of them empty), and a file not read."""
    rng = np.random.default_rng(seed)
    directory.mkdir(exist_ok=True)
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS, rng.integers(3, 12))) + "." for _ in range(4)]
        (directory / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n" if i != 5 else "")
    (directory / "skip.bin").write_bytes(b"\xff" * 50)
    return directory


def documents(directory):
    """What data.path reads as documents: its .txt files, sorted, the empty one left out."""
    texts = [p.read_text() for p in sorted(directory.glob("*.txt"))]
    return [t for t in texts if t]


def train_bpe(path, texts, special=("<|endoftext|>",), vocab_size=300):
    """A byte-level BPE tokenizer.json trained on ``texts``, adding a BOS to what it encodes
    (a post-processor: replicator encodes without it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", *special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path))
    return tok


def train_sentencepiece(prefix, texts, **options):
    corpus = pathlib.Path(f"{prefix}.txt")
    corpus.write_text("".join(texts))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(prefix), vocab_size=60, minloglevel=2, **options
    )
    return sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")


def packed(encoded, eos, seq_len=8):
    """The expected examples: each document's ids, then ``eos``, cut into windows."""
    stream = np.array([t for ids in encoded for t in [*ids, eos]])
    n = (len(stream) - 1) // seq_len
    rows = np.stack([stream[seq_len * i : seq_len * i + seq_len + 1] for i in range(n)])
    return {"tokens": rows[:, :-1], "targets": rows[:, 1:]}


def assert_examples_equal(found, want):
    assert set(found) == set(want) and found["tokens"].dtype == np.int32
    for key in want:
        np.testing.assert_array_equal(found[key], want[key])


@pytest.fixture
def corpus(tmp_path):
    return write_documents(tmp_path / "docs")


@pytest.fixture
def bpe(tmp_path, corpus):
    return train_bpe(tmp_path / "tokenizer.json", documents(corpus)), tmp_path / "tokenizer.json"


def test_huggingface_ids_are_the_packages_own_with_eos_after_each_document(
    corpus, bpe, monkeypatch
):
    tok, path = bpe
    config = DataConfig(path=str(corpus), tokenizer=str(path), extensions=".txt")
    found = data_lib.examples(config, kind="gpt", seq_len=8)
    eos = tok.token_to_id("<|endoftext|>")
    texts = documents(corpus)
    assert len(texts) == 11  # 12 files, one empty; skip.bin is not read
    want = packed([tok.encode(t, add_special_tokens=False).ids for t in texts], eos)
    assert_examples_equal(found, want)
    assert tok.encode(texts[0]).ids[0] == tok.token_to_id("<s>")  # its BOS: not in the stream
    assert found.vocab_size == tok.get_vocab_size() > 256  # the merges its text had, to 300
    assert tok.token_to_id("<s>") not in found["tokens"]
    data_lib.check(found, LIKE_GPT, path=config.path, global_batch=8, vocab=found.vocab_size)
    monkeypatch.setattr(data_tokenizer, "ENCODE_CHARS", 100)  # encoded a few files at a time
    assert_examples_equal(data_lib.examples(config, kind="gpt", seq_len=8), want)
    one = corpus / "doc03.txt"  # a file: one document
    found = data_lib.examples(DataConfig(path=str(one), tokenizer=str(path)), kind="gpt", seq_len=8)
    ids = tok.encode(one.read_text(), add_special_tokens=False).ids
    assert_examples_equal(found, packed([ids], eos))


def test_sentencepiece_ids_are_the_packages_own_with_eos_after_each_document(tmp_path, corpus):
    texts = documents(corpus)
    sp = train_sentencepiece(tmp_path / "sp", texts)
    config = DataConfig(path=str(corpus), tokenizer=str(tmp_path / "sp.model"))
    found = data_lib.examples(config, kind="gpt", seq_len=8)
    assert sp.eos_id() == 2 and sp.id_to_piece(2) == "</s>"
    assert_examples_equal(found, packed([sp.encode(t) for t in texts], sp.eos_id()))
    assert found.vocab_size == sp.get_piece_size() == 60
    renamed = DataConfig(path=str(corpus), tokenizer=str(tmp_path / "sp.model"), eos="<s>")
    found = data_lib.examples(renamed, kind="gpt", seq_len=8)  # another piece as the EOS
    assert_examples_equal(found, packed([sp.encode(t) for t in texts], sp.bos_id()))


def test_batches_are_the_same_for_any_number_of_processes_and_resume(corpus, bpe):
    config = DataConfig(path=str(corpus), tokenizer=str(bpe[1]), seed=4)
    found = data_lib.examples(config, kind="gpt", seq_len=8)
    serve = data_lib.input_fn(found, config, 8)
    one = serve(rp.InputContext())
    steps = 3 * (len(found["tokens"]) // 8)  # three epochs
    whole = [next(one) for _ in range(steps)]
    halves = [
        serve(rp.InputContext(num_input_pipelines=2, input_pipeline_id=i, num_replicas_in_sync=8))
        for i in range(2)
    ]
    for batch in whole:
        parts = [next(half) for half in halves]
        for key in batch:
            np.testing.assert_array_equal(batch[key], np.concatenate([p[key] for p in parts]))
    stopped = serve(rp.InputContext())
    for _ in range(5):
        next(stopped)
    resumed = serve(rp.InputContext())
    resumed.set_state(json.loads(json.dumps(stopped.get_state())))
    for batch in whole[5:]:
        np.testing.assert_array_equal(next(resumed)["tokens"], batch["tokens"])


def test_a_resumed_fit_reads_the_batches_of_an_uninterrupted_one(tmp_path, corpus):
    sp = train_sentencepiece(tmp_path / "sp", documents(corpus))
    config = DataConfig(path=str(corpus), tokenizer=str(tmp_path / "sp.model"), seed=1)
    found = data_lib.examples(config, kind="gpt", seq_len=8)
    data_lib.check(found, LIKE_GPT, path=config.path, global_batch=8, vocab=sp.get_piece_size())
    input_fn = data_lib.input_fn(found, config, 8)
    weights = jnp.arange(1, 9, dtype=jnp.int32)

    def step_fn(state, batch):  # the batch's ids, summed with their positions as weights
        seen = jnp.sum(batch["tokens"] * weights) + 7 * jnp.sum(batch["targets"] * weights)
        return {"n": state["n"] + 1}, {"loss": rp.all_reduce(seen, "sum")}

    def fit(directory, steps):
        repl = rp.Replicator()
        state = repl.replicate({"n": np.zeros((), np.int32)})
        return rp.fit(repl, step_fn, state, input_fn, steps=steps,
                      checkpointing=rp.training.CheckpointOptions(directory, every=2),
                      logging=rp.training.LoggingOptions(every=1, progress=False))  # fmt: skip

    batches_per_epoch = len(found["tokens"]) // 8
    steps = batches_per_epoch + 3  # into a second epoch
    straight = fit(tmp_path / "straight", steps)
    fit(tmp_path / "run", 4)
    resumed = fit(tmp_path / "run", steps)
    assert resumed.resumed_from == 4
    seen = [h["loss"] for h in straight.history]
    assert len(set(seen)) > batches_per_epoch // 2  # different batches give different sums
    assert [h["loss"] for h in resumed.history] == seen[4:]


def test_the_model_vocabulary_must_hold_the_tokenizers(corpus, bpe):
    config = DataConfig(path=str(corpus), tokenizer=str(bpe[1]))
    found = data_lib.examples(config, kind="gpt", seq_len=8)
    n = bpe[0].get_vocab_size()
    with pytest.raises(
        ValueError,
        match=rf"data.tokenizer='.*tokenizer.json' has {n} token ids \(0-{n - 1}\), more than "
        rf"model.vocab=256; set model.vocab={n} \(or more\)",
    ):
        data_lib.check(found, LIKE_GPT, path=config.path, global_batch=8, vocab=256)


def refused(error, pattern, **config):
    with pytest.raises(error, match=pattern) as e:
        data_lib.examples(DataConfig(**config), kind="gpt", seq_len=8)
    assert "\n" not in str(e.value)


def test_config_errors_name_the_key_and_the_fix():
    def load(data):
        with pytest.raises(ValueError) as e:
            config_lib.from_dict(config_lib.TrainConfig, {"data": data}, where="run.yaml")
        assert "\n" not in str(e.value)
        return str(e.value)

    assert load({"path": "t", "tokenizer": "vocab.bin"}).startswith(
        "run.yaml: data.tokenizer='vocab.bin' is not a tokenizer file replicator reads; give a "
        "Hugging Face tokenizer.json (a name ending in .json) or a SentencePiece model (.model)."
    )
    assert "data.eos='</s>' names a tokenizer's end-of-document token; set data.tokenizer" in (
        load({"path": "t", "eos": "</s>"})
    )
    assert "data.tokenizer='t.json' encodes the text of data.path, which is not set" in (
        load({"tokenizer": "t.json"})
    )
    assert "data.format='npy' holds token ids or arrays already; set data.format=text" in (
        load({"path": "t.npy", "tokenizer": "t.json", "format": "npy"})
    )
    assert "data.eos must name one of the tokenizer's tokens" in (
        load({"path": "t", "tokenizer": "t.model", "eos": ""})
    )


def test_the_cli_refuses_a_tokenizer_it_cannot_read_in_one_line(tmp_path, capsys):
    argv = ["train", str(ROOT / "configs/lm_dp.yaml"), f"out_dir={tmp_path}", "data.path=x.txt"]
    assert cli.main([*argv, "data.tokenizer=vocab.txt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.tokenizer='vocab.txt' is not a tokenizer file" in err


def test_what_a_tokenizer_cannot_encode_is_refused_naming_the_key(tmp_path, corpus, bpe):
    path = str(bpe[1])
    refused(FileNotFoundError, r"data.tokenizer='nowhere.json': no such file; give a Hugging "
            r"Face tokenizer.json or a SentencePiece .model", path=str(corpus),
            tokenizer="nowhere.json")  # fmt: skip
    refused(FileNotFoundError, r"data.path='nowhere/': no such file or directory",
            path="nowhere/", tokenizer=path)  # fmt: skip
    (tmp_path / "junk.json").write_text('{"not": "a tokenizer"}')
    refused(ValueError, r"data.tokenizer='.*junk.json' is not a tokenizer.json the tokenizers "
            r"package reads \(.*\); give the file Tokenizer.save", path=str(corpus),
            tokenizer=str(tmp_path / "junk.json"))  # fmt: skip
    (tmp_path / "junk.model").write_bytes(b"\x00junk" * 20)
    refused(ValueError, r"data.tokenizer='.*junk.model' is not a SentencePiece model "
            r"sentencepiece reads", path=str(corpus), tokenizer=str(tmp_path / "junk.model"))  # fmt: skip
    np.save(tmp_path / "ids.npy", np.arange(100))
    refused(ValueError, r"data.path='.*ids.npy' is npy data \(token ids or arrays\), and "
            r"data.tokenizer encodes text", path=str(tmp_path / "ids.npy"), tokenizer=path)  # fmt: skip
    with pytest.raises(ValueError, match=r"only model.kind='gpt' trains on; remove data.tok"):
        data_lib.examples(DataConfig(path=str(corpus), tokenizer=path), kind="mlp", seq_len=8)
    (corpus / "doc05.txt").write_bytes(b"\xff")
    refused(ValueError, r"doc05.txt is not UTF-8 text \(invalid start byte at byte 0\), which "
            r"data.tokenizer encodes; convert it", path=str(corpus), tokenizer=path)  # fmt: skip
    (corpus / "doc05.txt").write_text("")
    refused(ValueError, r"data.eos='<nope>' is not a token of data.tokenizer=.*; name one of its "
            r"tokens in data.eos \(its special tokens: \['<s>', '<\|endoftext\|>'\]\)",
            path=str(corpus), tokenizer=path, eos="<nope>")  # fmt: skip
    (corpus / "tiny").mkdir()
    (corpus / "tiny" / "a.txt").write_text("alpha")
    refused(ValueError, r"data.path='.*tiny': \d tokens are fewer than seq_len \+ 1 = 9",
            path=str(corpus / "tiny"), tokenizer=path)  # fmt: skip


def test_a_tokenizer_without_one_eos_needs_data_eos(tmp_path, corpus):
    texts = documents(corpus)
    none = tmp_path / "none" / "tokenizer.json"
    none.parent.mkdir()
    train_bpe(none, texts, special=())
    refused(ValueError, r"data.tokenizer='.*tokenizer.json' has not one end-of-document token "
            r"to put after each document \(none of </s>, <\|endoftext\|>, .*\); name one of "
            r"its tokens in data.eos \(e.g. data.eos='<\|endoftext\|>'\), or train it with one",
            path=str(corpus), tokenizer=str(none))  # fmt: skip
    several = tmp_path / "several" / "tokenizer.json"
    several.parent.mkdir()
    tok = train_bpe(several, texts, special=("</s>", "<|endoftext|>"))
    refused(ValueError, r"\(several: </s>, <\|endoftext\|>\); name one of its tokens "
            r"in data.eos \(e.g. data.eos='</s>'\)", path=str(corpus), tokenizer=str(several))  # fmt: skip
    chosen = DataConfig(path=str(corpus), tokenizer=str(several), eos="<|endoftext|>")
    eos = data_lib.examples(chosen, kind="gpt", seq_len=8)["targets"]
    assert tok.token_to_id("<|endoftext|>") in eos and tok.token_to_id("</s>") not in eos
    (several.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    found = data_lib.examples(DataConfig(path=str(corpus), tokenizer=str(several)), kind="gpt",
                              seq_len=8)  # fmt: skip
    assert tok.token_to_id("</s>") in found["targets"]  # the eos_token of its config
    sp = train_sentencepiece(tmp_path / "sp", texts, eos_id=-1)
    model = str(tmp_path / "sp.model")
    refused(ValueError, r"data.tokenizer='.*sp.model' is a SentencePiece model without an "
            r"end-of-document piece .* \(its eos_id is -1\); name one of its pieces in data.eos",
            path=str(corpus), tokenizer=model)  # fmt: skip
    refused(ValueError, r"data.eos='</s>' is not a piece of data.tokenizer=.*sp.model'; name "
            r"one of its pieces in data.eos \(its control pieces: \['<s>'\]\)",
            path=str(corpus), tokenizer=model, eos="</s>")  # fmt: skip
    found = data_lib.examples(DataConfig(path=str(corpus), tokenizer=model, eos="<s>"),
                              kind="gpt", seq_len=8)  # fmt: skip
    assert_examples_equal(found, packed([sp.encode(t) for t in texts], sp.bos_id()))


@pytest.mark.slow
def test_replicator_train_with_a_tokenizer_trains_and_resumes_exactly(
    tmp_path, corpus, bpe, capsys
):
    """`replicator train configs/lm_dp.yaml data.path=... data.tokenizer=tokenizer.json`: a run
    stopped at step 2 resumes with the next batch; a model.vocab under the tokenizer's is one
    line and exit status 2."""
    args = [f"data.path={corpus}", f"data.tokenizer={bpe[1]}", "model.vocab=300",
            "model.d_model=16", "model.layers=1", "model.seq_len=8", "global_batch=8",
            "log_every=1", "checkpoint_every=2", "plot=false"]  # fmt: skip

    def train(out, steps, *more):  # in this process: its metrics and output, or its refusal
        code = cli.main(["train", str(ROOT / "configs/lm_dp.yaml"), f"out_dir={out}",
                         f"steps={steps}", *args, *more])  # fmt: skip
        said = capsys.readouterr()
        if code:
            return code, said.err
        rows = (out / "lm_dp" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in rows], said.out + said.err

    whole, _ = train(tmp_path / "a", 4)
    train(tmp_path / "b", 2)
    resumed, said = train(tmp_path / "b", 4)
    assert "resumed from the checkpoint of step 2" in said
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # the same metrics.jsonl, appended
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    code, err = train(tmp_path / "c", 4, "model.vocab=256")
    assert code == 2 and err.count("\n") == 1, err
    n = bpe[0].get_vocab_size()
    assert f"has {n} token ids (0-{n - 1}), more than model.vocab=256; set model.vocab={n}" in err


@pytest.mark.slow
def test_the_tokenizer_example_trains_a_bpe_tokenizer_then_the_gpt_through_it(tmp_path):
    run = subprocess.run(
        [sys.executable, "examples/train_lm_tokenizer.py", "--steps", "20", "--out",
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokenizer: 512 tokens, trained on" in run.stdout
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", run.stdout).groups())
    assert last < 0.9 * first, run.stdout
    assert (tmp_path / "tokenizer.json").exists()
    assert (tmp_path / "lm_tokenizer" / "metrics.jsonl").read_text().count("\n") == 5  # 1, 5, ..


def test_a_vocabulary_below_256_takes_a_small_tokenizer_and_refuses_bytes(tmp_path, corpus):
    """``model.vocab`` below 256 is the model of a small tokenizer (a 60-piece SentencePiece
    here): the config loads and the data check passes. The built-in text (bytes) is refused
    when the config loads, and untokenized text when its bytes are checked against the model."""
    train_sentencepiece(tmp_path / "sp", documents(corpus))
    raw = {"model": {"kind": "gpt", "vocab": 60, "seq_len": 8}, "global_batch": 8}
    data = {"path": str(corpus), "tokenizer": str(tmp_path / "sp.model")}
    config = config_lib.from_dict(config_lib.TrainConfig, raw | {"data": data}, where="run.yaml")
    found = data_lib.examples(config.data, kind="gpt", seq_len=8)
    data_lib.check(found, LIKE_GPT, path=config.data.path, global_batch=8, vocab=60)
    with pytest.raises(ValueError, match=r"^run.yaml: model.vocab=60 is smaller than the built-in"):
        config_lib.from_dict(config_lib.TrainConfig, raw, where="run.yaml")
    text = config_lib.from_dict(config_lib.TrainConfig, raw | {"data": {"path": str(corpus)}})
    found = data_lib.examples(text.data, kind="gpt", seq_len=8)
    with pytest.raises(ValueError, match=r"tokens has ids from \d+ to \d+, outside the model's "
                       r"vocabulary 0-59"):  # fmt: skip
        data_lib.check(found, LIKE_GPT, path=text.data.path, global_batch=8, vocab=60)
