"""Hugging Face Mixtral checkpoints: `hf.load` reads each device's block of the per-expert
tensors (each byte once per process) and `hf.save` writes what
``transformers.MixtralForCausalLM.from_pretrained`` reads.

The checkpoints are tiny random models built here with transformers (nothing is downloaded);
the expected trees come from the files' tensors (``safetensors.numpy``) through this file's
own table of names. Only the checkpoint I/O is tested here, not the forward pass.
"""

from __future__ import annotations

import json
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_hf_checkpoints import (
    assert_each_byte_read_once,
    assert_tree_equal,
    counted_reads,  # noqa: F401 -- a fixture
    numpy_state,
    tensor_bytes,
)

import replicator as rp
from replicator.models import hf

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

LAYERS, EXPERTS = 3, 4
SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=LAYERS,
    num_local_experts=EXPERTS,
    num_experts_per_tok=2,
)

LAYER = {  # our leaf under blocks.moe -> (transformers' file name in layer i, transposed)
    ("ln1", "scale"): ("input_layernorm.weight", False),
    ("attn", "q"): ("self_attn.q_proj.weight", True),
    ("attn", "k"): ("self_attn.k_proj.weight", True),
    ("attn", "v"): ("self_attn.v_proj.weight", True),
    ("attn", "out"): ("self_attn.o_proj.weight", True),
    ("ln2", "scale"): ("post_attention_layernorm.weight", False),
    ("moe", "router"): ("block_sparse_moe.gate.weight", True),
}
EXPERT = {  # our expert leaf under blocks.moe.moe -> the file name of expert j in layer i
    "gate": "block_sparse_moe.experts.{j}.w1.weight",
    "up": "block_sparse_moe.experts.{j}.w3.weight",
    "down": "block_sparse_moe.experts.{j}.w2.weight",
}

COLUMNS, ROWS = P(None, None, "model"), P(None, "model")
EXPERT_COLUMNS = P(None, "expert", "data", "model")  # [L, E, D, F]: E, D (ZeRO-3 style), F
SPECS = {
    "embed": {"tokens": P("model")},
    "blocks": {
        "moe": {
            "ln1": P(),
            "attn": {"q": COLUMNS, "k": COLUMNS, "v": COLUMNS, "out": ROWS},
            "ln2": P(),
            "moe": {
                "router": P(None, "data", "expert"),  # [L, D, E]
                "gate": EXPERT_COLUMNS,
                "up": EXPERT_COLUMNS,
                "down": P(None, "expert", "model", "data"),  # [L, E, F, D]
            },
        }
    },
    "head": {"norm": P(), "w": P(None, "model")},
}


def mesh3() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 2, 2), ("data", "expert", "model"))


def expected_params(files: dict[str, np.ndarray], layers: int = LAYERS) -> dict:
    """Our tree from the checkpoint's tensors: weights transposed, layers (and experts)
    stacked."""
    layer = lambda i, name: files[f"model.layers.{i}.{name}"]
    block: dict = {}
    for (group, leaf), (name, transposed) in LAYER.items():
        stacked = np.stack(
            [layer(i, name).T if transposed else layer(i, name) for i in range(layers)]
        )
        block.setdefault(group, {})[leaf] = stacked
    for leaf, name in EXPERT.items():
        block["moe"][leaf] = np.stack(
            [
                np.stack([layer(i, name.format(j=j)).T for j in range(EXPERTS)])
                for i in range(layers)
            ]
        )
    return {
        "embed": {"tokens": files["model.embed_tokens.weight"]},
        "blocks": {"moe": block},
        "head": {"norm": {"scale": files["model.norm.weight"]}, "w": files["lm_head.weight"].T},
    }


def read_files(directory) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint's files, as saved (bf16 stays bf16)."""
    out = {}
    for path in directory.glob("*.safetensors"):
        out |= safetensors_numpy.load_file(path)
    return out


def random_mixtral(**options):
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SIZES, **options))
    with torch.no_grad():  # norms away from 1 and experts apart, so that a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """One tiny random Mixtral saved whole, in several files, and in bf16."""
    root = tmp_path_factory.mktemp("mixtral")
    model = random_mixtral()
    model.save_pretrained(root / "fp32")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    state = numpy_state(model)
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    return types.SimpleNamespace(
        root=root,
        state=state,  # transformers' own (fused experts), fp32
        tokens=np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 12)),
    )


# -- the configuration ---------------------------------------------------------------------------


