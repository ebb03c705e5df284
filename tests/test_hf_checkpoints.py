"""Hugging Face Llama checkpoints: `hf.load` reads only each device's slice (each byte once per
process) and `hf.save` writes what ``transformers.LlamaForCausalLM.from_pretrained`` reads.

The checkpoints are tiny random models built here with transformers (nothing is downloaded);
the expected trees come from the torch tensors through this file's own table of names.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.models import hf
from replicator.models.hf import files as hf_files

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
)

LAYER = {  # our block leaf -> (transformers' name in layer i, transposed)
    ("ln1", "scale"): ("input_layernorm.weight", False),
    ("attn", "q"): ("self_attn.q_proj.weight", True),
    ("attn", "k"): ("self_attn.k_proj.weight", True),
    ("attn", "v"): ("self_attn.v_proj.weight", True),
    ("attn", "out"): ("self_attn.o_proj.weight", True),
    ("ln2", "scale"): ("post_attention_layernorm.weight", False),
    ("mlp", "gate"): ("mlp.gate_proj.weight", True),
    ("mlp", "up"): ("mlp.up_proj.weight", True),
    ("mlp", "down"): ("mlp.down_proj.weight", True),
}

COLUMNS, ROWS = P(None, None, "model"), P(None, "model")
SPECS = {  # Megatron's split over a 4-way "model" axis; whole over "data"
    "embed": {"tokens": P("model")},
    "blocks": {
        "ln1": P(),
        "attn": {"q": COLUMNS, "k": COLUMNS, "v": COLUMNS, "out": ROWS},
        "ln2": P(),
        "mlp": {"gate": COLUMNS, "up": COLUMNS, "down": ROWS},
    },
    "head": {"norm": P(), "w": P(None, "model")},
}


def expected_params(state: dict[str, np.ndarray], num_layers: int, tied: bool = False) -> dict:
    """Our tree from transformers' tensors: weights transposed, layers stacked."""
    blocks: dict = {}
    for (group, leaf), (name, transposed) in LAYER.items():
        layers = [state[f"model.layers.{i}.{name}"] for i in range(num_layers)]
        blocks.setdefault(group, {})[leaf] = np.stack([x.T if transposed else x for x in layers])
        bias = name.replace("weight", "bias")
        if f"model.layers.0.{bias}" in state:  # attention_bias, mlp_bias
            layers = [state[f"model.layers.{i}.{bias}"] for i in range(num_layers)]
            blocks[group][f"{leaf}_bias"] = np.stack(layers)
    head = {"norm": {"scale": state["model.norm.weight"]}}
    if not tied:
        head["w"] = state["lm_head.weight"].T
    return {"embed": {"tokens": state["model.embed_tokens.weight"]}, "blocks": blocks, "head": head}


def numpy_state(model) -> dict[str, np.ndarray]:
    """The model's tensors as fp32 NumPy (bf16 widens exactly)."""
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def random_llama(**options):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, **options))
    with torch.no_grad():  # norms away from 1, so that a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """One tiny random Llama saved whole, in several files, in bf16, and a tied one."""
    root = tmp_path_factory.mktemp("llama")
    model = random_llama()
    model.save_pretrained(root / "fp32")
    model.save_pretrained(root / "sharded", max_shard_size="50KB")
    fp32 = numpy_state(model)
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    tied = random_llama(tie_word_embeddings=True)
    tied.save_pretrained(root / "tied")
    return types.SimpleNamespace(
        root=root,
        fp32=fp32,
        bf16=numpy_state(model),
        tied=numpy_state(tied),
        tokens=np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 16)),
    )


def tensor_bytes(directory: pathlib.Path) -> int:
    """The bytes of every tensor in the checkpoint's safetensors files."""
    from safetensors import safe_open

    total = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                itemsize = {"F32": 4, "BF16": 2, "F16": 2}[s.get_dtype()]
                total += int(np.prod(s.get_shape())) * itemsize
    return total


def assert_tree_equal(got, want, dtype=np.float32):
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (path, g), (_, w) in zip(flat_got, flat_want, strict=True):
        assert g.dtype == dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=jax.tree_util.keystr(path)
        )


@pytest.fixture
def counted_reads(monkeypatch):
    """Every positioned read `hf.load` makes: (file, offset, length)."""
    reads = []
    real = hf_files.pread_into

    def counting(fd, offset, buffer):
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, len(buffer)))
        real(fd, offset, buffer)

    monkeypatch.setattr(hf_files, "pread_into", counting)
    return reads


