"""Bad Hugging Face checkpoints given to ``replicator train CONFIG init_from=DIR`` (and
``replicator explain``, and `hf.read_config` / `hf.load` themselves): each is one line on stderr
naming the file, key or tensor and the fix, exit code 2, no traceback, the checkpoint's files
untouched and no run directory left behind.

Every checkpoint is written here by `hf.save` (llama_tiny.yaml's sizes) and then broken;
nothing is downloaded and nothing trains.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import struct
from collections.abc import Callable
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest

from replicator import cli
from replicator.models import hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMA_TINY = ROOT / "configs" / "llama_tiny.yaml"
CONFIG = {  # llama_tiny.yaml's model, as a checkpoint's config.json
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "max_position_embeddings": 128,
}
SHARD = "model-00003-of-00005.safetensors"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, pathlib.Path]:
    """A valid checkpoint in one file, and the same in 5 shards with an index."""
    root = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32), hf.shapes(CONFIG)
    )
    one = hf.save(root / "one", params, CONFIG)
    sharded = hf.save(root / "sharded", params, CONFIG, max_shard_bytes=200_000)
    assert len(list(sharded.glob("*.safetensors"))) == 5
    return {"one": one, "sharded": sharded}


# -- ways to break a checkpoint ------------------------------------------------------------------


def set_config(**changes) -> Callable[[pathlib.Path], None]:
    def mutate(directory: pathlib.Path) -> None:
        config = json.loads((directory / "config.json").read_text()) | changes
        config = {k: v for k, v in config.items() if v is not DROP}
        (directory / "config.json").write_text(json.dumps(config))

    return mutate


DROP = object()


def write(name: str, data: bytes | str) -> Callable[[pathlib.Path], None]:
    def mutate(directory: pathlib.Path) -> None:
        path = directory / name
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)

    return mutate


def remove(*patterns: str) -> Callable[[pathlib.Path], None]:
    def mutate(directory: pathlib.Path) -> None:
        for pattern in patterns:
            for path in directory.glob(pattern):
                path.unlink()

    return mutate


def read_safetensors(path: pathlib.Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_safetensors(path: pathlib.Path, header: dict | list, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(edit: Callable[[dict], None]) -> Callable[[pathlib.Path], None]:
    def mutate(directory: pathlib.Path) -> None:
        header, data = read_safetensors(directory / "model.safetensors")
        edit(header)
        write_safetensors(directory / "model.safetensors", header, data)

    return mutate


def truncate(directory: pathlib.Path) -> None:
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def header_not_json(directory: pathlib.Path) -> None:
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"xxxx"
    path.write_bytes(bytes(data))


def non_finite(name: str, value: float, dtype=np.float32) -> Callable[[pathlib.Path], None]:
    """Sets element 3 of tensor ``name`` to ``value`` (stored as ``dtype``: F32 or BF16)."""

    def mutate(directory: pathlib.Path) -> None:
        path = directory / "model.safetensors"
        header, data = read_safetensors(path)
        start, end = header[name]["data_offsets"]
        values = np.frombuffer(data[start:end], np.float32).astype(dtype)
        values[3] = value
        shift = (end - start) - values.nbytes
        for key, info in header.items():
            if key != "__metadata__" and info["data_offsets"][0] >= end:
                info["data_offsets"] = [o - shift for o in info["data_offsets"]]
        header[name] |= {"dtype": "F32" if dtype == np.float32 else "BF16"}
        header[name]["data_offsets"] = [start, start + values.nbytes]
        write_safetensors(path, header, data[:start] + values.tobytes() + data[end:])

    return mutate


def duplicate_shard(directory: pathlib.Path) -> None:
    shutil.copy(directory / "model-00002-of-00005.safetensors", directory / "copy.safetensors")
    (directory / "model.safetensors.index.json").unlink()


def empty(directory: pathlib.Path) -> None:
    for path in directory.iterdir():
        path.unlink()


def set_shape(name: str, shape: list[int]) -> Callable[[pathlib.Path], None]:
    return edit_header(lambda header: header[name].update(shape=shape))


K = "model.layers.1.self_attn.k_proj.weight"
UP = "model.layers.2.mlp.up_proj.weight"


class Case(NamedTuple):
    mutate: Callable[[pathlib.Path], None]
    words: list[str]  # that the one line must hold
    base: str = "one"  # which source checkpoint
    stage: str = "config"  # refused when the config loads ("config"), or the weights ("load")


# Each of the items, then what else these modules read. The words: the file or key,
# the problem, and the fix.
CASES = {
    # 1. truncated safetensors
    "truncated safetensors": Case(
        truncate, ["model.safetensors is truncated", "download the checkpoint again"]
    ),
    # 2. config.json that is a JSON list
    "config.json a list": Case(
        write("config.json", "[1, 2]"), ["config.json holds a list", "JSON object", "repair it"]
    ),
    # 3. sizes that must be positive integers
    "num_attention_heads 0": Case(
        set_config(num_attention_heads=0), ["num_attention_heads=0", "whole number >= 1"]
    ),
    "hidden_size 0": Case(set_config(hidden_size=0), ["hidden_size=0", ">= 1"]),
    "vocab_size negative": Case(set_config(vocab_size=-1), ["vocab_size=-1", ">= 1"]),
    "num_key_value_heads 0": Case(set_config(num_key_value_heads=0), ["num_key_value_heads=0"]),
    "head_dim 0": Case(set_config(head_dim=0), ["head_dim=0", ">= 1"]),
    "max_position_embeddings 0": Case(
        set_config(max_position_embeddings=0), ["max_position_embeddings=0"]
    ),
    # 4. not JSON: name the file
    "safetensors header not JSON": Case(
        header_not_json, ["model.safetensors's header is not JSON", "download the checkpoint"]
    ),
    "index not JSON": Case(
        write("model.safetensors.index.json", "not json"),
        ["model.safetensors.index.json is not JSON", "delete it"],
        base="sharded",
    ),
    "config.json not JSON": Case(
        write("config.json", "{model_type: llama}"), ["config.json is not JSON", "line 1"]
    ),
    "config.json empty": Case(write("config.json", ""), ["config.json is empty"]),
    "config.json not UTF-8": Case(write("config.json", b"\xff\xfe{}"), ["not UTF-8"]),
    # 5. a size as a string
    "hidden_size a string": Case(
        set_config(hidden_size="64"), ["hidden_size='64' is a string", '"hidden_size": 64']
    ),
    # 6. an index naming a missing shard
    "index names a missing shard": Case(
        remove(SHARD), [f"names {SHARD}", "is not in", f"download {SHARD} too"], base="sharded"
    ),
    # 7. sizes that disagree with head_dim or with the tensors
    "head_dim disagrees with the tensors": Case(
        set_config(head_dim=8),
        ["q_proj.weight' has shape [64, 64]", "give [32, 64]", "set head_dim to 16"],
    ),
    "hidden_size disagrees with the tensors": Case(
        set_config(hidden_size=128),
        ["embed_tokens.weight' has shape [256, 64]", "set hidden_size to 64"],
    ),
    "num_key_value_heads disagrees with the tensors": Case(
        set_config(num_key_value_heads=4),
        ["k_proj.weight' has shape [32, 64]", "set num_key_value_heads to 2"],
    ),
    "vocab_size disagrees with the tensors": Case(
        set_config(vocab_size=300), ["[256, 64]", "set vocab_size to 256"]
    ),
    # 8. non-finite weights: refused as they are read
    "NaN weight": Case(
        non_finite(K, np.nan), [f"tensor {K!r} holds nan", "model.safetensors"], stage="load"
    ),
    "inf weight": Case(
        non_finite("model.norm.weight", np.inf), ["'model.norm.weight' holds inf"], stage="load"
    ),
    "bf16 NaN weight": Case(
        non_finite(UP, np.nan, ml_dtypes.bfloat16), [f"{UP!r} holds nan"], stage="load"
    ),
    # 9. the hunt: config.json
    "config.json a number": Case(write("config.json", "42"), ["config.json holds a number"]),
    "vocab_size missing": Case(set_config(vocab_size=DROP), ["lacks vocab_size"]),
    "hidden_size null": Case(set_config(hidden_size=None), ["lacks hidden_size"]),
    "num_hidden_layers a boolean": Case(
        set_config(num_hidden_layers=True), ["num_hidden_layers=True is a boolean"]
    ),
    "num_hidden_layers 4.0": Case(
        set_config(num_hidden_layers=4.0), ['"num_hidden_layers": 4, without a fraction']
    ),
    "intermediate_size 176.5": Case(
        set_config(intermediate_size=176.5), ["intermediate_size=176.5 is a fractional"]
    ),
    "model_type gpt2": Case(set_config(model_type="gpt2"), ["model_type='gpt2'", "'llama'"]),
    "model_type missing": Case(set_config(model_type=DROP), ["model_type=None", "'llama'"]),
    "model_type a list": Case(set_config(model_type=["llama"]), ["model_type=['llama']"]),
    "rms_norm_eps negative": Case(
        set_config(rms_norm_eps=-1), ["rms_norm_eps=-1 is not a finite number > 0"]
    ),
    "rope_theta a string": Case(set_config(rope_theta="abc"), ["rope_theta='abc'", "string"]),
    "tie_word_embeddings a string": Case(
        set_config(tie_word_embeddings="false"), ['"tie_word_embeddings": false']
    ),
    "rope_scaling a string": Case(set_config(rope_scaling="llama3"), ["rope_scaling='llama3'"]),
    "llama3 rope_scaling without factor": Case(
        set_config(rope_scaling={"rope_type": "llama3"}), ["'llama3' but no factor"]
    ),
    "kv heads not dividing heads": Case(
        set_config(num_key_value_heads=3), ["not a multiple of num_key_value_heads=3"]
    ),
    "experts per token above experts": Case(
        set_config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=5),
        ["num_experts_per_tok=5 is more than num_local_experts=4"],
    ),
    "llama weights called a mixtral": Case(
        set_config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
        ["block_sparse_moe.gate.weight", 'set "model_type": "llama"'],
    ),
    "hidden_act tanh": Case(set_config(hidden_act="tanh"), ["hidden_act='tanh'", "'silu'"]),
    # 9. the hunt: the files and the weights against config.json
    "offsets past the end": Case(
        edit_header(lambda h: h["model.norm.weight"].update(data_offsets=[804864, 900000])),
        ["'model.norm.weight'", "byte", "download the checkpoint again"],
    ),
    "offsets that disagree with the shape": Case(
        edit_header(lambda h: h["model.norm.weight"].update(data_offsets=[804864, 804868])),
        ["'model.norm.weight' of shape [64] and dtype F32 is 256 bytes", "span 4"],
    ),
    "dtype it cannot read": Case(
        edit_header(lambda h: h["model.norm.weight"].update(dtype="I32")),
        ["stored as I32", "F32", "convert the checkpoint"],
    ),
    "header entry without dtype": Case(
        edit_header(lambda h: h["model.norm.weight"].pop("dtype")),
        ["'model.norm.weight' has the header entry"],
    ),
    "header a list": Case(
        lambda d: write_safetensors(d / "model.safetensors", [1], b""),
        ["header is a list"],
    ),
    "header length past the end": Case(
        lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}"),
        ["says its header is 1099511627776 bytes long"],
    ),
    "empty safetensors": Case(write("model.safetensors", b""), ["is 0 bytes long", "truncated"]),
    "empty directory": Case(empty, ["config.json does not exist"]),
    "only an index": Case(
        remove("*.safetensors"), ["names model-00001-of-00005.safetensors"], base="sharded"
    ),
    "index without weight_map": Case(
        write("model.safetensors.index.json", "{}"), ["has no weight_map"], base="sharded"
    ),
    "index naming a path": Case(
        write("model.safetensors.index.json", json.dumps({"weight_map": {"x": "../x"}})),
        ["names the file '../x'"],
        base="sharded",
    ),
    "a tensor in two shards": Case(
        duplicate_shard,
        ["is in both", "copy.safetensors", "model-00002-of-00005.safetensors", "remove the file"],
        base="sharded",
    ),
    "a tensor missing": Case(
        edit_header(lambda h: h.pop(UP)), [f"no file holds {UP!r}", "config.json"]
    ),
    "an unexpected tensor": Case(
        edit_header(lambda h: h.update({"model.extra.weight": h["model.norm.weight"]})),
        ["the files hold 'model.extra.weight'"],
    ),
    "fewer layers in config.json": Case(
        set_config(num_hidden_layers=3),
        ["'model.layers.3.input_layernorm.weight'", "set num_hidden_layers to 4"],
    ),
    "more layers in config.json": Case(
        set_config(num_hidden_layers=5), ["no file holds", "set num_hidden_layers to 4"]
    ),
    "attention_bias without biases": Case(
        set_config(attention_bias=True, mlp_bias=True), ['set "attention_bias": false']
    ),
    "no lm_head, not tied": Case(
        edit_header(lambda h: h.pop("lm_head.weight")),
        ["no file holds 'lm_head.weight'", '"tie_word_embeddings": true'],
    ),
    "a transposed tensor": Case(
        set_shape(UP, [64, 176]), [f"{UP!r} has shape [64, 176]", "stored transposed"]
    ),
    "weights without safetensors": Case(
        remove("model.safetensors"), ["holds no *.safetensors file"], stage="load"
    ),
}


def snapshot(root: pathlib.Path) -> dict:
    """Every file under ``root``: its bytes and modification time (and every directory)."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def broken(case: Case, sources, tmp_path) -> pathlib.Path:
    directory = tmp_path / "checkpoint"
    shutil.copytree(sources[case.base], directory)
    case.mutate(directory)
    return directory


