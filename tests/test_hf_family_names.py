"""Every name lookup of `replicator.models.hf` and `llama`'s state dicts uses one family's own
`Family` record (`replicator.models.families`), chosen by the config's ``model_type``: two
families may name the same leaf differently (Gemma 2's ``ln2`` is ``pre_feedforward_layernorm``,
Llama's ``post_attention_layernorm``), and a leaf one family has and another lacks is refused,
never read under the other family's name."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from replicator.models import gpt, hf, llama
from replicator.models.families import FAMILIES, family
from replicator.models.hf import configs, leaves

SIZES = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 12, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 2}  # fmt: skip
OTHER = dataclasses.replace(  # Llama's block, its second norm named as Gemma 2 names it
    FAMILIES["llama"],
    model_type="renamed",
    architecture="RenamedForCausalLM",
    layer_names={
        **family.LAYER_NAMES,
        ("ln2", "scale"): ("pre_feedforward_layernorm.weight", False),
    },
)
POST = dataclasses.replace(  # and with a norm after attention, where Llama has its ln2
    OTHER,
    model_type="post",
    architecture="PostForCausalLM",
    layer_names={
        **OTHER.layer_names,
        ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", False),
    },
)


@pytest.fixture
def registered(monkeypatch):
    for f in (OTHER, POST):
        monkeypatch.setitem(FAMILIES, f.model_type, f)


def random_tree(config: dict) -> dict:
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), hf.shapes(config))


def test_a_leaf_is_named_as_its_family_names_it():
    path = tuple(jax.tree_util.DictKey(k) for k in ("blocks", "ln2", "scale"))
    llama_leaf = leaves.describe(path, 2, "t", FAMILIES["llama"])
    assert llama_leaf.name == "model.layers.{i}.post_attention_layernorm.weight"
    assert (
        leaves.describe(path, 2, "t", OTHER).name
        == "model.layers.{i}.pre_feedforward_layernorm.weight"
    )
    post = tuple(jax.tree_util.DictKey(k) for k in ("blocks", "post_attn_norm", "scale"))
    with pytest.raises(ValueError, match=r"\['post_attn_norm'\]\['scale'\] has no Hugging Face "
                       r"tensor in a Llama's checkpoint \(it is a Gemma2's leaf\); its leaves are "
                       r"embed.tokens"):  # fmt: skip
        leaves.describe(post, 2, "t", FAMILIES["llama"])


@pytest.mark.parametrize(
    "config",
    [{"model_type": "llama"}, {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
     {"model_type": "qwen2"}, {"model_type": "mixtral", "num_local_experts": 3,
                               "num_experts_per_tok": 2}],
)  # fmt: skip
def test_the_tree_of_a_config_has_the_leaves_its_family_names(config):
    config = configs.checked(SIZES | config, "test")
    found = FAMILIES[config["model_type"]]
    paths = jax.tree_util.tree_flatten_with_path(hf.shapes(config))[0]
    keys = {leaves.dict_keys(path) for path, _ in paths}
    blocks = {k[1:] for k in keys if k[0] == "blocks"}
    assert blocks == set(found.block_names(found.biases(config)))
    assert keys - {("blocks", *k) for k in blocks} == set(found.outer_names)
    names = [n for path, s in paths for n in leaves.describe(path, s.ndim, "t", found).names(2, 3)]
    assert sorted(names) == sorted(hf.checks.expected(config))


def test_save_and_load_name_the_tensors_as_the_configs_family(tmp_path, registered):
    config = SIZES | {"model_type": "renamed"}
    params = random_tree(config)
    out = hf.save(tmp_path / "renamed", params, config)
    held = json.loads((out / "config.json").read_text())
    assert held["architectures"] == ["RenamedForCausalLM"]
    from safetensors.numpy import load_file

    files = load_file(out / "model.safetensors")
    assert "model.layers.1.pre_feedforward_layernorm.weight" in files
    assert not any("post_attention_layernorm" in name for name in files)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    loaded = hf.load(out, hf.abstract(hf.read_config(out), mesh))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), params)

    # A Llama's checkpoint read into a tree with a leaf it has not (POST's post_attn_norm,
    # which POST names as Llama names its ln2) is refused, not read from ln2's tensor.
    llama_out = hf.save(tmp_path / "llama", random_tree(SIZES | {"model_type": "llama"}), SIZES)
    post_tree = hf.abstract(SIZES | {"model_type": "post"}, mesh)
    with pytest.raises(ValueError, match=r"\['post_attn_norm'\]\['scale'\] is not a leaf of a "
                       r"Llama's tree, and the checkpoint is a Llama"):  # fmt: skip
        hf.load(llama_out, post_tree)
    with pytest.raises(ValueError, match=r"model_type='llama', but params are a \w+'s tree"):
        hf.save(tmp_path / "bad", random_tree(SIZES | {"model_type": "post"}), SIZES | {
            "model_type": "llama"})  # fmt: skip


def test_state_dicts_take_the_family(registered):
    config = llama.config(vocab_size=16, d_model=8, num_layers=2, num_heads=2, d_ff=12)
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), shapes)
    state = llama.state_dict_from_params(params, config=config)  # by default: a Llama's
    assert "model.layers.0.post_attention_layernorm.weight" in state
    renamed = llama.state_dict_from_params(params, config=config, family=OTHER)
    assert "model.layers.0.pre_feedforward_layernorm.weight" in renamed
    assert not any("post_attention_layernorm" in name for name in renamed)
    back = llama.params_from_state_dict(renamed, config=config, family=OTHER)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.pre_feedforward"):
        llama.params_from_state_dict(renamed, config=config)
    with pytest.raises(ValueError, match=r"names differ: the tree lacks blocks.post_attn_norm"):
        llama.state_dict_from_params(params, config=config, family=POST)
    with pytest.raises(ValueError, match=r"config is not a Mixtral's .*num_experts > 0"):
        llama.state_dict_from_params(params, config=config, family=FAMILIES["mixtral"])


def test_the_mixtral_family_unfuses_transformers_5s_experts():
    config = llama.config(vocab_size=16, d_model=8, num_layers=2, num_heads=2, d_ff=6,
                          num_experts=3, top_k=2)  # fmt: skip
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), shapes)
    files = llama.state_dict_from_params(params, config=config)
    fused = {k: v for k, v in files.items() if ".block_sparse_moe." not in k}
    for i in range(2):
        moe = f"model.layers.{i}.block_sparse_moe."
        w = lambda x, moe=moe: np.stack([files[f"{moe}experts.{j}.{x}.weight"] for j in range(3)])
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([w("w1"), w("w3")], 1)
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = w("w2")
        fused[f"model.layers.{i}.mlp.gate.weight"] = files[f"{moe}gate.weight"]
    unfused = dict(llama.files_state_dict(fused, config=config))
    assert unfused.keys() == files.keys()
    jax.tree.map(np.testing.assert_array_equal, unfused, files)
    assert llama.files_state_dict(files, config=config) is files  # as the files name them