def assert_each_byte_read_once(reads, directory, check_total=True):
    """No two reads overlap, and together they cover every tensor byte of the checkpoint."""
    end: dict[str, int] = {}
    for file, offset, length in sorted(reads):
        assert offset >= end.get(file, 0), f"{file}: bytes from {offset} read twice"
        end[file] = offset + length
    if check_total:
        assert sum(length for *_, length in reads) == tensor_bytes(directory)


# -- load ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp32", "sharded", "bf16"])
def test_load_onto_one_device_gives_the_torch_tensors(llama, kind):
    directory = llama.root / kind
    repl = rp.Replicator(devices=jax.devices()[:1])
    target = hf.abstract(hf.read_config(directory), repl)
    params = hf.load(directory, target)
    assert_tree_equal(
        params, expected_params(getattr(llama, kind if kind == "bf16" else "fp32"), 3)
    )
    for leaf, like in zip(jax.tree.leaves(params), jax.tree.leaves(target), strict=True):
        assert leaf.sharding == like.sharding


def test_load_bf16_into_bf16_parameters(llama):
    directory = llama.root / "bf16"
    repl = rp.Replicator(devices=jax.devices()[:1])
    params = hf.load(directory, hf.abstract(hf.read_config(directory), repl, dtype=jnp.bfloat16))
    assert_tree_equal(params, expected_params(llama.bf16, 3), dtype=jnp.bfloat16)


def reads_by_tensor(reads, directory: pathlib.Path) -> dict[str, list[int]]:
    """The lengths of the reads of each tensor of the checkpoint (each read lies in one)."""
    spans = [
        (os.path.realpath(t.file), t.offset, t.offset + int(np.prod(t.shape)) * t.dtype.itemsize, n)
        for n, t in hf_files.tensors(directory).items()
    ]
    out: dict[str, list[int]] = {}
    for file, offset, length in reads:
        [name] = [n for f, a, z, n in spans if f == file and a <= offset and offset + length <= z]
        out.setdefault(name, []).append(length)
    return out


@pytest.mark.parametrize("kind", ["fp32", "sharded", "bf16", "chunked"])
def test_load_onto_a_mesh_reads_each_byte_once(llama, kind, counted_reads, monkeypatch):
    chunk = 1000 if kind == "chunked" else hf_files.CHUNK_BYTES  # spans of 1000 bytes at most
    monkeypatch.setattr(hf_files, "CHUNK_BYTES", chunk)
    kind = "fp32" if kind == "chunked" else kind
    directory = llama.root / kind
    repl = rp.Replicator(mesh_shape={"data": 2, "model": 4})
    target = hf.abstract(hf.read_config(directory), repl, SPECS)
    params = hf.load(directory, target)

    want = expected_params(llama.bf16 if kind == "bf16" else llama.fp32, 3)
    assert_tree_equal(params, want)
    placed = repl.place(want, SPECS)  # what gpt.place gives: the same shardings
    for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(placed), strict=True):
        assert leaf.sharding == ref.sharding
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(shard.data, np.asarray(ref)[shard.index])
    q = params["blocks"]["attn"]["q"]
    assert q.sharding.spec == COLUMNS and q.addressable_shards[0].data.shape == (3, 64, 16)
    assert_each_byte_read_once(counted_reads, directory)
    # A tensor split on its inner dimension over 4 devices (o_proj's and down_proj's columns:
    # our ROWS) is one read, not one per row and block; so is one split into 4 blocks of rows
    # that fit in the cap together (q_proj's, ...); a span longer than the cap is read in
    # pieces of whole rows, at most the cap each.
    for name, lengths in reads_by_tensor(counted_reads, directory).items():
        if chunk > sum(lengths):
            assert len(lengths) == 1, (name, lengths)
        else:
            assert max(lengths) <= chunk, name
    if chunk < 2**20:  # o_proj's rows are 256 bytes (3 a read), down_proj's 384 (2 a read)
        rows = reads_by_tensor(counted_reads, directory)
        assert len(rows["model.layers.1.self_attn.o_proj.weight"]) == -(-64 // 3)
        assert len(rows["model.layers.1.mlp.down_proj.weight"]) == 64 // 2


def test_load_takes_bare_shardings_and_zero3_targets(llama, tmp_path):
    directory = llama.root / "fp32"
    config = hf.read_config(directory)
    repl = rp.Replicator(mesh_shape={"data": 2, "model": 4})
    want = expected_params(llama.fp32, 3)

    target = jax.tree.map(lambda s: s.sharding, hf.abstract(config, repl, SPECS))
    assert_tree_equal(hf.load(directory, target), want)

    import optax

    opt = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=3)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), hf.shapes(config))
    target = repl.abstract(
        lambda: opt.shard_params(repl.place(zeros, SPECS), stacked={"blocks": 1})
    )
    params = hf.load(directory, target)
    want_sharded = opt.shard_params(repl.place(want, SPECS), stacked={"blocks": 1})
    got, ref = jax.tree.leaves(params), jax.tree.leaves(want_sharded)
    assert jax.tree.structure(params) == jax.tree.structure(want_sharded)
    for g, r in zip(got, ref, strict=True):
        assert g.sharding == r.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    _, state = from_pretrained(hf.save(tmp_path / "zero3", params, config))
    for name, value in llama.fp32.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


