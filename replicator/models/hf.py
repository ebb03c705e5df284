"""Hugging Face Llama and Mixtral checkpoints in and out, one device's slice at a time.

`load` builds every parameter as a global ``jax.Array`` whose devices each get only the slice
they hold, straight from the checkpoint's ``*.safetensors`` files (fp32, fp16 or bf16), in a
few large reads per tensor: no host holds the whole model, and the rows a process's slices
touch are read once per process.
`save` writes a directory that ``transformers.LlamaForCausalLM.from_pretrained`` (or
``MixtralForCausalLM``'s) reads, gathering one tensor at a time to the host.

The parameter tree (`replicator.models.gpt` with its Llama options) and the Hugging Face names.
Hugging Face stores a linear layer as ``[out, in]``; ours is ``[in, out]``, its transpose (T):

=========================  =====================  =============================================
ours                       shape                  Hugging Face
=========================  =====================  =============================================
``embed.tokens``           ``[V, d]``             ``model.embed_tokens.weight``
``blocks.ln1.scale``       ``[L, d]``             ``model.layers.{i}.input_layernorm.weight``
``blocks.attn.q``          ``[L, d, H*hd]``       ``model.layers.{i}.self_attn.q_proj`` T
``blocks.attn.k|v``        ``[L, d, KV*hd]``      ``model.layers.{i}.self_attn.{k,v}_proj`` T
``blocks.attn.out``        ``[L, H*hd, d]``       ``model.layers.{i}.self_attn.o_proj`` T
``blocks.ln2.scale``       ``[L, d]``             ``model.layers.{i}.post_attention_layernorm``
``blocks.mlp.gate|up``     ``[L, d, F]``          ``model.layers.{i}.mlp.{gate,up}_proj`` T
``blocks.mlp.down``        ``[L, F, d]``          ``model.layers.{i}.mlp.down_proj`` T
``head.norm.scale``        ``[d]``                ``model.norm.weight``
``head.w``                 ``[d, V]``             ``lm_head.weight`` T (none when tied)
=========================  =====================  =============================================

(``.weight`` left out of the names, T for transposed). With ``attention_bias`` and
``mlp_bias``, each linear leaf ``x`` has an ``x_bias`` leaf ``[L, out]`` (``..._proj.bias``).

A Mixtral (``model_type: "mixtral"``, E experts; the GPT's Llama options with
``num_experts=E``) has the same ``embed`` and ``head``; its blocks are ``blocks.moe``:
``ln1``, ``attn`` and ``ln2`` named as above, and ``moe`` in place of ``mlp``, whose expert
leaves have an expert axis after the layers' (``[i, j]``: layer i, expert j; the names are in
``model.layers.{i}.block_sparse_moe.``):

=========================  =====================  =============================================
``blocks.moe.moe.router``  ``[L, d, E]``          ``gate`` T (``[E, d]``)
``blocks.moe.moe.gate``    ``[L, E, d, F]``       ``experts.{j}.w1`` T
``blocks.moe.moe.up``      ``[L, E, d, F]``       ``experts.{j}.w3`` T
``blocks.moe.moe.down``    ``[L, E, F, d]``       ``experts.{j}.w2`` T
=========================  =====================  =============================================

The blocks may also be a pipeline's ``stages`` (`gpt.pipeline_params`): leading axes
``[K, L/K]`` or ``[V, K, L/K]`` hold the layers in row-major order (then the expert axis, as
``[K, L/K, E, d, F]``). Mixtral has no biases. ZeRO-3's `ShardedParam` leaves load and save as
the arrays they wrap.

To train a checkpoint, read its sizes with `read_config` (``llama.from_hf_config`` turns them
into a `gpt.GPTConfig`) and load it into the layout training uses:
``hf.load(path, repl.abstract(lambda: gpt.place(repl, gpt.init(config, key), config=config)))``
(``repl.abstract`` allocates nothing), or ``hf.load(path, hf.abstract(hf_config, repl, specs))``.

>>> import pathlib, tempfile, jax, numpy as np
>>> from replicator.models import hf
>>> config = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
...           "intermediate_size": 12, "num_attention_heads": 2, "num_hidden_layers": 2}
>>> rng = np.random.default_rng(0)
>>> params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), hf.shapes(config))
>>> directory = pathlib.Path(tempfile.mkdtemp()) / "tiny-llama"
>>> _ = hf.save(directory, params, config)
>>> sorted(p.name for p in directory.iterdir())
['config.json', 'model.safetensors']
>>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
>>> loaded = hf.load(directory, hf.abstract(hf.read_config(directory), mesh))
>>> bool(np.array_equal(loaded["blocks"]["attn"]["q"], params["blocks"]["attn"]["q"]))
True
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import pathlib
import shutil
import struct
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from replicator._src.core import leaf_specs
from replicator.models import hf_checks, llama

PyTree = Any

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

_TOP = llama.OUTER_NAMES  # our leaves outside the blocks: the tensor, and whether transposed
_LAYER = llama.LAYER_NAMES | llama.BIAS_NAMES  # one block's: the name after model.layers.{i}.
# a Mixtral block's (under blocks.moe): Llama's attention and norms, the router, and each
# expert's matrices ({j}: expert j)
_MIXTRAL = llama.MIXTRAL_LAYER_NAMES | llama.EXPERT_NAMES
_ROUTER = "model.layers.0.block_sparse_moe.gate.weight"  # a Mixtral's, in its first layer

_STACKED = ("blocks", "stages")
_REPLICATED = P()
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
)
_FAMILIES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}  # model_type's
_MOE_REQUIRED = ("num_local_experts", "num_experts_per_tok")
_DROPPED = {"rope_parameters", "dtype", "transformers_version", "_name_or_path"}
_DEFAULTS = llama.HF_DEFAULTS["llama"]
_MIXTRAL_DEFAULTS = llama.HF_DEFAULTS["mixtral"]


# -- the configuration ---------------------------------------------------------------------------


def read_config(directory: str | os.PathLike) -> dict:
    """The checkpoint's ``config.json``, checked to be a Llama or a Mixtral, with its family's
    defaults filled in (transformers' ``LlamaConfig``'s or ``MixtralConfig``'s):
    ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings``, ``rms_norm_eps``,
    ``rope_theta``, ``rope_scaling`` and ``max_position_embeddings`` are always there
    (``rope_theta`` and ``rope_scaling`` taken from a newer file's ``rope_parameters`` too); so
    are ``attention_bias`` and ``mlp_bias`` for a Llama, and ``sliding_window``,
    ``router_aux_loss_coef``, ``output_router_logits`` and ``router_jitter_noise`` for a
    Mixtral, whose ``num_local_experts`` and ``num_experts_per_tok`` are required.

    >>> import json, pathlib, tempfile
    >>> from replicator.models import hf
    >>> directory = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (directory / "config.json").write_text(json.dumps({"model_type": "llama",
    ...     "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
    ...     "num_attention_heads": 2, "num_hidden_layers": 2}))
    >>> config = hf.read_config(directory)
    >>> config["num_key_value_heads"], config["head_dim"], config["rope_theta"]
    (2, 4, 10000.0)

    When the directory holds weights (``*.safetensors`` files, or an index), they are checked
    against the config, from the files' headers only: every tensor the config describes is
    there with its shape, and no other.

    Raises:
      FileNotFoundError: if ``directory`` has no ``config.json``.
      ValueError: for a model other than Llama or Mixtral (``model_type`` not ``"llama"`` or
        ``"mixtral"``), an activation other than SiLU, a missing size or a value of the wrong
        type or range, a ``config.json``, index or safetensors header that is not JSON, a
        truncated file, or weights the config does not describe (naming file, key or tensor).
    """
    directory = pathlib.Path(directory)
    config = _config(directory, "hf.read_config")
    weights = [*directory.glob("*.safetensors"), *directory.glob("model.safetensors.index.json")]
    if weights:
        tensors = _tensors(directory, "hf.read_config")
        hf_checks.check_weights(config, tensors, tuple(_DTYPES), "hf.read_config", directory)
    return config


def _config(directory: pathlib.Path, api: str) -> dict:
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
    config = hf_checks.read_json(path, api, fix)
    if not isinstance(config, dict):
        raise ValueError(
            f"{api}: {path} holds {hf_checks.json_kind(config) or 'a number'}, not a JSON object "
            f'of settings such as {{"model_type": "llama", "hidden_size": 4096, ...}}; {fix}.'
        )
    return _llama(config, f"{api}: {path}")


def _llama(config: dict, where: str) -> dict:
    """``config`` checked to be a Llama or a Mixtral we can hold, with its defaults filled in."""
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in _FAMILIES:
        extra = {
            "mistral": " (Llama's layout with sliding-window attention, not supported yet)",
        }.get(kind if isinstance(kind, str) else "", "")
        raise ValueError(
            f"{where}: model_type={kind!r}{extra}; only 'llama' (LlamaForCausalLM) and 'mixtral' "
            f"(MixtralForCausalLM) checkpoints map onto replicator's parameters. Use one of "
            f"those, or set model_type to 'llama' if the model truly is one."
        )
    mixtral = kind == "mixtral"
    required = _REQUIRED + _MOE_REQUIRED * mixtral
    missing = [k for k in required if config.get(k) is None]
    if missing:
        what = "model_type='mixtral' (a mixture of experts), but the config" if mixtral else ""
        raise ValueError(
            f"{where}: {what or 'the config'} lacks {', '.join(missing)}; a "
            f"{_FAMILIES[kind].removesuffix('ForCausalLM')} config.json gives every size "
            f"({', '.join(required)})."
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{where}: hidden_act={config['hidden_act']!r}; the Llama MLP here is SiLU-gated "
            f"(hidden_act 'silu')."
        )
    hf_checks.check_config(config, where, required)
    defaults = _MIXTRAL_DEFAULTS if mixtral else _DEFAULTS
    out = {k: v for k, v in config.items() if v is not None or k == "rope_scaling"}
    kv_heads = config.get("num_key_value_heads", defaults.get("num_key_value_heads"))
    out["num_key_value_heads"] = kv_heads or config["num_attention_heads"]  # null: as many as q
    out.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:
        out.setdefault("rope_theta", rope.pop("rope_theta"))
    if out.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    if "dtype" in config and "torch_dtype" not in config:
        out["torch_dtype"] = config["dtype"]
    return defaults | out


def shapes(config: dict, *, dtype: Any = jnp.float32) -> dict:
    """The parameter tree of a Llama or Mixtral ``config`` (a ``config.json`` dict) as
    ``jax.ShapeDtypeStruct`` leaves without shardings (`abstract` adds them).

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
    """
    c = _llama(config, "hf.shapes: config")
    v, d, f, n = c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)

    def linears(weights: dict, bias: bool) -> dict:  # with bias, "{name}_bias" after each
        out = {}
        for name, w in weights.items():
            out |= {name: w} | ({f"{name}_bias": s(*w.shape[:1], w.shape[-1])} if bias else {})
        return out

    attn = {"q": s(n, d, q), "k": s(n, d, kv), "v": s(n, d, kv), "out": s(n, q, d)}
    head = {"norm": {"scale": s(d)}} | ({} if c["tie_word_embeddings"] else {"w": s(d, v)})
    if c["model_type"] == "mixtral":
        e = c["num_local_experts"]
        moe = {"router": s(n, d, e), "gate": s(n, e, d, f), "up": s(n, e, d, f)}
        block = {"ln1": {"scale": s(n, d)}, "attn": attn, "ln2": {"scale": s(n, d)}}
        block["moe"] = moe | {"down": s(n, e, f, d)}
        return {"embed": {"tokens": s(v, d)}, "blocks": {"moe": block}, "head": head}
    mlp = {"gate": s(n, d, f), "up": s(n, d, f), "down": s(n, f, d)}
    return {
        "embed": {"tokens": s(v, d)},
        "blocks": {
            "ln1": {"scale": s(n, d)},
            "attn": linears(attn, c["attention_bias"]),
            "ln2": {"scale": s(n, d)},
            "mlp": linears(mlp, c["mlp_bias"]),
        },
        "head": head,
    }


def abstract(
    config: dict, mesh: Any, specs: P | PyTree = _REPLICATED, *, dtype: Any = jnp.float32
) -> dict:
    """`shapes` with the ``NamedSharding`` on ``mesh`` that ``repl.place(params, specs)``
    would give each leaf: the ``target`` of `load` for a model placed that way.

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

    Args:
      config: the ``config.json`` dict (`read_config`).
      mesh: a ``jax.sharding.Mesh`` or a ``Replicator`` (its ``mesh``).
      specs: one ``PartitionSpec`` for every leaf, or a tree of them that is a prefix of
        `shapes`' tree, as ``Replicator.place`` takes (e.g. ``gpt.partition_specs(...)``).
      dtype: the parameters' dtype (the checkpoint's values are cast to it).

    Raises:
      ValueError: as ``Replicator.place`` does for specs that do not fit the tree or mesh.
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


class _Tensor(NamedTuple):
    file: pathlib.Path
    code: str  # the safetensors dtype, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the file

    @property
    def dtype(self) -> np.dtype:
        return _DTYPES[self.code]


def _tensors(directory: pathlib.Path, api: str = "hf.load") -> dict[str, _Tensor]:
    """Every tensor of the checkpoint in ``directory``: the files its index names, else every
    ``*.safetensors`` file there; each file's header checked (`hf_checks.read_header`), and
    each tensor in one file only (the one the index names)."""
    index = directory / "model.safetensors.index.json"
    weights = hf_checks.read_index(index, api) if index.is_file() else None
    if weights is not None:
        files = sorted(set(weights.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{api}: {directory} holds no *.safetensors file; save the model with "
            f"save_pretrained (safetensors is its default) or with hf.save."
        )
    tensors: dict[str, _Tensor] = {}
    for name in files:
        for tensor, found in hf_checks.read_header(directory / name, api).items():
            if tensor in tensors:
                raise hf_checks.duplicate(tensor, tensors[tensor].file, directory / name, api)
            tensors[tensor] = _Tensor(directory / name, *found)
    if weights is not None:
        hf_checks.check_index(weights, tensors, index, api)
    return tensors


_CHUNK_BYTES = 64 * 2**20  # the most bytes one read brings in; a longer span is read in pieces


def _pread_into(fd: int, offset: int, buffer: memoryview) -> None:
    """Fills ``buffer`` with the file's bytes from ``offset``: every read `load` makes."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise EOFError(f"hf.load: a safetensors file ends before byte {offset + len(buffer)}.")
        done += n


_Box = tuple[tuple[int, int], ...]  # a block: a (start, stop) per dimension


def _intervals(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (``(start, stop)`` pairs) merged where they overlap or touch, in order.

    >>> _intervals([(4, 6), (0, 2), (1, 3), (3, 4), (8, 9)])
    [(0, 6), (8, 9)]
    """
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[0] < r[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _span(boxes: list[_Box], first: int, last: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """The elements, counted from row ``first``'s first one, from the first to the last that
    ``boxes`` hold in rows ``first`` to ``last`` (excluded) of a tensor of ``shape``: the one
    contiguous run of bytes a read of those rows needs.

    >>> _span([((0, 4), (2, 3)), ((1, 2), (0, 1))], 1, 3, (4, 5))  # rows 1-2: 1,0 to 2,2
    (0, 8)
    """
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    lo, hi = math.inf, 0
    for box in boxes:
        a, z = max(box[0][0], first), min(box[0][1], last)
        if a >= z:
            continue
        inner = list(zip(box[1:], strides[1:]))
        lo = min(lo, (a - first) * strides[0] + sum(s * k for (s, _), k in inner))
        hi = max(hi, (z - 1 - first) * strides[0] + sum((e - 1) * k for (_, e), k in inner) + 1)
    return int(lo), hi


class _Reader:
    """Reads the rows of the checkpoint's tensors that blocks need with positioned reads (no
    mapping of whole files, so the host's memory holds only what was asked for)."""

    def __init__(self, tensors: dict[str, _Tensor]) -> None:
        self.tensors = tensors
        self._fds: dict[pathlib.Path, int] = {}
        self._buffer = np.empty(0, np.uint8)  # the pieces', reused: no page faults for each

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffer = np.empty(0, np.uint8)

    def _piece(self, size: int, dtype: np.dtype) -> np.ndarray:
        """``size`` elements of ``dtype`` in the reused buffer (grown to the largest piece)."""
        if self._buffer.nbytes < size * dtype.itemsize:
            self._buffer = np.empty(size * dtype.itemsize, np.uint8)
        return self._buffer[: size * dtype.itemsize].view(dtype)

    def rows(self, name: str, boxes: list[_Box]) -> Iterator[tuple[int, np.ndarray]]:
        """Tensor ``name``'s rows (indices on its first dimension) that ``boxes`` (non-empty
        blocks of it) hold, as ``(first row, rows)`` pieces of at most `_CHUNK_BYTES` (or one
        row), in order. A piece is one read: the bytes from the first element a box holds in
        its rows to the last (its other elements are left unread). So each byte is read at
        most once, and none outside the rows the boxes touch. A piece is valid until the next
        one is asked for (they share one buffer)."""
        t = self.tensors[name]
        if t.file not in self._fds:
            self._fds[t.file] = os.open(t.file, os.O_RDONLY)
        width = math.prod(t.shape[1:])  # elements in a row
        per = max(1, _CHUNK_BYTES // max(1, width * t.dtype.itemsize))
        for start, stop in _intervals([box[0] for box in boxes]):
            for first in range(start, stop, per):
                last = min(stop, first + per)
                lo, hi = _span(boxes, first, last, t.shape)
                piece = self._piece((last - first) * width, t.dtype)
                offset = t.offset + (first * width + lo) * t.dtype.itemsize
                try:
                    _pread_into(self._fds[t.file], offset, memoryview(piece[lo:hi].view(np.uint8)))
                except EOFError:  # cut short since its header was read
                    raise ValueError(
                        f"hf.load: {t.file} is truncated: it ends inside tensor {name!r}; "
                        f"{hf_checks.AGAIN}."
                    ) from None
                yield first, piece.reshape(last - first, *t.shape[1:])


# -- load ----------------------------------------------------------------------------------------


class _Leaf(NamedTuple):
    where: str  # "params['blocks']['attn']['q']", for messages
    name: str  # the Hugging Face tensor; with "{i}" for the layer in the blocks, "{j}" the expert
    lead: int  # the number of leading axes: the layers', then the expert's (0 outside the blocks)
    transposed: bool

    @property
    def experts(self) -> bool:
        """Whether the last leading axis is the experts' (one tensor per layer and expert)."""
        return "{j}" in self.name

    def names(self, num_layers: int, num_experts: int = 1) -> list[str]:
        """The Hugging Face tensor of each layer (and expert), in row-major order of the leading
        axes (the one tensor outside the blocks)."""
        if not self.lead:
            return [self.name]
        experts = range(num_experts if self.experts else 1)
        return [self.name.format(i=i, j=j) for i in range(num_layers) for j in experts]


def _keys(path: tuple) -> tuple[str, ...]:
    """A leaf's dict keys (a `ShardedParam`'s ``.value`` is not one)."""
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _describe(path: tuple, ndim: int | None, api: str) -> _Leaf:
    """Which Hugging Face tensors hold the leaf at ``path`` (``ndim`` dimensions, or None for
    a bare sharding)."""
    keys, where = _keys(path), "params" + jax.tree_util.keystr(path)
    if keys in _TOP:
        name, transposed = _TOP[keys]
        return _Leaf(where, name, 0, transposed)
    if keys[:1] and keys[0] in _STACKED and keys[1:] in _LAYER | _MIXTRAL:
        suffix, transposed = (_LAYER | _MIXTRAL)[keys[1:]]
        if ndim is None and keys[0] != "blocks":
            raise ValueError(
                f"{api}: {where} is a bare Sharding, so its pipeline layout is unknown; give "
                f"a jax.ShapeDtypeStruct(shape, dtype, sharding=...) for the stages' leaves."
            )
        leaf = _Leaf(where, "model.layers.{i}." + suffix, 0, transposed)
        axes = 1 + leaf.experts  # at least: [layers] or [layers, experts]
        lead = axes if ndim is None else ndim - (2 if transposed else 1)
        if lead < axes:
            example = "[layers, experts, d_in, d_out]" if leaf.experts else "[layers, d_in, d_out]"
            raise ValueError(
                f"{api}: {where} has {ndim} dimensions; a block's leaf has leading layer axes "
                f"{'and an expert axis ' * leaf.experts}before its {'2' if transposed else '1'} "
                f"own (e.g. {example})."
            )
        return leaf._replace(lead=lead)
    known = [".".join(k) for k in _TOP] + [f"blocks.{'.'.join(k)}" for k in _LAYER | _MIXTRAL]
    raise ValueError(
        f"{api}: {where} has no Hugging Face Llama or Mixtral tensor; the leaves are "
        f"{', '.join(known)} (or stages.* in a pipeline's layout). Load the other parameters "
        f"another way."
    )


class _Plan(NamedTuple):
    leaf: _Leaf
    names: list[str]  # the Hugging Face tensor at each position of the leading axes, row-major
    shape: tuple[int, ...]  # ours
    dtype: Any
    sharding: jax.sharding.Sharding


def _plan(tensors: dict[str, _Tensor], config: dict, path: tuple, like: Any, dtype: Any) -> _Plan:
    """The leaf at ``path``: its tensors, shape, dtype and sharding, checked against the files."""
    bare = isinstance(like, jax.sharding.Sharding)
    leaf = _describe(path, None if bare else len(like.shape), "hf.load")
    family = _FAMILIES[config["model_type"]].removesuffix("ForCausalLM")
    layers, experts = config["num_hidden_layers"], config.get("num_local_experts")
    if leaf.experts and not experts:
        raise ValueError(
            f"hf.load: {leaf.where} holds experts, but the checkpoint is a {family} (its config "
            f"has no num_local_experts). Make the tree from its config: "
            f"hf.abstract(hf.read_config(directory), ...)."
        )
    counts = (layers, experts) if leaf.experts else (layers,)
    names = leaf.names(*counts)
    if names == ["lm_head.weight"] and "lm_head.weight" not in tensors:
        if config["tie_word_embeddings"]:  # tied: the output matrix is the embedding's transpose
            names = ["model.embed_tokens.weight"]
    for name in names:
        if name not in tensors:
            of = f"{layers} layers" + f" and {experts} experts" * bool(experts)
            raise ValueError(
                f"hf.load: no file of the checkpoint holds {name!r}, which {leaf.where} needs; "
                f"the checkpoint and the tree do not match (is it a {family} checkpoint of "
                f"{of}? Without head.w when tie_word_embeddings). Make the tree from its "
                f"config: hf.abstract(hf.read_config(directory), ...)."
            )
    first = tensors[names[0]]
    own = first.shape[::-1] if leaf.transposed else first.shape
    shape = (*counts, *own) if bare and leaf.lead else own if bare else tuple(like.shape)
    if leaf.lead:
        _check_lead(leaf, shape, counts)
    want = shape[leaf.lead :][::-1] if leaf.transposed else shape[leaf.lead :]
    for name in names:
        t = tensors[name]
        if t.shape != tuple(want) or t.code not in _DTYPES:
            turned = " (our layout, transposed)" if leaf.transposed else ""
            raise ValueError(
                f"hf.load: {t.file}: tensor {name!r} has shape {list(t.shape)} and dtype "
                f"{t.code}, but {leaf.where} of shape {list(shape)} needs shape {list(want)}"
                f"{turned} in one of {', '.join(_DTYPES)}. Make the tree from this checkpoint's "
                f"config: hf.abstract(hf.read_config(directory), ...)."
            )
    sharding = like if bare else getattr(like, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        raise ValueError(
            f"hf.load: {leaf.where} has no sharding; give each leaf of target a Sharding or a "
            f"jax.ShapeDtypeStruct(shape, dtype, sharding=...), e.g. from hf.abstract or "
            f"repl.abstract(lambda: gpt.place(repl, ...))."
        )
    return _Plan(leaf, names, shape, dtype if bare else like.dtype, sharding)


def _check_lead(leaf: _Leaf, shape: tuple[int, ...], counts: tuple[int, ...]) -> None:
    """Refuses a leaf whose leading axes do not hold the checkpoint's ``counts``: its layers
    (any number of axes, row-major), and its experts (the last axis) for an expert leaf."""
    lead = shape[: leaf.lead]
    if leaf.experts and lead[-1] != counts[1]:
        raise ValueError(
            f"hf.load: {leaf.where} has shape {list(shape)}, whose expert axis (axis "
            f"{leaf.lead - 1}) holds {lead[-1]} experts; the checkpoint has "
            f"num_local_experts={counts[1]}. Make the tree from its config: "
            f"hf.abstract(hf.read_config(directory), ...)."
        )
    layer_axes = lead[:-1] if leaf.experts else lead
    if math.prod(layer_axes) != counts[0]:
        raise ValueError(
            f"hf.load: {leaf.where} has shape {list(shape)}, whose leading layer axes "
            f"{list(layer_axes)} hold {math.prod(layer_axes)} layers; the checkpoint has "
            f"{counts[0]}. Make the tree from its config: "
            f"hf.abstract(hf.read_config(directory), ...)."
        )


def _hf_box(plan: _Plan, box: _Box) -> _Box:
    """The block of each of its Hugging Face tensors that our block ``box`` of the leaf holds."""
    inner = box[plan.leaf.lead :]
    return inner[::-1] if plan.leaf.transposed else inner


def _sharing(plan: _Plan, boxes: list[_Box]) -> list[list[_Box]]:
    """``boxes`` in groups that read the same rows of a tensor (a position on the leading axes
    both hold, and rows of its tensor both touch), transitively: a group's rows are read once
    for all of it, and no two groups read the same bytes. Consecutive groups whose rows only
    abut are joined while their blocks fit in `_CHUNK_BYTES` together (a norm's small
    blocks: one read, not one each)."""
    n = plan.leaf.lead
    meets = lambda a, b, touch=False: max(a[0], b[0]) < min(a[1], b[1]) + touch

    def shares(a: _Box, b: _Box, touch: bool = False) -> bool:
        lead = all(meets(x, y) for x, y in zip(a[:n], b[:n], strict=True))
        return lead and meets(_hf_box(plan, a)[0], _hf_box(plan, b)[0], touch)

    groups: list[list[_Box]] = []
    for box in boxes:
        joined = [g for g in groups if any(shares(box, other) for other in g)]
        groups = [g for g in groups if all(g is not j for j in joined)]
        groups.append([b for g in joined for b in g] + [box])
    itemsize = np.dtype(plan.dtype).itemsize
    size = lambda group: sum(math.prod(z - a for a, z in box) for box in group) * itemsize
    out: list[list[_Box]] = []
    for group in groups:
        small = out and size(out[-1]) + size(group) <= _CHUNK_BYTES
        if small and any(shares(a, b, touch=True) for a in out[-1] for b in group):
            out[-1] = out[-1] + group
        else:
            out.append(group)
    return out


def _fill(reader: _Reader, plan: _Plan, blocks: dict[_Box, np.ndarray]) -> None:
    """Fills ``blocks`` (our blocks of the leaf, by box) from the files: of each tensor (a
    position on the leading axes: layer, or layer and expert), the rows the blocks that hold it
    need, read once for all of them and copied into each (transposed, cast)."""
    n, transposed = plan.leaf.lead, plan.leaf.transposed
    full = [box for box in blocks if all(a < z for a, z in box)]
    positions = {p for box in full for p in itertools.product(*(range(*r) for r in box[:n]))}
    for position in sorted(positions):
        here = [box for box in full if all(a <= i < z for i, (a, z) in zip(position, box))]
        name = plan.names[int(np.ravel_multi_index(position, plan.shape[:n])) if n else 0]
        hf_boxes = [_hf_box(plan, box) for box in here]
        for first, rows in reader.rows(name, hf_boxes):
            for box, ((r0, r1), *rest) in zip(here, hf_boxes, strict=True):
                a, z = max(r0, first), min(r1, first + len(rows))
                if a >= z:
                    continue
                part = rows[(slice(a - first, z - first), *(slice(*r) for r in rest))]
                hf_checks.check_finite(part, name, reader.tensors[name].file, ((a, z), *rest))
                into = blocks[box][tuple(i - s for i, (s, _) in zip(position, box))]
                if transposed:  # the tensor's rows are our block's last axis; compact and
                    part = np.ascontiguousarray(part).astype(into.dtype, copy=False)  # cast
                    into[..., a - r0 : z - r0] = part.T  # first: 1.7x faster than at once
                else:
                    into[a - r0 : z - r0] = part


def _build(reader: _Reader, plan: _Plan) -> jax.Array:
    """One global array of the blocks this process's devices hold. The distinct blocks
    (replicas share one) that need the same rows of a tensor are filled together, each row
    read once, put on the devices that hold them and let go before the next group is read:
    the host holds one group at a time (one block, where blocks share no rows), not the leaf,
    in the files' dtype where it is narrower than the leaf's."""
    shape, devices = plan.shape, {}
    for device, index in plan.sharding.addressable_devices_indices_map(shape).items():
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        box = tuple(s.indices(size)[:2] for s, size in zip(index, shape, strict=True))
        devices.setdefault(box, []).append(device)
    files = {reader.tensors[name].dtype for name in plan.names}
    held = files.pop() if len(files) == 1 else np.dtype(plan.dtype)  # a narrower file dtype
    held = held if held.itemsize < np.dtype(plan.dtype).itemsize else np.dtype(plan.dtype)
    arrays = []
    for group in _sharing(plan, list(devices)):
        blocks = {box: np.empty([z - a for a, z in box], held) for box in group}
        _fill(reader, plan, blocks)
        for box in group:  # cast one block at a time (bf16 files widen exactly into fp32)
            block = blocks.pop(box).astype(plan.dtype, copy=False)
            arrays += [jax.device_put(block, device) for device in devices[box]]
            del block
    return jax.make_array_from_single_device_arrays(shape, plan.sharding, arrays)


def load(directory: str | os.PathLike, target: PyTree, *, dtype: Any = jnp.float32) -> PyTree:
    """A Hugging Face Llama or Mixtral checkpoint as global ``jax.Array`` parameters placed as
    ``target``.

    Each leaf is a global array of its device's blocks, read from the ``*.safetensors``
    files (one tensor per layer for the stacked blocks, per layer and expert for a Mixtral's
    experts, transposing Hugging Face's ``[out, in]``). Of each tensor, the rows this
    process's distinct blocks touch are read once, in spans of at most 64 MiB of whole rows
    (from the first byte a block needs to the last), and every block is sliced from them: a
    tensor is a few reads, however its blocks split it (a split of its inner dimension, as
    ZeRO-3 and FSDP give most weights, included). Blocks that share no rows are read, put on
    the devices that hold them (replicas share one read) and let go one at a time; blocks that
    share rows (an inner split) are filled together. The host thus holds, besides what it
    placed, one span and one block (or one leaf's blocks that share rows), and reads each
    byte of the checkpoint at most once, and only of the rows its blocks touch. Values are
    cast to each leaf's dtype after the read (bf16 files load exactly into fp32). With
    several processes, each reads the rows of its own devices' blocks only.

    >>> import pathlib, tempfile, jax, numpy as np
    >>> from replicator.models import hf
    >>> config = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 12, "num_attention_heads": 2, "num_hidden_layers": 2}
    >>> ones = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), hf.shapes(config))
    >>> path = hf.save(pathlib.Path(tempfile.mkdtemp()) / "llama", ones, config)
    >>> mesh = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1])
    >>> shardings = jax.tree.map(lambda s: s.sharding, hf.abstract(hf.read_config(path), mesh))
    >>> params = hf.load(path, shardings)          # bare shardings: shapes from the files
    >>> down = params["blocks"]["mlp"]["down"]     # [layers, F, d]
    >>> down.shape, down.dtype, float(down.sum())
    ((2, 12, 8), dtype('float32'), 192.0)

    On a mesh, ``target`` is the layout training uses, e.g. ``hf.abstract(hf.read_config(path),
    repl, gpt.partition_specs(config=config))`` or ``repl.abstract(lambda: gpt.place(repl,
    gpt.init(config, key), config=config))``.

    Args:
      directory: the checkpoint: ``config.json`` and one or more ``*.safetensors`` files
        (with ``model.safetensors.index.json`` when sharded).
      target: the tree to fill, the module docstring's layout: leaves that are
        ``jax.ShapeDtypeStruct`` (or arrays) with a sharding, as `abstract` or
        ``repl.abstract(lambda: gpt.place(repl, ...))`` gives, or bare
        ``jax.sharding.Sharding`` leaves (shapes then from the files, dtype ``dtype``).
      dtype: the dtype of the leaves given as a bare ``Sharding``.

    Returns:
      ``target``'s tree of ``jax.Array`` leaves with ``target``'s shardings, usable wherever
      ``gpt.place``'s output is.

    Raises:
      ValueError: for a model other than Llama or Mixtral, a leaf with no Hugging Face tensor
        or no sharding, a leaf of another number of layers or experts, a tensor that is
        missing or of another shape, a file that is truncated or not safetensors, or a tensor
        that holds a NaN or an infinity (naming file and tensor).
      FileNotFoundError: if ``directory`` lacks ``config.json`` or ``*.safetensors`` files.
    """
    directory = pathlib.Path(directory)
    config = _config(directory, "hf.load")
    tensors = _tensors(directory)
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_sharding)
    plans = [_plan(tensors, config, path, like, dtype) for path, like in flat]
    reader = _Reader(tensors)
    try:
        leaves = [_build(reader, plan) for plan in plans]
    finally:
        reader.close()
    return jax.tree.unflatten(treedef, leaves)


# -- save ----------------------------------------------------------------------------------------


class _Entry(NamedTuple):
    name: str  # the Hugging Face tensor
    value: Any  # our leaf
    layer: tuple[int, ...]  # its position on the leaf's leading axes (layers, then expert)
    transposed: bool
    dtype: np.dtype  # written as
    shape: tuple[int, ...]  # written as
    where: str  # our leaf, for messages

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _found(params: PyTree, dtype: Any) -> tuple[dict[str, _Entry], int, int, bool]:
    """Every Hugging Face tensor of ``params`` by name, the number of layers and of experts
    (0 without) their leaves hold, and whether they are a Mixtral's (a leaf in ``blocks.moe``)."""
    found: dict[str, _Entry] = {}
    mixtral = False
    layer_counts, expert_counts = set(), {}  # experts: each number -> a leaf that holds it
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape = tuple(np.shape(value))
        leaf = _describe(path, len(shape), "hf.save")
        mixtral |= _keys(path)[1:] in _MIXTRAL
        lead, own = shape[: leaf.lead], shape[leaf.lead :]
        out = jnp.dtype(dtype if dtype is not None else value.dtype)
        if out not in _CODES:
            raise ValueError(
                f"hf.save: {leaf.where} would be written as {out}; pass dtype= one of "
                f"float32, bfloat16, float16, float64."
            )
        layers = math.prod(lead[:-1] if leaf.experts else lead)
        if lead:
            layer_counts.add(layers)
        if leaf.experts or leaf.name.endswith(_ROUTER.removeprefix("model.layers.0")):
            expert_counts.setdefault(lead[-1] if leaf.experts else own[-1], leaf.where)
        for i, name in enumerate(leaf.names(layers, lead[-1] if leaf.experts else 1)):
            layer = tuple(int(j) for j in np.unravel_index(i, lead)) if lead else ()
            own_hf = own[::-1] if leaf.transposed else own
            found[name] = _Entry(name, value, layer, leaf.transposed, out, own_hf, leaf.where)
    if len(layer_counts) > 1:
        raise ValueError(
            f"hf.save: the blocks' leaves hold different numbers of layers "
            f"({sorted(layer_counts)}); every leaf of params['blocks'] stacks the same layers."
        )
    if len(expert_counts) > 1:
        held = ", ".join(f"{where} {n}" for n, where in expert_counts.items())
        raise ValueError(
            f"hf.save: the Mixtral leaves hold different numbers of experts ({held}); the "
            f"router [layers, d, E] and the experts' gate, up and down [layers, E, ...] hold "
            f"the same E."
        )
    layers = layer_counts.pop() if layer_counts else 0
    return found, layers, next(iter(expert_counts), 0), mixtral


def _entries(params: PyTree, dtype: Any) -> list[_Entry]:
    """Every Hugging Face tensor of ``params``, in Hugging Face's order; a Llama's, or a
    Mixtral's if ``params`` have a Mixtral leaf (``blocks.moe``)."""
    found, layers, experts, mixtral = _found(params, dtype)
    if mixtral:
        suffixes = [
            suffix.format(j=j)
            for suffix, _ in _MIXTRAL.values()
            for j in range(experts if "{j}" in suffix else 1)
        ]
    else:
        biases = {  # all of a group's biases or none, as Llama's attention_bias and mlp_bias
            "self_attn": "model.layers.0.self_attn.q_proj.bias" in found,
            "mlp": "model.layers.0.mlp.up_proj.bias" in found,
        }
        suffixes = [
            suffix
            for suffix, _ in _LAYER.values()
            if not suffix.endswith(".bias") or biases[suffix.split(".")[0]]
        ]
    order = ["model.embed_tokens.weight"]
    order += [f"model.layers.{i}.{suffix}" for i in range(layers) for suffix in suffixes]
    order += ["model.norm.weight"] + ["lm_head.weight"] * ("lm_head.weight" in found)
    missing = [name for name in order if name not in found]
    extra = sorted(set(found) - set(order))
    if extra and mixtral:
        raise ValueError(
            f"hf.save: params have {extra[0]}, which a Mixtral does not: its blocks are "
            f"blocks.moe (ln1, attn q/k/v/out, ln2, moe router/gate/up/down), without biases "
            f"or a Llama MLP."
        )
    if extra:
        raise ValueError(
            f"hf.save: params have {extra[0]} but not the q_proj (or up_proj) bias; Llama has "
            f"biases in all of attention's linears (q, k, v, out) or none, and the same for the "
            f"MLP's (gate, up, down)."
        )
    if missing or not layers:
        tree = "blocks.moe (ln1, attn q/k/v/out, ln2, moe router/gate/up/down)" * mixtral
        raise ValueError(
            f"hf.save: params lack the leaves for {', '.join(missing[:4]) or 'the blocks'}"
            f"{' and more' * (len(missing) > 4)}; a {'Mixtral' if mixtral else 'Llama'} tree has "
            f"embed.tokens, {tree or 'blocks (ln1, attn q/k/v/out, ln2, mlp gate/up/down)'} "
            f"and head.norm (module docstring)."
        )
    return [found[name] for name in order]


def _sizes(config: dict, by_name: dict[str, _Entry], mixtral: bool) -> dict:
    """The sizes ``config.json`` gives, from the tensors ``by_name`` (and ``config``'s numbers
    of heads and of experts per token, which they cannot tell), checked against ``config``."""
    v, d = by_name["model.embed_tokens.weight"].shape
    q, k = (by_name[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0] for x in "qk")
    heads = config.get("num_attention_heads")
    if not heads:
        raise ValueError(
            "hf.save: config lacks num_attention_heads, which the shapes cannot tell (they give "
            "heads * head_dim); pass config={'num_attention_heads': ..., ...}."
        )
    head_dim = config.get("head_dim") or q // heads
    mlp = "block_sparse_moe.experts.0.w1" if mixtral else "mlp.up_proj"
    sizes = {
        "vocab_size": v,
        "hidden_size": d,
        "intermediate_size": by_name[f"model.layers.0.{mlp}.weight"].shape[0],
        "num_hidden_layers": sum(
            e.name.endswith("input_layernorm.weight") for e in by_name.values()
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": k // head_dim,
        "head_dim": head_dim,
        "tie_word_embeddings": "lm_head.weight" not in by_name,
    }
    if mixtral:
        sizes |= _expert_sizes(config, by_name)
    wrong = {key: (config[key], value) for key, value in sizes.items() if key in config}
    wrong = {key: pair for key, pair in wrong.items() if pair[0] is not None and pair[0] != pair[1]}
    if q != heads * head_dim or k % head_dim or wrong:
        raise ValueError(
            f"hf.save: config does not match params: q has {q} columns and k {k} for "
            f"num_attention_heads={heads}, head_dim={head_dim}; config (given, from params): "
            f"{wrong}. Pass the config of the model these parameters belong to."
        )
    return sizes


def _expert_sizes(config: dict, by_name: dict[str, _Entry]) -> dict:
    """A Mixtral's ``num_local_experts`` (the params') and ``num_experts_per_tok`` (the
    config's), checked against each other and the config."""
    experts, given = by_name[_ROUTER].shape[0], config.get("num_local_experts")
    if given is not None and given != experts:
        leaf = by_name["model.layers.0.block_sparse_moe.experts.0.w1.weight"].where
        raise ValueError(
            f"hf.save: {leaf} holds {experts} experts (as does {by_name[_ROUTER].where}), but "
            f"config has num_local_experts={given}. Pass the config of the model these "
            f"parameters belong to."
        )
    top_k = config.get("num_experts_per_tok")
    if not top_k or not 0 < top_k <= experts:
        raise ValueError(
            f"hf.save: config has num_experts_per_tok={top_k!r}, which the shapes cannot tell "
            f"(each token's experts, at most the {experts} experts); pass "
            f"config={{'num_experts_per_tok': ..., ...}}, e.g. 2 as Mixtral 8x7B."
        )
    return {"num_local_experts": experts, "num_experts_per_tok": top_k}


def _config_json(config: dict, entries: list[_Entry]) -> dict:
    """The ``config.json`` of ``params``: their family and sizes, and ``config``'s other
    settings."""
    by_name = {e.name: e for e in entries}
    mixtral = _ROUTER in by_name
    kind = "mixtral" if mixtral else "llama"
    if config.get("model_type") not in (None, kind):
        raise ValueError(
            f"hf.save: config has model_type={config['model_type']!r}, but params are a "
            f"{kind.title()}'s tree ({'blocks.moe' if mixtral else 'blocks.mlp'}). Pass the "
            f"config of the model these parameters belong to."
        )
    sizes = _sizes(config, by_name, mixtral)
    dtypes: dict[np.dtype, int] = {}
    for e in entries:  # the dtype of most of the bytes, for a mixed tree
        dtypes[e.dtype] = dtypes.get(e.dtype, 0) + e.nbytes
    kept = {key: value for key, value in config.items() if key not in _DROPPED}
    family = {"architectures": [_FAMILIES[kind]], "model_type": kind, "hidden_act": "silu"}
    if not mixtral:
        family["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in by_name
        family["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in by_name
    torch_dtype = {"torch_dtype": str(max(dtypes, key=dtypes.__getitem__))}
    return (_MIXTRAL_DEFAULTS if mixtral else _DEFAULTS) | kept | sizes | family | torch_dtype


def _take(value: jax.Array, layer: jax.Array, transposed: bool, dtype: Any) -> jax.Array:
    """One layer of a leaf (by traced indices: one compile per leaf), Hugging Face's way up."""
    x = value[tuple(layer[i] for i in range(layer.shape[0]))] if layer.shape[0] else value
    return (x.T if transposed else x).astype(dtype)


_piece = jax.jit(_take, static_argnames=("transposed", "dtype"))


@functools.cache
def _auto_piece(mesh: Any, transposed: bool, dtype: Any) -> Callable:
    """`_piece` for a leaf on a mesh with explicit axes, which it takes as automatic ones."""
    take = functools.partial(_take, transposed=transposed, dtype=dtype)
    return jax.jit(jax.sharding.auto_axes(take, out_sharding=NamedSharding(mesh, P())))


def _local_piece(value: jax.Array, entry: _Entry) -> np.ndarray:
    """``entry``'s tensor from the blocks of a fully addressable ``value``: each distinct block's
    layer sliced on its device and copied into place on the host (no collective)."""
    n = len(entry.layer)
    out = np.empty(entry.shape, entry.dtype)
    done = set()
    for shard in value.addressable_shards:
        index = tuple(shard.index) + (slice(None),) * (value.ndim - len(shard.index))
        box = tuple(s.indices(size)[:2] for s, size in zip(index, value.shape, strict=True))
        if box[n:] in done or any(not a <= i < b for i, (a, b) in zip(entry.layer, box)):
            continue
        done.add(box[n:])
        local = np.asarray([i - a for i, (a, _) in zip(entry.layer, box)], np.int32)
        part = _piece(shard.data, local, transposed=False, dtype=value.dtype) if n else shard.data
        part = np.asarray(part)
        region = box[n:][::-1] if entry.transposed else box[n:]
        out[tuple(slice(a, b) for a, b in region)] = part.T if entry.transposed else part
    return out


def _fetch(entry: _Entry) -> np.ndarray:
    """``entry``'s tensor on this host (gathered from every process's devices)."""
    value = entry.value
    if not isinstance(value, jax.Array):  # a host array: sliced on the host
        x = np.asarray(value)[entry.layer]
        return np.asarray(x.T if entry.transposed else x, dtype=entry.dtype, order="C")
    if value.is_fully_addressable:
        return _local_piece(value, entry)
    layer = np.asarray(entry.layer, np.int32)
    mesh = getattr(value.sharding, "mesh", None)
    if mesh is not None and jax.sharding.AxisType.Explicit in mesh.axis_types:
        with jax.set_mesh(mesh):
            x = _auto_piece(mesh, entry.transposed, entry.dtype)(value, layer)
    else:
        x = _piece(value, layer, transposed=entry.transposed, dtype=entry.dtype)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _shards(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    """``entries`` in files of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    files: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


def _write(path: pathlib.Path | None, entries: list[_Entry]) -> None:
    """One safetensors file of ``entries``, each gathered just before it is written; every
    process gathers (the gathers are collective), the one given a ``path`` writes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for e in entries:
        header[e.name] = {
            "dtype": _CODES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [start, start + e.nbytes],
        }
        start += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") if path is not None else contextlib.nullcontext() as f:
        if f is not None:
            f.write(struct.pack("<Q", len(text)) + text)
        for e in entries:
            data = np.ascontiguousarray(_fetch(e))
            if f is not None:
                f.write(memoryview(data.view(np.uint8).reshape(-1)))
        if f is not None:
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes the checkpoint visible


def _check_free(directory: pathlib.Path, overwrite: bool) -> None:
    """Refuses a non-empty ``directory`` without ``overwrite``: process 0 looks, and every
    process raises (before any of them starts a collective gather)."""
    free = overwrite or not (directory.exists() and any(directory.iterdir()))
    if jax.process_count() > 1:
        free = bool(multihost_utils.broadcast_one_to_all(np.asarray(free)))
    if not free:
        raise FileExistsError(
            f"hf.save: {directory} exists and is not empty; pass overwrite=True to replace it, "
            f"or choose a new directory."
        )


def _swap(tmp: pathlib.Path, directory: pathlib.Path) -> None:
    """Makes the written ``tmp`` ``directory`` in one rename (an old one, which `_check_free`
    let through, moved aside first and deleted after)."""
    if not (directory.exists() and any(directory.iterdir())):
        os.replace(tmp, directory)  # onto nothing, or an empty directory
        return
    old = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(directory, old)
    os.rename(tmp, directory)
    shutil.rmtree(old)


def save(
    directory: str | os.PathLike,
    params: PyTree,
    config: dict,
    *,
    dtype: Any = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
) -> pathlib.Path:
    """Writes ``params`` as a Hugging Face Llama checkpoint that
    ``transformers.LlamaForCausalLM.from_pretrained(directory)`` loads, or as a Mixtral's
    (``MixtralForCausalLM``, one tensor per expert) when they are a Mixtral's tree
    (``blocks.moe``).

    The directory gets ``config.json`` and ``model.safetensors`` (or, past ``max_shard_bytes``,
    ``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``). One tensor
    at a time is gathered to the host (a layer, or a layer's expert, of a stacked leaf,
    transposed to ``[out, in]`` and cast on the devices), so the host holds one tensor, not the
    model. Every process must call this (the gathers are collective); process 0 writes, into a
    temporary directory that one rename makes ``directory``, so a reader never sees half a
    checkpoint.

    >>> import pathlib, tempfile, numpy as np, jax
    >>> from replicator.models import hf
    >>> config = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
    ...     "intermediate_size": 12, "num_attention_heads": 2, "num_hidden_layers": 2,
    ...     "rope_theta": 500000.0}
    >>> params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), hf.shapes(config))
    >>> out = hf.save(pathlib.Path(tempfile.mkdtemp()) / "llama", params, config,
    ...     dtype="bfloat16")
    >>> saved = hf.read_config(out)
    >>> saved["torch_dtype"], saved["rope_theta"], saved["num_key_value_heads"]
    ('bfloat16', 500000.0, 2)

    Args:
      directory: where to write; it must not exist or be empty, unless ``overwrite``.
      params: the tree of the module docstring (placed arrays, host arrays, ZeRO-3
        `ShardedParam` leaves, or a pipeline's ``stages``).
      config: the model's settings as ``config.json`` keys: ``num_attention_heads`` at least,
        and ``num_experts_per_tok`` for a Mixtral (``rms_norm_eps``, ``rope_theta``,
        ``rope_scaling``, ``max_position_embeddings``, token ids... are written as given, else
        the family's defaults); sizes it gives (``num_local_experts`` too) must match
        ``params``', and a ``model_type`` it gives their family.
      dtype: write every tensor in this dtype (e.g. ``"bfloat16"``); default: each leaf's.
      max_shard_bytes: the largest file; Hugging Face's default is 5 GiB.
      overwrite: replace a non-empty ``directory``.

    Returns:
      ``directory``, as a ``pathlib.Path``.

    Raises:
      ValueError: if ``params`` lack a Llama (or Mixtral) leaf, have one that is not, hold
        different numbers of layers or experts, or disagree with ``config``.
      FileExistsError: if ``directory`` is not empty and not ``overwrite``.
    """
    directory = pathlib.Path(directory)
    entries = _entries(params, dtype)
    text = json.dumps(_config_json(dict(config), entries), indent=2)
    files = _shards(entries, max_shard_bytes)
    names = ["model.safetensors"] if len(files) == 1 else []
    names = names or [
        f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))
    ]
    writing = jax.process_index() == 0
    tmp = directory.with_name(f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}")
    _check_free(directory, overwrite)  # before any work
    if writing:
        tmp.mkdir(parents=True)
    try:
        for name, group in zip(names, files, strict=True):
            _write(tmp / name if writing else None, group)
        if writing:
            (tmp / "config.json").write_text(text + "\n")
            if len(files) > 1:
                _write_index(tmp, names, files)
            _swap(tmp, directory)
    finally:
        if writing and tmp.exists():
            shutil.rmtree(tmp)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("replicator.models.hf.save")
    return directory


def _write_index(tmp: pathlib.Path, names: list[str], files: list[list[_Entry]]) -> None:
    index = {
        "metadata": {"total_size": sum(e.nbytes for group in files for e in group)},
        "weight_map": {e.name: name for name, group in zip(names, files) for e in group},
    }
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
