"""`replicator train`'s data: section: local text and NumPy files as examples, checked against
what the model kind trains on, served resumably."""

from __future__ import annotations

import io
import json
import pathlib
import sys

import numpy as np
import pytest

import replicator as rp
from replicator import cli
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


@pytest.mark.slow
def test_replicator_train_on_a_text_file_trains_and_resumes_exactly(tmp_path, capsys):
    """`replicator train configs/lm_dp.yaml data.path=<a text file>`: the job's first batches
    come from the file, and a run stopped at step 4 resumes with the next batch."""
    words = np.random.default_rng(0).choice(["alpha", "beta", "gamma", "delta", "eps"], 4000)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(words))
    args = [f"data.path={corpus}", "model.d_model=16", "model.layers=1", "model.seq_len=16",
            "global_batch=16", "log_every=2", "checkpoint_every=4", "plot=false"]  # fmt: skip

    def train(out, steps, *more):
        return _train_lm_dp(capsys, out, steps, [*args, *more])

    whole, _ = train(tmp_path / "a", 8)
    train(tmp_path / "b", 4)
    resumed, said = train(tmp_path / "b", 8)
    assert "resumed from the checkpoint of step 4" in said
    assert [r["step"] for r in resumed] == [1, 2, 4, 6, 8]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    assert whole[-1]["loss"] < whole[0]["loss"]  # it learns the five words
    code, said = train(tmp_path / "c", 8, "data.path=nowhere.txt")
    assert code == 2 and "data.path='nowhere.txt': no such file" in said


# ArrayRecord files: records read by index with grain, one example per record.


@pytest.fixture
def grain():
    return pytest.importorskip("grain")