@pytest.mark.parametrize("repeats", [1, 2])
def test_load_a_pipelines_stages(tmp_path, repeats):
    config = {"model_type": "llama", **SIZES, "num_hidden_layers": 4}
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), hf.shapes(config))
    hf.save(tmp_path / "four", params, config)
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    staged = jax.eval_shape(lambda: rp.pipeline.stack_stages(params["blocks"], 2, repeats))
    spec = rp.pipeline.stage_spec(repeats)
    stages = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
        staged,
    )
    replicated = NamedSharding(mesh, P())
    target = {
        "embed": {"tokens": replicated},
        "stages": stages,
        "head": {"norm": {"scale": replicated}, "w": replicated},
    }
    loaded = hf.load(tmp_path / "four", target)
    want = rp.pipeline.stack_stages(params["blocks"], num_stages=2, repeats=repeats)
    assert_tree_equal(loaded["stages"], want)
    assert_tree_equal(loaded["head"], params["head"])
    hf.save(tmp_path / "again", loaded, config)  # the stages' layers in order
    mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    assert_tree_equal(hf.load(tmp_path / "again", hf.abstract(config, mesh1)), params)


def test_a_tied_head_loads_without_w_or_as_the_tables_transpose(llama):
    directory = llama.root / "tied"
    config = hf.read_config(directory)
    assert config["tie_word_embeddings"]
    repl = rp.Replicator(mesh_shape={"data": 2, "model": 4})
    specs = {**SPECS, "head": {"norm": P()}}
    target = hf.abstract(config, repl, specs)
    assert "w" not in target["head"]
    assert_tree_equal(hf.load(directory, target), expected_params(llama.tied, 3, tied=True))

    target["head"]["w"] = jax.ShapeDtypeStruct(
        (64, 128), jnp.float32, sharding=NamedSharding(repl.mesh, P(None, "model"))
    )
    w = hf.load(directory, target)["head"]["w"]
    np.testing.assert_array_equal(w, llama.tied["model.embed_tokens.weight"].T)


def test_biases_in_gpt_places_layout_load_and_save(llama, tmp_path):
    pytest.importorskip("replicator.models.llama")
    from replicator.models import gpt

    model = random_llama(attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    model.save_pretrained(tmp_path / "biased")
    state = numpy_state(model)
    config = hf.read_config(tmp_path / "biased")
    gpt_config = hf.decoder_config(config, seq_len=16)
    repl = rp.Replicator(mesh_shape={"data": 4, "model": 2})
    target = hf.abstract(config, repl, gpt.partition_specs(config=gpt_config))
    placed = repl.abstract(
        lambda: gpt.place(repl, gpt.init(gpt_config, jax.random.key(0)), config=gpt_config)
    )
    assert jax.tree.structure(target) == jax.tree.structure(placed)
    for a, b in zip(jax.tree.leaves(target), jax.tree.leaves(placed), strict=True):
        assert (a.shape, a.sharding) == (b.shape, b.sharding)
    params = hf.load(tmp_path / "biased", target)
    assert params["blocks"]["attn"]["q_bias"].shape == (3, 64)
    assert_tree_equal(params, expected_params(state, 3))

    out = hf.save(tmp_path / "out", params, config)
    _, saved = from_pretrained(out)
    assert saved.keys() == state.keys()
    for name, value in state.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)