def run(capsys, command: str, *args: str) -> tuple[int, str]:
    code = cli.main([command, str(LLAMA_TINY), *args])
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, command: str, words: list[str]) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.startswith(f"replicator {command}: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("name", list(CASES))
def test_replicator_train_refuses_a_bad_checkpoint_in_one_line(name, sources, tmp_path, capsys):
    case = CASES[name]
    directory = broken(case, sources, tmp_path)
    before = snapshot(directory)
    runs = tmp_path / "runs"
    code, err = run(capsys, "train", f"init_from={directory}", f"out_dir={runs}", "plot=false")
    assert_one_line(code, err, "train", case.words)
    assert snapshot(directory) == before
    if case.stage == "config":  # refused before anything is built
        assert not runs.exists()
        code, err = run(capsys, "explain", f"init_from={directory}")
        assert_one_line(code, err, "explain", case.words)
        assert snapshot(directory) == before


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.stage == "load"])
def test_weights_refused_while_loading_leave_no_run_directory(name, sources, tmp_path, capsys):
    directory = broken(CASES[name], sources, tmp_path)
    runs = tmp_path / "runs"
    code, _ = run(capsys, "train", f"init_from={directory}", f"out_dir={runs}", "plot=false")
    assert code == 2
    assert not runs.exists()