def test_read_config_fills_mixtral_configs_defaults(tmp_path):
    required = {"model_type": "mixtral", **SIZES}
    del required["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(required))
    config = hf.read_config(tmp_path)
    theirs = transformers.MixtralConfig(**{k: v for k, v in required.items() if k != "model_type"})
    for key in (
        "num_key_value_heads",
        "rms_norm_eps",
        "router_aux_loss_coef",
        "output_router_logits",
        "router_jitter_noise",
        "sliding_window",
        "tie_word_embeddings",
        "max_position_embeddings",
        "num_local_experts",
        "num_experts_per_tok",
    ):
        assert config[key] == getattr(theirs, key), key
    assert config["rope_theta"] == theirs.rope_parameters["rope_theta"] == 1e6
    assert config["head_dim"] == 8 and config["rope_scaling"] is None


def test_shapes_are_the_tree_of_gpt_init_with_experts():
    from replicator.models import gpt, llama

    config = {"model_type": "mixtral", **SIZES}
    ours = hf.shapes(config)
    moe = ours["blocks"]["moe"]["moe"]
    assert moe["gate"].shape == (LAYERS, EXPERTS, 32, 48)
    assert moe["down"].shape == (LAYERS, EXPERTS, 48, 32)
    assert moe["router"].shape == (LAYERS, 32, EXPERTS)
    gpt_config = llama.config(
        vocab_size=64,
        d_model=32,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        d_ff=48,
        seq_len=16,
        num_experts=EXPERTS,
        top_k=2,
    )
    theirs = jax.eval_shape(lambda: gpt.init(gpt_config, jax.random.key(0)))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert jax.tree.map(lambda s: s.shape, ours) == jax.tree.map(lambda s: s.shape, theirs)


def test_read_config_refuses_what_it_cannot_hold(tmp_path):
    config = {"model_type": "mixtral", **SIZES}
    del config["num_local_experts"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mixture of experts.*lacks num_local_experts"):
        hf.read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**SIZES, "model_type": "qwen2_moe"}))
    with pytest.raises(ValueError, match=r"'qwen2_moe'; only 'llama' .*, 'mixtral' .*, 'qwen2' "):
        hf.read_config(tmp_path)


# -- load ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp32", "sharded", "bf16"])
def test_load_on_data_expert_model_reads_each_byte_once(mixtral, kind, counted_reads):  # noqa: F811
    directory = mixtral.root / kind
    config = hf.read_config(directory)
    assert config["model_type"] == "mixtral"
    params = hf.load(directory, hf.abstract(config, mesh3(), SPECS))

    files = read_files(directory)
    assert {str(a.dtype) for a in files.values()} == {"bfloat16" if kind == "bf16" else "float32"}
    want = expected_params(files)
    assert_tree_equal(params, want)  # fp32 leaves: the bf16 values widened exactly
    for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        for shard in leaf.addressable_shards:  # each device holds its own block
            np.testing.assert_array_equal(shard.data, np.asarray(ref, np.float32)[shard.index])
    gate = params["blocks"]["moe"]["moe"]["gate"]
    assert gate.sharding.spec == EXPERT_COLUMNS
    assert gate.addressable_shards[0].data.shape == (LAYERS, EXPERTS // 2, 16, 24)
    assert sum(length for *_, length in counted_reads) == tensor_bytes(directory)
    assert_each_byte_read_once(counted_reads, directory)


def test_load_bf16_into_bf16_parameters_and_bare_shardings(mixtral):
    directory = mixtral.root / "bf16"
    config = hf.read_config(directory)
    want = expected_params(read_files(directory))
    params = hf.load(directory, hf.abstract(config, mesh3(), SPECS, dtype=jnp.bfloat16))
    assert_tree_equal(params, want, dtype=jnp.bfloat16)
    bare = jax.tree.map(lambda s: s.sharding, hf.abstract(config, mesh3(), SPECS))
    assert_tree_equal(hf.load(directory, bare), want)  # shapes from the files: [L, E, ...]


@pytest.mark.parametrize("repeats", [1, 2])
def test_load_and_save_a_pipelines_stages(tmp_path, repeats):
    config = {"model_type": "mixtral", **SIZES, "num_hidden_layers": 4}
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), hf.shapes(config))
    hf.save(tmp_path / "four", params, config)
    files = read_files(tmp_path / "four")
    np.testing.assert_array_equal(  # layer 3, expert 2 of ours is experts.2 of model.layers.3
        files["model.layers.3.block_sparse_moe.experts.2.w2.weight"],
        params["blocks"]["moe"]["moe"]["down"][3, 2].T,
    )
    mesh = jax.make_mesh((2, 2), ("stage", "expert"), devices=jax.devices()[:4])
    staged = jax.eval_shape(lambda: rp.pipeline.stack_stages(params["blocks"], 2, repeats))
    stage = tuple(rp.pipeline.stage_spec(repeats))
    expert = P(*stage, None, "expert")  # [(V,) K, L/K, E, ...]: experts split too
    stages = jax.tree_util.tree_map_with_path(
        lambda path, s: jax.ShapeDtypeStruct(
            s.shape,
            s.dtype,
            sharding=NamedSharding(mesh, expert if path[-1].key in EXPERT else P(*stage)),
        ),
        staged,
    )
    replicated = NamedSharding(mesh, P())
    target = {
        "embed": {"tokens": replicated},
        "stages": stages,
        "head": {"norm": {"scale": replicated}, "w": replicated},
    }
    loaded = hf.load(tmp_path / "four", target)
    up = loaded["stages"]["moe"]["moe"]["up"]  # [(V,) K, L/K, E, d, F]
    assert up.shape == (*staged["moe"]["ln1"]["scale"].shape[:-1], EXPERTS, 32, 48)
    assert_tree_equal(loaded["stages"], rp.pipeline.stack_stages(params["blocks"], 2, repeats))
    hf.save(tmp_path / "again", loaded, config)  # the stages' layers and experts in order
    assert read_files(tmp_path / "again").keys() == files.keys()
    for name, value in read_files(tmp_path / "again").items():
        np.testing.assert_array_equal(value, files[name], err_msg=name)