def test_load_refuses_what_does_not_match(llama, tmp_path):
    from safetensors.numpy import save_file

    source = llama.root / "fp32"
    repl = rp.Replicator(devices=jax.devices()[:1])
    target = hf.abstract(hf.read_config(source), repl)

    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    state = {k: v for k, v in llama.fp32.items() if k != "model.layers.2.mlp.up_proj.weight"}
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*\['mlp'\]"):
        hf.load(broken, target)

    state["model.layers.2.mlp.up_proj.weight"] = np.zeros((96, 63), np.float32)
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .*\[96, 63\].*\[96, 64\]"):
        hf.load(broken, target)

    wrong = jax.tree.map(lambda s: s, target)
    wrong["embed"]["extra"] = wrong["embed"]["tokens"]
    with pytest.raises(ValueError, match=r"params\['embed'\]\['extra'\] has no Hugging Face"):
        hf.load(source, wrong)
    bare = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), target)
    with pytest.raises(ValueError, match="has no sharding"):
        hf.load(source, bare)

    config = json.loads((source / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"model_type": "mixtral"}))
    with pytest.raises(ValueError, match=r"model_type='mixtral' \(a mixture of experts"):
        hf.load(broken, target)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.read_config(tmp_path)


# -- save ----------------------------------------------------------------------------------------


def from_pretrained(directory) -> tuple:
    model = transformers.LlamaForCausalLM.from_pretrained(directory)
    return model, numpy_state(model)


