"""`replicator train`'s data: section: local text and NumPy files as examples, checked against
what the model kind trains on, served resumably."""

from __future__ import annotations

import numpy as np
import pytest

import replicator as rp
from replicator.cli import data as data_lib
from replicator.cli.data import DataConfig

LIKE_GPT = {"tokens": np.zeros((2, 8), np.int32), "targets": np.zeros((2, 8), np.int32)}


def test_text_is_cut_into_consecutive_next_byte_windows(tmp_path):
    text = bytes(range(40, 40 + 35))
    (tmp_path / "a.txt").write_bytes(text)
    found = data_lib.examples(DataConfig(path=str(tmp_path / "a.txt")), kind="gpt", seq_len=8)
    assert found["tokens"].shape == (4, 8) and found["tokens"].dtype == np.int32  # (35-1)//8
    for i in range(4):
        window = np.frombuffer(text, np.uint8)[8 * i : 8 * i + 9]
        assert np.array_equal(found["tokens"][i], window[:-1])
        assert np.array_equal(found["targets"][i], window[1:])
    data_lib.check(found, LIKE_GPT, path="a.txt", global_batch=4, vocab=256)


def test_a_directory_reads_its_text_files_in_sorted_order_and_only_those(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"B" * 9)
    (tmp_path / "sub" / "c.md").write_bytes(b"C" * 9)
    (tmp_path / "a.txt").write_bytes(b"A" * 9)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 100)
    found = data_lib.examples(DataConfig(path=str(tmp_path)), kind="gpt", seq_len=8)
    stream = found["tokens"].astype(np.uint8).tobytes()  # windows of 8 after 8: 24 of 27 bytes
    assert stream == b"A" * 9 + b"B" * 9 + b"C" * 6  # a.txt, b.txt, sub/c.md; not skip.bin
    with pytest.raises(FileNotFoundError, match=r"no file ending in \.json.*data\.extensions"):
        data_lib.examples(DataConfig(path=str(tmp_path), extensions=".json"), kind="gpt", seq_len=8)


def test_token_ids_and_arrays_from_numpy_files(tmp_path):
    stream = np.random.default_rng(0).integers(0, 256, size=100)
    np.save(tmp_path / "ids.npy", stream)
    found = data_lib.examples(DataConfig(path=str(tmp_path / "ids.npy")), kind="gpt", seq_len=8)
    assert np.array_equal(found["tokens"][1], stream[8:16])
    np.save(tmp_path / "win.npy", stream[:90].reshape(10, 9))
    found = data_lib.examples(DataConfig(path=str(tmp_path / "win.npy")), kind="gpt", seq_len=8)
    assert np.array_equal(found["targets"][2], stream[19:27])
    x, y = np.ones((12, 16), np.float32), np.zeros((12, 1), np.float32)
    np.savez(tmp_path / "reg.npz", x=x, y=y)
    found = data_lib.examples(DataConfig(path=str(tmp_path / "reg.npz")), kind="mlp", seq_len=8)
    data_lib.check(found, {"x": x[:2], "y": y[:2]}, path="reg.npz", global_batch=8)


def test_what_the_model_cannot_train_on_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.path='nowhere.txt': no such file"):
        data_lib.examples(DataConfig(path="nowhere.txt"), kind="gpt", seq_len=8)
    (tmp_path / "t.txt").write_bytes(b"short")
    with pytest.raises(ValueError, match=r"5 tokens are fewer than seq_len \+ 1 = 9"):
        data_lib.examples(DataConfig(path=str(tmp_path / "t.txt")), kind="gpt", seq_len=8)
    with pytest.raises(ValueError, match=r"only model.kind='gpt' trains on"):
        data_lib.examples(DataConfig(path=str(tmp_path / "t.txt")), kind="mlp", seq_len=8)
    big = {"tokens": np.full((4, 8), 300, np.int32), "targets": np.zeros((4, 8), np.int32)}
    with pytest.raises(
        ValueError, match=r"ids from 300 to 300, outside the model's vocabulary 0-255"
    ):
        data_lib.check(big, LIKE_GPT, path="p", global_batch=2, vocab=256)
    wide = {"tokens": np.zeros((4, 9), np.int32), "targets": np.zeros((4, 9), np.int32)}
    with pytest.raises(ValueError, match=r"tokens has examples of shape \[9\].*trains on \[8\]"):
        data_lib.check(wide, LIKE_GPT, path="p", global_batch=2)
    few = {k: v[:1] for k, v in LIKE_GPT.items()}
    with pytest.raises(ValueError, match=r"1 examples are fewer than one global_batch of 4"):
        data_lib.check(few, LIKE_GPT, path="p", global_batch=4)
    with pytest.raises(ValueError, match=r"format='csv' is not a data format"):
        DataConfig(path="x", format="csv")


def test_served_batches_resume_at_the_next_batch(tmp_path):
    (tmp_path / "a.txt").write_bytes(np.random.default_rng(1).bytes(400))
    config = DataConfig(path=str(tmp_path / "a.txt"), seed=3)
    found = data_lib.examples(config, kind="gpt", seq_len=8)
    serve = data_lib.input_fn(found, config, 4)
    it = serve(rp.InputContext())
    first = [next(it) for _ in range(15)]  # past an epoch: 49 examples, 12 batches each
    stopped = serve(rp.InputContext())
    for _ in range(10):
        next(stopped)
    resumed = serve(rp.InputContext())
    resumed.set_state(stopped.get_state())  # what rp.fit checkpoints and restores
    assert all(np.array_equal(next(resumed)["tokens"], b["tokens"]) for b in first[10:])


def test_replicator_train_on_a_text_file_trains_and_resumes_exactly(tmp_path):
    """`replicator train configs/lm_dp.yaml data.path=<a text file>`: the job's first batches
    come from the file, and a run stopped at step 4 resumes with the next batch."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    words = np.random.default_rng(0).choice(["alpha", "beta", "gamma", "delta", "eps"], 4000)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(words))
    args = [f"data.path={corpus}", "model.d_model=16", "model.layers=1", "model.seq_len=16",
            "global_batch=16", "log_every=2", "checkpoint_every=4", "plot=false"]  # fmt: skip

    def train(out, steps):
        run = subprocess.run(
            [sys.executable, "-m", "replicator.cli", "train", str(root / "configs/lm_dp.yaml"),
             f"out_dir={out}", f"steps={steps}", *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        rows = (out / "lm_dp" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in rows], run.stdout + run.stderr

    whole, _ = train(tmp_path / "a", 8)
    train(tmp_path / "b", 4)
    resumed, said = train(tmp_path / "b", 8)
    assert "resumed from the checkpoint of step 4" in said
    assert [r["step"] for r in resumed] == [2, 4, 6, 8]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    assert whole[-1]["loss"] < whole[0]["loss"]  # it learns the five words
    bad = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "train", str(root / "configs/lm_dp.yaml"),
         f"out_dir={tmp_path}", "data.path=nowhere.txt"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "data.path='nowhere.txt': no such file" in bad.stderr