def test_load_refuses_a_missing_expert_or_another_number_of_experts(mixtral, tmp_path):
    source = mixtral.root / "fp32"
    config = hf.read_config(source)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    files = read_files(source)
    del files["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    safetensors_numpy.save_file(files, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight', which "
        r"params\['blocks'\]\['moe'\]\['moe'\]\['up'\] needs.*Mixtral checkpoint of 3 layers "
        r"and 4 experts",
    ):
        hf.load(broken, hf.abstract(config, mesh))

    three = hf.abstract(config | {"num_local_experts": 3}, mesh)
    with pytest.raises(
        ValueError,
        match=r"params\['blocks'\]\['moe'\]\['moe'\]\['down'\] has shape \[3, 3, 48, 32\], whose "
        r"expert axis \(axis 1\) holds 3 experts; the checkpoint has num_local_experts=4",
    ):
        hf.load(source, three)
    only_router = {
        **three,
        "blocks": {"moe": {"moe": {"router": three["blocks"]["moe"]["moe"]["router"]}}},
    }
    with pytest.raises(
        ValueError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight'"
    ):
        hf.load(source, only_router)  # [L, d, 3]: the router's [4, 32] is not [3, 32]

    llama = {"model_type": "llama", **{k: v for k, v in SIZES.items() if "expert" not in k}}
    llama_tree = hf.abstract(llama, mesh)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight'.*a Mixtral"):
        hf.load(source, llama_tree)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), hf.shapes(llama))
    hf.save(tmp_path / "llama", zeros, llama)
    with pytest.raises(ValueError, match=r"\['moe'\]\['down'\] holds experts, but .* a Llama"):
        hf.load(tmp_path / "llama", hf.abstract(config, mesh))


# -- save ----------------------------------------------------------------------------------------


def from_pretrained(directory):
    model = transformers.MixtralForCausalLM.from_pretrained(directory)
    return model, numpy_state(model)


def logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def test_save_then_from_pretrained_gives_the_same_tensors_and_logits(mixtral, tmp_path):
    source = mixtral.root / "fp32"
    config = hf.read_config(source)
    params = hf.load(source, hf.abstract(config, mesh3(), SPECS))  # saved from its devices

    out = hf.save(tmp_path / "out", params, config, max_shard_bytes=40_000)
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and len(files) > 4, files
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["MixtralForCausalLM"]
    assert (written["num_local_experts"], written["num_experts_per_tok"]) == (EXPERTS, 2)
    assert read_files(out).keys() == read_files(source).keys()  # w1/w2/w3 per expert

    model, state = from_pretrained(out)
    assert state.keys() == mixtral.state.keys()
    for name, value in mixtral.state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    ours = jax.tree.map(np.asarray, params)["blocks"]["moe"]["moe"]
    fused = state["model.layers.2.mlp.experts.gate_up_proj"]  # [E, 2F, D]: w1 then w3
    w1_w3 = np.concatenate([ours["gate"][2], ours["up"][2]], -1)  # [E, D, 2F]
    np.testing.assert_array_equal(fused, np.swapaxes(w1_w3, 1, 2))
    down = state["model.layers.2.mlp.experts.down_proj"]  # [E, D, F]
    np.testing.assert_array_equal(down, np.swapaxes(ours["down"][2], 1, 2))
    np.testing.assert_array_equal(state["model.layers.2.mlp.gate.weight"], ours["router"][2].T)
    for key in (*SIZES, "rms_norm_eps", "sliding_window", "router_aux_loss_coef"):
        assert getattr(model.config, key) == config[key], key
    assert model.config.rope_parameters["rope_theta"] == config["rope_theta"]

    original = transformers.MixtralForCausalLM.from_pretrained(source)
    np.testing.assert_array_equal(logits(model, mixtral.tokens), logits(original, mixtral.tokens))