def test_save_then_from_pretrained_gives_the_same_tensors(llama, tmp_path):
    source = llama.root / "fp32"
    config = hf.read_config(source)
    repl = rp.Replicator(mesh_shape={"data": 2, "model": 4})
    params = hf.load(source, hf.abstract(config, repl, SPECS))

    out = hf.save(tmp_path / "out", params, config, max_shard_bytes=60_000)
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and len(files) > 4, files
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the temporary directory is gone
    model, state = from_pretrained(out)
    assert state.keys() == llama.fp32.keys()
    for name, value in llama.fp32.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    for key in (*SIZES, "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(model.config, key) == config[key], key
    assert model.config.rope_parameters["rope_theta"] == config["rope_theta"]

    bf16 = hf.save(tmp_path / "bf16", params, config, dtype="bfloat16")
    assert hf.read_config(bf16)["torch_dtype"] == "bfloat16"
    model, state = from_pretrained(bf16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    for name, value in llama.fp32.items():
        rounded = torch.from_numpy(value).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(state[name], rounded, err_msg=name)


def test_save_a_tied_model_and_settings(llama, tmp_path):
    source = llama.root / "tied"
    config = hf.read_config(source)
    params = hf.load(source, hf.abstract(config, rp.Replicator(devices=jax.devices()[:1])))
    settings = config | {"rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    out = hf.save(tmp_path / "tied", params, settings)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    model, state = from_pretrained(out)
    assert model.config.rms_norm_eps == 1e-5
    assert model.config.rope_parameters["rope_theta"] == 500000.0
    for name, value in llama.tied.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_save_refuses_a_full_directory_unless_overwrite(tmp_path):
    config = {"model_type": "llama", **SIZES}
    params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), hf.shapes(config))
    (tmp_path / "out").mkdir()
    hf.save(tmp_path / "out", params, config)  # an empty directory is fine
    with pytest.raises(FileExistsError, match="overwrite=True"):
        hf.save(tmp_path / "out", params, config)
    params["head"]["w"] = 2 * params["head"]["w"]
    hf.save(tmp_path / "out", params, config, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    again = hf.load(tmp_path / "out", hf.abstract(config, rp.Replicator(devices=jax.devices()[:1])))
    assert float(again["head"]["w"][0, 0]) == 2.0
    with pytest.raises(ValueError, match="num_attention_heads=4, head_dim=16"):
        hf.save(tmp_path / "bad", params, config | {"head_dim": 16, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="lack the leaves for model.layers.0.mlp.gate_proj"):
        hf.save(tmp_path / "bad", {**params, "blocks": {**params["blocks"], "mlp": {}}}, config)


# -- the model's own forward pass ----------------------------------------------------------------


def test_logits_equal_transformers(llama):
    """Loaded into `gpt.place`'s layout on a data x model mesh, the model's logits are
    transformers' (the forward pass of `replicator.models.llama`)."""
    pytest.importorskip("replicator.models.llama")
    from replicator.models import gpt

    directory = llama.root / "fp32"
    config = hf.decoder_config(hf.read_config(directory), seq_len=16)
    model = transformers.LlamaForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        want = model(torch.from_numpy(llama.tokens)).logits.numpy()
    repl = rp.Replicator(mesh_shape={"data": 2, "model": 2}, devices=jax.devices()[:4])
    target = repl.abstract(
        lambda: gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
    )
    params = hf.load(directory, target)
    assert params["blocks"]["attn"]["q"].sharding.spec == COLUMNS
    logits = jax.jit(lambda p, t: gpt.apply(p, t, config=config))(params, llama.tokens)
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-5, rtol=1e-5)


# -- host memory ---------------------------------------------------------------------------------

BIG = dict(vocab=32768, d=1024, heads=8, kv_heads=2, ff=4096, layers=14)  # 1.04 GiB in fp32

MEASURE = """
import json, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
import numpy as np
from jax.sharding import PartitionSpec as P
import replicator as rp
from replicator.models import hf

directory = sys.argv[1]
columns, rows = P(None, None, "model"), P(None, "model")
specs = {
    "embed": {"tokens": P("model")},
    "blocks": {"ln1": P(), "ln2": P(), "attn": {"q": columns, "k": columns, "v": columns,
               "out": rows}, "mlp": {"gate": columns, "up": columns, "down": rows}},
    "head": {"norm": P(), "w": P(None, "model")},
}
repl = rp.Replicator(mesh_shape={"data": 1, "model": 8})
target = hf.abstract(hf.read_config(directory), repl, specs)
page = 4096
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
before, start = rss(), time.perf_counter()
params = jax.block_until_ready(hf.load(directory, target))
seconds = time.perf_counter() - start
# VmHWM: this process image's peak resident memory. Not ru_maxrss, which on Linux keeps the
# peak of the image before exec, i.e. of the forking test process's pages.
status = open("/proc/self/status").read().split("VmHWM:")[1]
peak = int(status.split()[0]) * 1024
held = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
shards = params["blocks"]["attn"]["out"].addressable_shards
out = next(s for s in shards if s.index[1].start == 128)  # rows 128:256 of [L, H*hd, d]
print(json.dumps({"before": before, "peak": peak, "held": held, "seconds": seconds,
                  "corner": np.asarray(out.data[5, :3, :3]).tolist()}))
"""


def write_big_checkpoint(directory: pathlib.Path) -> dict:
    """A 1 GiB Llama checkpoint written with NumPy, a few layers per file (the test process
    never holds the whole model)."""
    from safetensors.numpy import save_file

    b = BIG
    hd = b["d"] // b["heads"]
    config = {
        "model_type": "llama",
        "vocab_size": b["vocab"],
        "hidden_size": b["d"],
        "intermediate_size": b["ff"],
        "num_attention_heads": b["heads"],
        "num_key_value_heads": b["kv_heads"],
        "num_hidden_layers": b["layers"],
    }
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    shapes = {
        "input_layernorm.weight": (b["d"],),
        "self_attn.q_proj.weight": (b["heads"] * hd, b["d"]),
        "self_attn.k_proj.weight": (b["kv_heads"] * hd, b["d"]),
        "self_attn.v_proj.weight": (b["kv_heads"] * hd, b["d"]),
        "self_attn.o_proj.weight": (b["d"], b["heads"] * hd),
        "post_attention_layernorm.weight": (b["d"],),
        "mlp.gate_proj.weight": (b["ff"], b["d"]),
        "mlp.up_proj.weight": (b["ff"], b["d"]),
        "mlp.down_proj.weight": (b["d"], b["ff"]),
    }
    weight_map = {}
    outer = {
        "model.embed_tokens.weight": normal(b["vocab"], b["d"]),
        "model.norm.weight": normal(b["d"]),
        "lm_head.weight": normal(b["vocab"], b["d"]),
    }
    save_file(outer, directory / "outer.safetensors", metadata={"format": "pt"})
    weight_map |= dict.fromkeys(outer, "outer.safetensors")
    del outer
    corner = None
    for first in range(0, b["layers"], 4):
        group = {
            f"model.layers.{i}.{name}": normal(*shape)
            for i in range(first, min(first + 4, b["layers"]))
            for name, shape in shapes.items()
        }
        if first == 4:  # layer 5's o_proj, the block the second device holds (rows 128:256)
            corner = group["model.layers.5.self_attn.o_proj.weight"][:3, 128:131].T.tolist()
        file = f"layers-{first}.safetensors"
        save_file(group, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"corner": corner}


@pytest.mark.slow
def test_loading_1gib_onto_8_devices_peaks_below_1_5x_what_they_hold(tmp_path):
    facts = write_big_checkpoint(tmp_path / "big")
    root = pathlib.Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEASURE), str(tmp_path / "big")],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["held"] > 2**30
    np.testing.assert_array_equal(m["corner"], facts["corner"])
    growth = m["peak"] - m["before"]
    print(f"held {m['held'] / 2**30:.3f} GiB, peak growth {growth / 2**30:.3f} GiB", end=" ")
    print(f"({growth / m['held']:.2f}x), loaded in {m['seconds']:.1f} s")
    assert growth < 1.5 * m["held"], (growth / m["held"], m)