def write_records(path, examples):
    """An ArrayRecord file of ``examples``: each the bytes np.save (an array) or np.savez (a
    dict of arrays) writes, as docs/guides/training_and_cli.md says."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for example in examples:
        buffer = io.BytesIO()
        if isinstance(example, dict):
            np.savez(buffer, **example)
        else:
            np.save(buffer, example)
        writer.write(buffer.getvalue())
    writer.close()
    return path


def token_windows(n, seq_len=8, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, seq_len + 1)).astype(np.uint16)


def records_of(path, *, global_batch=4, kind="gpt", like=LIKE_GPT, vocab=256, **config):
    config = DataConfig(path=str(path), **config)
    found = data_lib.examples(config, kind=kind, seq_len=8)
    data_lib.check(found, like, path=config.path, global_batch=global_batch, vocab=vocab)
    return found, data_lib.input_fn(found, config, global_batch)


def test_arrayrecord_windows_are_served_as_rp_batches_serves_the_same_windows(tmp_path, grain):
    windows = token_windows(21)
    found, serve = records_of(write_records(tmp_path / "w.array_record", windows), shuffle=False)
    assert isinstance(found, data_lib.Records) and found.size == 21  # not read into memory
    np.save(tmp_path / "w.npy", windows)
    same, _ = records_of(tmp_path / "w.npy")
    it, oracle = serve(rp.InputContext()), rp.Batches(same, 4, shuffle=False)
    for _ in range(12):  # 5 batches an epoch (the 21st window is dropped), over 2 epochs
        batch, want = next(it), next(oracle)
        assert batch["tokens"].dtype == np.int32 and batch["tokens"].shape == (4, 8)
        assert all(np.array_equal(batch[k], want[k]) for k in want)
    it.close()

    def epochs(seed):  # the records of each epoch's 5 batches
        it = records_of(tmp_path / "w.array_record", seed=seed)[1](rp.InputContext())
        rows = [next(it)["tokens"] for _ in range(15)]
        it.close()
        return [np.concatenate(rows[5 * e : 5 * e + 5]) for e in range(3)]

    first = epochs(seed=5)
    for epoch in first:  # 20 different windows of the 21, in a new order each epoch
        assert len({row.tobytes() for row in epoch}) == 20
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])
    assert all(np.array_equal(a, b) for a, b in zip(first, epochs(seed=5)))
    assert not np.array_equal(first[0], epochs(seed=6)[0])


def test_arrayrecord_paths_are_a_file_a_directory_or_a_glob_of_shards(tmp_path, grain):
    windows = token_windows(30)
    write_records(tmp_path / "set-train.array_record-00000-of-00002", windows[:10])
    write_records(tmp_path / "set-train.array_record-00001-of-00002", windows[10:25])
    write_records(tmp_path / "set-test.array_record-00000-of-00001", windows[25:])
    (tmp_path / "notes.txt").write_text("not a record" * 10)
    found, serve = records_of(tmp_path / "set-train.array_record-*", shuffle=False)
    assert found.size == 25 and [pathlib.Path(f).name[-14:] for f in found.files] == [
        "00000-of-00002",
        "00001-of-00002",
    ]
    it = serve(rp.InputContext())
    rows = np.concatenate([next(it)["tokens"] for _ in range(6)])
    it.close()
    assert np.array_equal(rows, windows[:24, :-1])  # shard 0's records, then shard 1's
    found, _ = records_of(tmp_path)  # a directory: its *.array_record* files, sorted
    assert found.size == 30 and len(found.files) == 3
    one = tmp_path / "set-test.array_record-00000-of-00001"
    assert records_of(one)[0].size == 5
    (tmp_path / "plain").mkdir()
    write_records(tmp_path / "plain" / "tokens.bin", windows)
    found, _ = records_of(tmp_path / "plain" / "tokens.bin", format="arrayrecord")
    assert found.size == 30


def test_arrayrecord_each_process_reads_only_its_part_of_each_global_batch(
    tmp_path, grain, monkeypatch
):
    found, _ = records_of(write_records(tmp_path / "w.array_record", token_windows(37)))
    reads = []  # (the data source, the keys it was asked for)
    read = grain.sources.ArrayRecordDataSource.__getitems__
    monkeypatch.setattr(
        grain.sources.ArrayRecordDataSource,
        "__getitems__",
        lambda self, keys: reads.append((self, tuple(keys))) or read(self, keys),
    )

    def ctx(of, index):
        return rp.InputContext(num_input_pipelines=of, input_pipeline_id=index,
                               num_replicas_in_sync=8)  # fmt: skip

    one, first, second = (
        data_lib.RecordBatches(found, 16, ctx=c, seed=7) for c in (ctx(1, 0), ctx(2, 0), ctx(2, 1))
    )
    for step in range(7):  # 2 batches an epoch of 37 records: over 3 epochs
        assert one.keys(step) == first.keys(step) + second.keys(step)
        assert len(set(one.keys(step))) == 16
    batches = {it: [next(it) for _ in range(7)] for it in (one, first, second)}
    for it in (one, first, second):
        it.close()
    for it, of in ((first, second), (second, first)):
        asked = {keys for source, keys in reads if source is it._source}
        assert {tuple(it.keys(s)) for s in range(7)} <= asked  # 8 records a read
        assert asked <= {tuple(it.keys(s)) for s in range(7 + 4 + 1)}  # and 4 batches ahead
        assert not asked & {tuple(of.keys(s)) for s in range(7 + 4 + 1)}
    for w, a, b in zip(batches[one], batches[first], batches[second]):
        assert np.array_equal(w["tokens"], np.concatenate([a["tokens"], b["tokens"]]))
    assert first.get_state() == second.get_state() == one.get_state() == {"next_index": 7}


def test_arrayrecord_batches_resume_at_the_next_batch(tmp_path, grain):
    _, serve = records_of(write_records(tmp_path / "w.array_record", token_windows(23)), seed=3)
    it = serve(rp.InputContext())
    straight = [next(it) for _ in range(20)]  # 5 batches an epoch: 4 epochs
    stopped = serve(rp.InputContext())
    for _ in range(8):
        next(stopped)
    state = json.loads(json.dumps(stopped.get_state()))  # rp.fit gathers positions as JSON
    assert state == {"next_index": 8}
    resumed = serve(rp.InputContext())
    resumed.set_state(state)
    for want in straight[8:]:
        got = next(resumed)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match=r"position \{'epoch': 0, 'batch': 1\} is not one of "):
        resumed.set_state({"epoch": 0, "batch": 1})  # an rp.Batches position
    for iterator in (it, stopped, resumed):
        iterator.close()


def test_arrayrecord_x_and_y_records_for_mlp(tmp_path, grain):
    rng = np.random.default_rng(2)
    rows = [{"x": rng.normal(size=16), "y": rng.normal(size=1)} for _ in range(10)]  # float64
    like = {"x": np.zeros((2, 16), np.float32), "y": np.zeros((2, 1), np.float32)}
    path = write_records(tmp_path / "reg.array_record", rows)
    _, serve = records_of(path, kind="mlp", like=like, vocab=None, shuffle=False)
    batch = next(it := serve(rp.InputContext()))
    it.close()
    assert batch["x"].dtype == np.float32 and batch["y"].shape == (4, 1)
    np.testing.assert_array_equal(batch["x"], np.stack([r["x"] for r in rows[:4]]).astype("f4"))


def test_arrayrecord_refusals_name_the_key_and_the_fix(tmp_path, grain, monkeypatch):
    from array_record.python.array_record_module import ArrayRecordWriter

    with pytest.raises(FileNotFoundError, match=r"data.path='nowhere.array_record': no such file"):
        records_of("nowhere.array_record")
    with pytest.raises(FileNotFoundError, match=r"no file matches; give an ArrayRecord file"):
        records_of(tmp_path / "train.array_record-*")
    (tmp_path / "texts").mkdir()
    with pytest.raises(FileNotFoundError, match=r"a directory with no ArrayRecord file"):
        records_of(tmp_path / "texts", format="arrayrecord")
    (tmp_path / "empty.array_record").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.array_record is empty \(0 bytes\)"):
        records_of(tmp_path / "empty.array_record")
    ArrayRecordWriter(str(tmp_path / "none.array_record"), "group_size:1").close()
    with pytest.raises(ValueError, match=r"none.array_record holds no record; write at least"):
        records_of(tmp_path / "none.array_record")
    (tmp_path / "junk.array_record").write_bytes(b"junk" * 100)
    with pytest.raises(ValueError, match=r"junk.array_record is not an ArrayRecord file"):
        records_of(tmp_path / "junk.array_record")
    long = write_records(tmp_path / "long.array_record", token_windows(8, seq_len=16))
    with pytest.raises(
        ValueError,
        match=r"record 0 of .*long.array_record holds 17 token ids; model.seq_len=8 trains on "
        r"windows of seq_len \+ 1 = 9: write windows of 9 ids, or set model.seq_len=16",
    ):
        records_of(long)
    path = tmp_path / "raw.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    writer.write(token_windows(1)[0].astype(np.uint8).tobytes())
    writer.close()
    with pytest.raises(ValueError, match=r"record 0 of .* is not the bytes np.save or np.savez"):
        records_of(path)
    windows = token_windows(24)
    windows[13, 4] = 300  # read by the batch that holds it, not before
    path = write_records(tmp_path / "w.array_record", windows)
    with pytest.raises(ValueError, match=r"holds one array; model.kind='mlp' trains on records"):
        records_of(path, kind="mlp", like={"x": np.zeros((2, 16), np.float32)}, vocab=None)
    with pytest.raises(ValueError, match=r"24 records are fewer than one global_batch of 32"):
        records_of(path, global_batch=32)
    _, serve = records_of(path, shuffle=False)
    it = serve(rp.InputContext())
    with pytest.raises(
        ValueError,
        match=r"record 13 of .*w.array_record: tokens has ids from \d+ to 300, outside the "
        r"model's vocabulary 0-255",
    ):
        for _ in range(6):
            next(it)
    it.close()
    with pytest.raises(ValueError, match=r"data.seed=-1: ArrayRecord data is shuffled by grain"):
        records_of(path, seed=-1)
    monkeypatch.setitem(sys.modules, "grain", None)  # not installed
    with pytest.raises(
        ValueError,
        match=r"data.format='arrayrecord' \(data.path=.*\) is read with grain, which is not "
        r"installed .*pip install \"replicator\[grain\]\"",
    ):
        records_of(path)


@pytest.mark.slow
def test_replicator_train_on_arrayrecord_shards_trains_and_resumes_exactly(tmp_path, grain, capsys):
    """`replicator train configs/lm_dp.yaml data.path=<a glob of ArrayRecord shards>`: a run
    stopped at step 14 (past two epochs) resumes with the next batch: its losses are those of
    a run straight to 16."""
    words = np.random.default_rng(0).choice(["alpha", "beta", "gamma", "delta", "eps"], 600)
    stream = np.frombuffer(" ".join(words).encode(), np.uint8)[: 96 * 16 + 1]
    windows = [stream[16 * i : 16 * i + 17] for i in range(96)]
    write_records(tmp_path / "words.array_record-00000-of-00002", windows[:45])
    write_records(tmp_path / "words.array_record-00001-of-00002", windows[45:])
    args = [f"data.path={tmp_path}/words.array_record-*", "model.d_model=16", "model.layers=1",
            "model.seq_len=16", "global_batch=16", "log_every=2", "checkpoint_every=7",
            "plot=false"]  # fmt: skip

    def train(out, steps, *more):
        return _train_lm_dp(capsys, out, steps, [*args, *more])

    whole, _ = train(tmp_path / "a", 16)  # 6 batches an epoch: 16 steps are 2 epochs and 4
    train(tmp_path / "b", 14)
    resumed, said = train(tmp_path / "b", 16)
    assert "resumed from the checkpoint of step 14" in said
    assert [r["step"] for r in resumed] == [1, *range(2, 18, 2)]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    assert whole[-1]["loss"] < whole[0]["loss"]
    code, said = train(tmp_path / "c", 16, f"data.path={tmp_path}/nothing.array_record-*")
    assert code == 2 and "no file matches" in said


def _train_lm_dp(capsys, out, steps, args):
    """``replicator train configs/lm_dp.yaml`` (`cli.main`, in this process) into ``out`` for
    ``steps`` steps with ``args``: its metrics.jsonl records and what it printed, or, for a
    refused run, its exit code and what it printed."""
    root = pathlib.Path(__file__).resolve().parent.parent
    code = cli.main(["train", str(root / "configs/lm_dp.yaml"), f"out_dir={out}",
                     f"steps={steps}", *args])  # fmt: skip
    said = "".join(capsys.readouterr())
    if code:
        return code, said
    rows = (out / "lm_dp" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in rows], said