@pytest.mark.parametrize("name", list(CASES))
def test_hf_read_config_and_load_refuse_in_one_line(name, sources, tmp_path):
    """The library's own functions: one line naming the API, a ValueError (or
    FileNotFoundError for what is not there), and the checkpoint untouched."""
    case = CASES[name]
    directory = broken(case, sources, tmp_path)
    before = snapshot(directory)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        hf.load(directory, hf.abstract(hf.read_config(directory), mesh))
    message = str(info.value)
    assert message.startswith(("hf.read_config: ", "hf.load: ")) and "\n" not in message
    for word in case.words:
        assert word in message, (word, message)
    assert snapshot(directory) == before


def test_init_from_a_file_or_nowhere_is_one_line(sources, tmp_path, capsys):
    for where, words in [
        (sources["one"] / "model.safetensors", ["is a file, not a directory"]),
        (tmp_path / "nowhere", ["nowhere does not exist"]),
    ]:
        code, err = run(capsys, "train", f"init_from={where}", f"out_dir={tmp_path / 'runs'}")
        assert_one_line(code, err, "train", [f"init_from='{where}'", *words])
        assert not (tmp_path / "runs").exists()


def test_the_checks_accept_a_valid_checkpoint_and_what_transformers_leaves(sources, tmp_path):
    """A tied head's leftover lm_head and older transformers' rotary buffers are not refused."""
    directory = tmp_path / "checkpoint"
    shutil.copytree(sources["one"], directory)
    edit_header(
        lambda h: h.update({"model.layers.0.self_attn.rotary_emb.inv_freq": h["model.norm.weight"]})
    )(directory)
    assert hf.read_config(directory)["hidden_size"] == 64
    set_config(tie_word_embeddings=True)(directory)
    config = hf.read_config(directory)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    params = hf.load(directory, hf.abstract(config, mesh))
    assert "w" not in params["head"] and params["embed"]["tokens"].shape == (256, 64)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"num_attention_heads": 0}, ["num_attention_heads=0", ">= 1"]),
        ({"hidden_size": "64"}, ["hidden_size='64' is a string"]),
        ({"vocab_size": None}, ["lacks vocab_size"]),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["no low_freq_factor"]),
        ({"hidden_act": "tanh"}, ["hidden_act='tanh' is not implemented", "'silu'"]),
        ({"model_type": "phi3"}, ["model_type='phi3'", "gemma2"]),
    ],
)
def test_decoder_config_refuses_in_one_line(change, words):
    with pytest.raises(ValueError) as info:
        hf.decoder_config(CONFIG | change)
    message = str(info.value)
    assert message.startswith("hf.decoder_config: ") and "\n" not in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.slow  # a step trained (about 5 s); test_qwen2 loads the same files in the fast lane