# -- two processes -------------------------------------------------------------------------------

WORKER = """
import json, os, sys
import replicator as rp

rp.distributed.initialize()
import jax
from jax.sharding import PartitionSpec as P
from replicator.models import hf
from replicator.models.hf import files as hf_files

source, out, report = sys.argv[1:]
reads = []
real = hf_files.pread_into


def counting(fd, offset, buffer):
    reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, len(buffer)))
    real(fd, offset, buffer)


hf_files.pread_into = counting
columns, rows = P(None, None, "model"), P(None, "model")
specs = {
    "embed": {"tokens": P("model")},
    "blocks": {"ln1": P(), "ln2": P(), "attn": {"q": columns, "k": columns, "v": columns,
               "out": rows}, "mlp": {"gate": columns, "up": columns, "down": rows}},
    "head": {"norm": P(), "w": P(None, "model")},
}
repl = rp.Replicator(mesh_shape={"data": 1, "model": 8})  # "model" spans both processes
config = hf.read_config(source)
params = hf.load(source, hf.abstract(config, repl, specs))
held = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
hf.save(out, params, config, max_shard_bytes=60_000)
explicit = jax.make_mesh((1, 8), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
moved = jax.tree.map(
    lambda x: jax.device_put(x, jax.sharding.NamedSharding(explicit, x.sharding.spec)), params
)
hf.save(out + "-explicit", moved, config)
with open(f"{report}.{jax.process_index()}", "w") as f:
    json.dump({"reads": reads, "held": held, "saw": os.path.isdir(out)}, f)
"""


@pytest.mark.slow
def test_two_processes_each_read_their_half_and_save_one_checkpoint(llama, tmp_path):
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    source, out = llama.root / "fp32", tmp_path / "out"
    root = pathlib.Path(__file__).resolve().parents[1]
    launch = [sys.executable, "-m", "replicator.launch", "-n", "2", "--devices-per-process", "4"]
    worker = [sys.executable, str(tmp_path / "worker.py"), str(source), str(out)]
    run = subprocess.run(
        [*launch, "--", *worker, str(tmp_path / "report")],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = [json.loads((tmp_path / f"report.{i}").read_text()) for i in range(2)]
    total = tensor_bytes(source)
    s = SIZES
    norms = 4 * (2 * s["num_hidden_layers"] + 1) * s["hidden_size"]  # replicated: both
    # o_proj and down_proj [d, in] are split on their inner dimension: each process's blocks
    # touch every row, read as one span (of the whole rows, but half of the first or last)
    inner = (
        4 * s["num_hidden_layers"] * s["hidden_size"] * (s["hidden_size"] + s["intermediate_size"])
    )
    half_row = 4 * s["num_hidden_layers"] * (s["hidden_size"] + s["intermediate_size"]) // 2
    for report in reports:
        assert report["saw"]  # the directory exists once save returns, on every process
        reads = [tuple(r) for r in report["reads"]]
        assert_each_byte_read_once(reads, None, check_total=False)
        assert sum(r[2] for r in reads) == (total - norms - inner) // 2 + norms + inner - half_row
        assert len(reads) <= 4 * len(llama.fp32)  # one read per block at most
    for saved in (out, tmp_path / "out-explicit"):  # from a mesh of automatic, explicit axes
        _, state = from_pretrained(saved)
        for name, value in llama.fp32.items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)
