"""A checkpoint's ``config.json``: read and checked to be of a family
(`replicator.models.families`), with the family's defaults filled in, and the parameter tree
it describes (`shapes`, and `abstract` with shardings)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from replicator._src.core import leaf_specs
from replicator.models import families
from replicator.models.families import FAMILIES, architecture
from replicator.models.hf import checks, files

PyTree = Any

REQUIRED = (  # every family's sizes
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
)
_REPLICATED = P()


def read_config(directory: str | os.PathLike) -> dict:
    """The checkpoint's ``config.json``, checked, with its family's defaults filled in.

    The family is one of `replicator.models.families` (Llama, Mixtral, Qwen2, Gemma 2, Gemma
    3, Qwen3, Qwen3-MoE, Mistral); for the first three, its defaults
    are transformers' ``LlamaConfig``'s, ``MixtralConfig``'s or ``Qwen2Config``'s:
    ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings``, ``rms_norm_eps``,
    ``rope_theta``, ``rope_scaling`` and ``max_position_embeddings`` are always there
    (``rope_theta`` and ``rope_scaling`` taken from a newer file's ``rope_parameters`` too); so
    are ``attention_bias`` and ``mlp_bias`` for a Llama, and ``sliding_window``,
    ``router_aux_loss_coef``, ``output_router_logits`` and ``router_jitter_noise`` for a
    Mixtral, whose ``num_local_experts`` and ``num_experts_per_tok`` are required, and
    ``use_sliding_window`` and ``sliding_window`` for a Qwen2.

    When the directory holds weights (``*.safetensors`` files, or an index), they are checked
    against the config, from the files' headers only: every tensor the config describes is
    there with its shape, and no other.

    Args:
      directory: the checkpoint's directory.

    Returns:
      The ``config.json`` dict, defaults filled in.

    Raises:
      FileNotFoundError: if ``directory`` has no ``config.json``.
      ValueError: for a model of no family (``model_type`` not ``"llama"``, ``"mixtral"`` or
        ``"qwen2"``), an activation other than SiLU, a missing size or a value of the wrong
        type or range, a ``config.json``, index or safetensors header that is not JSON, a
        truncated file, or weights the config does not describe (naming file, key or tensor).

    >>> import json, pathlib, tempfile
    >>> from replicator.models import hf
    >>> directory = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (directory / "config.json").write_text(json.dumps({"model_type": "llama",
    ...     "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
    ...     "num_attention_heads": 2, "num_hidden_layers": 2}))
    >>> config = hf.read_config(directory)
    >>> config["num_key_value_heads"], config["head_dim"], config["rope_theta"]
    (2, 4, 10000.0)
    """
    directory = pathlib.Path(directory)
    config = config_file(directory, "hf.read_config")
    weights = [*directory.glob("*.safetensors"), *directory.glob("model.safetensors.index.json")]
    if weights:
        tensors = files.tensors(directory, "hf.read_config")
        checks.check_weights(config, tensors, tuple(files.DTYPES), "hf.read_config", directory)
    return config


def config_file(directory: pathlib.Path, api: str) -> dict:
    """``directory``'s ``config.json``, checked as `read_config` says (without the weights)."""
    path = directory / "config.json"
    if not path.is_file():
        what = f"{directory} is a file, not a directory" if directory.is_file() else ""
        what = what or f"{path if directory.is_dir() else directory} does not exist"
        raise FileNotFoundError(
            f"{api}: {what}; a Hugging Face checkpoint is a directory with config.json next to "
            f"its *.safetensors files (save_pretrained writes both)."
        )
    fix = "repair it, or use the config.json saved with the model (save_pretrained writes it)"
    config = checks.read_json(path, api, fix)
    if not isinstance(config, dict):
        raise ValueError(
            f"{api}: {path} holds {checks.json_kind(config) or 'a number'}, not a JSON object "
            f'of settings such as {{"model_type": "llama", "hidden_size": 4096, ...}}; {fix}.'
        )
    return checked(config, f"{api}: {path}")


def checked(config: dict, where: str) -> dict:
    """``config`` checked to be of a family we can hold, with the family's defaults filled in."""
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise ValueError(
            f"{where}: model_type={kind!r}; only {families.names()} checkpoints map onto "
            f"replicator's parameters. Use one of those, or set model_type to 'llama' if the "
            f"model truly is one."
        )
    family = FAMILIES[kind]
    config = family.canonical(config)
    required = REQUIRED + family.required
    missing = [k for k in required if config.get(k) is None]
    if missing:
        what = f"model_type={kind!r} (a mixture of experts), but the config" * family.experts
        raise ValueError(
            f"{where}: {what or 'the config'} lacks {', '.join(missing)}; a {family.name} "
            f"config.json gives every size ({', '.join(required)})."
        )
    for key in ("hidden_act", "hidden_activation"):  # the family's options read it
        name = config.get(key)
        if name is not None and name not in architecture.ACTIVATIONS:
            raise ValueError(
                f"{where}: {key}={name!r}; the MLP computes "
                f"{', '.join(map(repr, architecture.ACTIVATIONS))}."
            )
    checks.check_config(config, where, required)
    defaults = family.defaults
    out = {k: v for k, v in config.items() if v is not None or k == "rope_scaling"}
    kv_heads = config.get("num_key_value_heads", defaults.get("num_key_value_heads"))
    out["num_key_value_heads"] = kv_heads or config["num_attention_heads"]  # null: as many as q
    width = config["hidden_size"] // config["num_attention_heads"]
    out.setdefault("head_dim", defaults.get("head_dim") or width)  # Gemma's 256, Qwen3's 128
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:
        out.setdefault("rope_theta", rope.pop("rope_theta"))
    if out.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    if "dtype" in config and "torch_dtype" not in config:
        out["torch_dtype"] = config["dtype"]
    return defaults | out


def shapes(config: dict, *, dtype: Any = jnp.float32) -> dict:
    """The parameter tree of a ``config.json`` dict as ``jax.ShapeDtypeStruct`` leaves.

    The leaves have no shardings (`abstract` adds them).

    Args:
      config: a ``config.json`` dict of a family (`read_config`).
      dtype: the leaves' dtype.

    Returns:
      The tree of the module docstring's layout.

    Raises:
      ValueError: for a config of no family, or with a size missing or out of range.

    >>> from replicator.models import hf
    >>> tree = hf.shapes({"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 12, "num_attention_heads": 2, "num_key_value_heads": 1,
    ...     "num_hidden_layers": 3})
    >>> tree["blocks"]["attn"]["k"].shape, tree["head"]["w"].shape
    ((3, 8, 4), (8, 16))
    >>> tree = hf.shapes({"model_type": "mixtral", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 12, "num_attention_heads": 2, "num_key_value_heads": 1,
    ...     "num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2})
    >>> tree["blocks"]["moe"]["moe"]["gate"].shape, tree["blocks"]["moe"]["moe"]["router"].shape
    ((3, 4, 8, 12), (3, 8, 4))
    >>> tree = hf.shapes({"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 12, "num_attention_heads": 2, "num_key_value_heads": 1,
    ...     "num_hidden_layers": 3})
    >>> sorted(tree["blocks"]["attn"])
    ['k', 'k_bias', 'out', 'q', 'q_bias', 'v', 'v_bias']
    """
    c = checked(config, "hf.shapes: config")
    family = FAMILIES[c["model_type"]]
    v, d = c["vocab_size"], c["hidden_size"]
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    outer = {("embed", "tokens"): (v, d), ("head", "norm", "scale"): (d,), ("head", "w"): (d, v)}
    tree: dict = {}
    for keys in family.outer_names:
        if keys != ("head", "w") or not c["tie_word_embeddings"]:
            _put(tree, keys, s(*outer[keys]))
    shapes = _block_shapes(c, family.experts)
    for keys in family.block_names(family.biases(c)):
        group, leaf = keys[-2:]
        weight = shapes.get((group, leaf.removesuffix("_bias")))
        if weight is None:  # a family's new leaf: its shape is to be added to _block_shapes
            raise NotImplementedError(
                f"hf.shapes: the {family.name} family names blocks.{'.'.join(keys)}, whose "
                f"shape _block_shapes does not give."
            )
        bias = leaf.endswith("_bias")  # a linear's bias: [layers, out]
        _put(tree, ("blocks", *keys), s(*weight[:1], weight[-1]) if bias else s(*weight))
    return tree


def _block_shapes(c: dict, experts: bool) -> dict[tuple[str, str], tuple[int, ...]]:
    """The shape of each leaf of a block a family may name, by its last two keys (``("attn",
    "q")``, ``("moe", "router")``, ``("ln1", "scale")``), stacked over ``c``'s layers."""
    family = FAMILIES[c["model_type"]]
    d, f, n = c["hidden_size"], c[family.size_key("intermediate_size")], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {
        ("ln1", "scale"): (n, d),
        ("attn", "q"): (n, d, q),
        ("attn", "k"): (n, d, kv),
        ("attn", "v"): (n, d, kv),
        ("attn", "out"): (n, q, d),
        ("ln2", "scale"): (n, d),
        ("mlp", "gate"): (n, d, f),
        ("mlp", "up"): (n, d, f),
        ("mlp", "down"): (n, f, d),
        ("q_norm", "scale"): (n, c["head_dim"]),  # GPTConfig.qk_norm's
        ("k_norm", "scale"): (n, c["head_dim"]),
        ("post_attn_norm", "scale"): (n, d),  # GPTConfig.post_norms'
        ("post_mlp_norm", "scale"): (n, d),
    }
    if experts:
        e = c[family.experts_key]
        shapes |= {("moe", "router"): (n, d, e), ("moe", "gate"): (n, e, d, f)}
        shapes |= {("moe", "up"): (n, e, d, f), ("moe", "down"): (n, e, f, d)}
    return shapes


def _put(tree: dict, keys: tuple[str, ...], leaf: Any) -> None:
    """Sets ``tree[keys[0]][keys[1]]...`` to ``leaf``, making the dicts on the way."""
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = leaf


def abstract(
    config: dict, mesh: Any, specs: P | PyTree = _REPLICATED, *, dtype: Any = jnp.float32
) -> dict:
    """`shapes` with the ``NamedSharding`` that ``repl.place(params, specs)`` would give each leaf.

    It is the ``target`` of `load` for a model placed that way.

    Args:
      config: the ``config.json`` dict (`read_config`).
      mesh: a ``jax.sharding.Mesh`` or a ``Replicator`` (its ``mesh``).
      specs: one ``PartitionSpec`` for every leaf, or a tree of them that is a prefix of
        `shapes`' tree, as ``Replicator.place`` takes (e.g. ``gpt.partition_specs(...)``).
      dtype: the parameters' dtype (the checkpoint's values are cast to it).

    Returns:
      `shapes`' tree of ``jax.ShapeDtypeStruct`` leaves with their shardings.

    Raises:
      ValueError: as ``Replicator.place`` does for specs that do not fit the tree or mesh.

    >>> import jax
    >>> from jax.sharding import PartitionSpec as P
    >>> from replicator.models import hf
    >>> config = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 12, "num_attention_heads": 2, "num_hidden_layers": 2}
    >>> mesh = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1])
    >>> columns = P(None, None, "model")           # heads over "model"
    >>> specs = {"embed": P(), "head": P(), "blocks": {"ln1": P(), "ln2": P(),
    ...     "attn": {"q": columns, "k": columns, "v": columns, "out": P(None, "model")},
    ...     "mlp": {"gate": columns, "up": columns, "down": P(None, "model")}}}
    >>> tree = hf.abstract(config, mesh, specs)
    >>> tree["blocks"]["attn"]["q"].sharding.spec
    P(None, None, 'model')
    """
    mesh = getattr(mesh, "mesh", mesh)
    tree = shapes(config, dtype=dtype)
    shardings = leaf_specs.leaf_shardings(mesh, tree, specs, api="hf.abstract")
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        tree,
        shardings,
    )


# -- the files -----------------------------------------------------------------------------------