def test_qwen2_weights_labelled_llama_name_the_fix_that_then_trains(tmp_path, capsys):
    """``replicator train llama_tiny.yaml init_from=DIR`` on a Qwen2's files under
    ``"model_type": "llama"``: one line naming ``"model_type": "qwen2"`` (not the
    ``attention_bias`` hint, which led to a second refusal), nothing written; done as it says,
    the same command trains."""
    qwen2 = {**CONFIG, "model_type": "qwen2", "num_hidden_layers": 1}
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32), hf.shapes(qwen2)
    )
    directory = hf.save(tmp_path / "qwen2", params, qwen2)
    set_config(model_type="llama", architectures=["LlamaForCausalLM"])(directory)
    before, runs = snapshot(directory), tmp_path / "runs"
    args = (f"init_from={directory}", f"out_dir={runs}", "plot=false", "steps=1")
    code, err = run(capsys, "train", *args, "model.seq_len=16", "global_batch=8")
    assert_one_line(code, err, "train", ['set "model_type": "qwen2"', "biases on q, k and v"])
    assert snapshot(directory) == before and not runs.exists()
    set_config(model_type="qwen2")(directory)  # the fix, as the line says (the class aside)
    code, err = run(capsys, "train", *args, "model.seq_len=16", "global_batch=8")
    assert code == 0, err