def test_save_bf16_then_from_pretrained(mixtral, tmp_path):
    source = mixtral.root / "fp32"
    config = hf.read_config(source)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    params = hf.load(source, hf.abstract(config, mesh))
    out = hf.save(tmp_path / "bf16", params, config, dtype="bfloat16")
    assert hf.read_config(out)["torch_dtype"] == "bfloat16"
    model, state = from_pretrained(out)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    for name, value in mixtral.state.items():
        rounded = torch.from_numpy(value).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(state[name], rounded, err_msg=name)


def test_zero3_targets_load_and_save(mixtral, tmp_path):
    import optax

    source = mixtral.root / "fp32"
    config = hf.read_config(source)
    repl = rp.Replicator(mesh_shape={"data": 2, "expert": 2, "model": 2})
    specs = jax.tree.map(  # the data axis left to ZeRO-3
        lambda p: P(*(None if a == "data" else a for a in p)),
        SPECS,
        is_leaf=lambda x: isinstance(x, P),
    )
    opt = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=3)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), hf.shapes(config))
    target = repl.abstract(
        lambda: opt.shard_params(repl.place(zeros, specs), stacked={"blocks": 1})
    )
    params = hf.load(source, target)
    gate = params["blocks"]["moe"]["moe"]["gate"].value  # ZeRO-3 splits d over "data"
    assert gate.sharding.spec == EXPERT_COLUMNS
    want = opt.shard_params(
        repl.place(expected_params(read_files(source)), specs), stacked={"blocks": 1}
    )
    assert jax.tree.structure(params) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        assert got.sharding == ref.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    out = hf.save(tmp_path / "zero3", params, config)
    for name, value in read_files(out).items():
        np.testing.assert_array_equal(value, read_files(source)[name], err_msg=name)


def test_save_refuses_trees_that_do_not_match_the_config(tmp_path):
    config = {"model_type": "mixtral", **SIZES}
    params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), hf.shapes(config))
    three = jax.tree.map(
        lambda s: np.ones(s.shape, s.dtype), hf.shapes(config | {"num_local_experts": 3})
    )
    with pytest.raises(
        ValueError,
        match=r"params\['blocks'\]\['moe'\]\['moe'\]\['gate'\] holds 3 experts .*"
        r"num_local_experts=4",
    ):
        hf.save(tmp_path / "bad", three, config)
    mixed = jax.tree.map(lambda x: x, params)
    mixed["blocks"]["moe"]["moe"]["up"] = three["blocks"]["moe"]["moe"]["up"]
    with pytest.raises(
        ValueError, match=r"different numbers of experts \(.*\['down'\] 4, .*\['up'\] 3\)"
    ):
        hf.save(tmp_path / "bad", mixed, config)
    del mixed["blocks"]["moe"]["moe"]["up"]
    with pytest.raises(
        ValueError, match=r"lack the leaves for model\.layers\.0\.block_sparse_moe\.experts\.0\.w3"
    ):
        hf.save(tmp_path / "bad", mixed, config)
    attention_only = {**params, "blocks": {"moe": {**params["blocks"]["moe"], "moe": {}}}}
    with pytest.raises(
        ValueError, match=r"lack the leaves for model\.layers\.0\.block_sparse_moe\.gate.*Mixtral"
    ):
        hf.save(tmp_path / "bad", attention_only, config)
    without_top_k = {k: v for k, v in config.items() if k != "num_experts_per_tok"}
    with pytest.raises(ValueError, match="num_experts_per_tok=None, which the shapes cannot tell"):
        hf.save(tmp_path / "bad", params, without_top_k)
    with pytest.raises(ValueError, match=r"model_type='llama', but params are a Mixtral's tree"):
        hf.save(tmp_path / "bad", params, config | {"model_type": "llama"})
    assert not (tmp_path / "bad").exists()
