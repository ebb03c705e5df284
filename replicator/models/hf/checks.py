"""Checks of what `replicator.models.hf` reads: ``config.json``'s values, the ``*.safetensors``
headers, ``model.safetensors.index.json``, the weights against ``config.json``, and the values
of each tensor as it is read. Each refusal is one line (a ``ValueError``) that names the file,
the key or the tensor, what is wrong and what to do.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import struct
from typing import Any

import ml_dtypes
import numpy as np

from replicator.models import families
from replicator.models.families import FAMILIES, Family
from replicator.models.hf import config_checks
from replicator.models.hf.config_checks import json_kind

# bytes per element of every dtype safetensors defines (hf reads the float ones)
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
HEADER_LIMIT = 100 * 2**20  # safetensors' own bound on a header
AGAIN = "download the checkpoint again (or save it again: save_pretrained or hf.save)"


def read_json(path: pathlib.Path, api: str, fix: str) -> Any:
    """The JSON value in ``path``; a file that is empty, not UTF-8 or not JSON is refused in
    one line naming it, with ``fix``."""
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        problem = f"is not UTF-8 text (byte {e.start} is {data[e.start]:#04x})"
    except json.JSONDecodeError as e:
        problem = f"is not JSON ({e.msg}: line {e.lineno} column {e.colno})"
    if not data.strip():
        problem = "is empty" if not data else "holds only whitespace"
    raise ValueError(f"{api}: {path} {problem}; {fix}.")


# -- config.json ---------------------------------------------------------------------------------


def check_config(config: dict, where: str, required: tuple[str, ...]) -> None:
    """`config_checks.check_config` with transformers' defaults for the examples."""
    config_checks.check_config(config, where, required, families.defaults())


# -- the safetensors files -----------------------------------------------------------------------


def read_header(path: pathlib.Path, api: str) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """The tensors of a ``.safetensors`` file by name: ``(dtype code, shape, offset of its first
    byte in the file)``, checked to be a header that lies within the file and whose tensors'
    bytes do too (a truncated file is refused here, before anything is read)."""
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 8:
            raise ValueError(
                f"{api}: {path} is {size} bytes long, too short for a safetensors file (8 bytes "
                f"of header length, then the header); it is truncated: {AGAIN}."
            )
        length = struct.unpack("<Q", f.read(8))[0]
        if length > min(size - 8, HEADER_LIMIT):
            held = f"the file holds {size - 8} bytes after that length"
            held = held if length > size - 8 else "safetensors' limit is 100 MiB"
            raise ValueError(
                f"{api}: {path} says its header is {length} bytes long, but {held}; it is "
                f"truncated or not a safetensors file: {AGAIN}."
            )
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{api}: {path}'s header is not JSON ({str(e).splitlines()[0]}); the file is "
            f"corrupt or not a safetensors file: {AGAIN}."
        ) from None
    if not isinstance(header, dict):
        raise ValueError(
            f"{api}: {path}'s header is {json_kind(header) or 'a number'}, not an object of "
            f"tensors; the file is corrupt or not a safetensors file: {AGAIN}."
        )
    data = size - 8 - length
    return {
        name: _entry(path, name, info, (data, 8 + length), api)
        for name, info in header.items()
        if name != "__metadata__"
    }


def _entry(path: pathlib.Path, name: str, info: Any, extent: tuple[int, int], api: str) -> tuple:
    """One tensor of a header: ``(code, shape, offset)``, its entry checked to lie within the
    file's ``extent`` (its data's length, and where its data starts)."""
    data, start = extent
    info = info if isinstance(info, dict) else {}
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    whole = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0
    well_formed = isinstance(code, str) and isinstance(shape, list) and isinstance(offsets, list)
    well_formed = well_formed and all(map(whole, shape)) and len(offsets) == 2
    if not (well_formed and all(map(whole, offsets)) and offsets[0] <= offsets[1]):
        raise ValueError(
            f"{api}: {path}: tensor {name!r} has the header entry {info!r}, not "
            f'{{"dtype": ..., "shape": [...], "data_offsets": [start, end]}}; the file is '
            f"corrupt: {AGAIN}."
        )
    begin, end = offsets
    if code in ITEMSIZE and end - begin != math.prod(shape) * ITEMSIZE[code]:
        raise ValueError(
            f"{api}: {path}: tensor {name!r} of shape {shape} and dtype {code} is "
            f"{math.prod(shape) * ITEMSIZE[code]} bytes, but its data_offsets span {end - begin}; "
            f"the file is corrupt: {AGAIN}."
        )
    if end > data:
        raise ValueError(
            f"{api}: {path} is truncated: tensor {name!r} ends at byte {start + end}, "
            f"but the file has {start + data} bytes (an interrupted download or copy?); "
            f"{AGAIN}."
        )
    return code, tuple(shape), start + begin


def read_index(index: pathlib.Path, api: str) -> dict[str, str]:
    """``model.safetensors.index.json``'s ``weight_map`` (tensor -> file), checked to be one
    and to name files in the index's directory that exist."""
    fix = (
        f"repair it, or delete it (hf reads every *.safetensors file of {index.parent} then), "
        f"or {AGAIN}"
    )
    found = read_json(index, api, fix)
    weights = found.get("weight_map") if isinstance(found, dict) else None
    names = isinstance(weights, dict) and all(isinstance(v, str) for v in weights.values())
    if not names:
        raise ValueError(
            f"{api}: {index} has no weight_map (an object from each tensor's name to the file "
            f"that holds it, as save_pretrained writes); {fix}."
        )
    for file in sorted(set(weights.values())):
        if pathlib.PurePath(file).name != file or file in ("", ".", ".."):
            raise ValueError(
                f"{api}: {index} names the file {file!r}; a shard is a file name in the "
                f"index's own directory (e.g. 'model-00001-of-00002.safetensors'): {fix}."
            )
        if not (index.parent / file).is_file():
            held = sorted(name for name, f in weights.items() if f == file)
            raise ValueError(
                f"{api}: {index} names {file} (for {len(held)} tensors, e.g. {held[0]!r}), "
                f"which is not in {index.parent}; the download is incomplete: download "
                f"{file} too, or {AGAIN}."
            )
    return weights


def check_index(weights: dict[str, str], found: dict[str, Any], index: pathlib.Path, api: str):
    """Refuses an index that says a tensor is in a file whose header does not hold it."""
    for name, file in weights.items():
        held = found.get(name)
        if held is None or held.file.name != file:
            where = f"it is in {held.file.name}" if held is not None else "no file holds it"
            raise ValueError(
                f"{api}: {index} says tensor {name!r} is in {file}, but {where}; the index "
                f"and the files are of different checkpoints: {AGAIN}."
            )


def duplicate(name: str, first: pathlib.Path, second: pathlib.Path, api: str) -> ValueError:
    return ValueError(
        f"{api}: tensor {name!r} is in both {first} and {second}; a checkpoint holds each "
        f"tensor once: remove the file that is not part of it (e.g. an older download), or "
        f"{AGAIN}."
    )


_EXPONENTS = {  # a float's exponent bits, all set in a NaN or an infinity only
    np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80),
    np.dtype(np.float16): (np.uint16, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x7F800000),
    np.dtype(np.float64): (np.uint64, 0x7FF0000000000000),
}


def check_finite(values: np.ndarray, name: str, path: pathlib.Path, box: tuple) -> None:
    """Refuses a block of tensor ``name`` (read from ``path``, its ``box``) that holds a NaN
    or an infinity, naming the first one: training from it would fail at its first step."""
    if values.dtype in _EXPONENTS:  # the bits first: several times faster than np.isfinite
        kind, mask = _EXPONENTS[values.dtype]
        if not ((values.view(kind) & kind(mask)) == mask).any():
            return
    bad = ~np.isfinite(values)
    if not bad.any():
        return
    at = np.argwhere(bad)[0]
    first = [int(i) + start for i, (start, _) in zip(at, box)]
    more = int(bad.sum()) - 1
    raise ValueError(
        f"hf.load: {path}: tensor {name!r} holds {values[tuple(at)]} at {first}"
        f"{f' and {more} more non-finite values' if more else ''}; the checkpoint is corrupt "
        f"or was saved from a diverged run: start from one whose weights are all finite (an "
        f"earlier checkpoint, or a fresh download)."
    )


# -- the weights against config.json -------------------------------------------------------------

_WEIGHT_DIMS = {  # each Hugging Face weight's dimensions, in config.json's sizes
    "input_layernorm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
    "pre_feedforward_layernorm.weight": ("hidden_size",),  # Gemma's four norms a block
    "post_feedforward_layernorm.weight": ("hidden_size",),
    "q_norm.weight": ("head_dim",),  # each head's query and key norms
    "k_norm.weight": ("head_dim",),
    "q_proj.weight": ("num_attention_heads*head_dim", "hidden_size"),
    "k_proj.weight": ("num_key_value_heads*head_dim", "hidden_size"),
    "v_proj.weight": ("num_key_value_heads*head_dim", "hidden_size"),
    "o_proj.weight": ("hidden_size", "num_attention_heads*head_dim"),
    "gate_proj.weight": ("intermediate_size", "hidden_size"),
    "up_proj.weight": ("intermediate_size", "hidden_size"),
    "down_proj.weight": ("hidden_size", "intermediate_size"),
    "gate.weight": ("num_local_experts", "hidden_size"),
    "w1.weight": ("intermediate_size", "hidden_size"),
    "w3.weight": ("intermediate_size", "hidden_size"),
    "w2.weight": ("hidden_size", "intermediate_size"),
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "norm.weight": ("hidden_size",),
    "lm_head.weight": ("vocab_size", "hidden_size"),
}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer older transformers saved


def _dims(name: str, family: Any) -> tuple[str, ...]:
    """``name``'s dimensions in ``family``'s ``config.json`` keys."""
    tail = ".".join(name.split(".")[-2:])
    if tail.endswith(".bias"):  # a linear's bias: its weight's output dimension
        dims = _WEIGHT_DIMS[tail.removesuffix("bias") + "weight"][:1]
    else:
        dims = _WEIGHT_DIMS[tail]
    return tuple("*".join(map(family.size_key, d.split("*"))) for d in dims)


def expected(config: dict) -> list[str]:
    """The Hugging Face tensors of the model ``config`` (a checked ``config.json``) describes,
    as its family (``model_type``) names them."""
    found = FAMILIES[config["model_type"]]
    outer = found.outer_names.items()
    tied = config["tie_word_embeddings"]  # then no head.w
    top = [name for keys, (name, _) in outer if not tied or keys != ("head", "w")]
    experts = range(found.experts_in(config) or 1)
    layer = [
        name.format(j=j)
        for name, _ in found.block_names(found.biases(config)).values()
        for j in (experts if "{j}" in name else range(1))
    ]
    layers = range(config["num_hidden_layers"])
    return top[:1] + [f"model.layers.{i}.{n}" for i in layers for n in layer] + top[1:]


def check_weights(
    config: dict, tensors: dict, readable: tuple[str, ...], api: str, directory: pathlib.Path
) -> None:
    """Refuses weights (``tensors``: name -> an object with ``file``, ``code`` and ``shape``)
    that are not the model ``config`` describes: a tensor missing or left over, or of another
    shape or of a dtype hf does not read; the message names the tensor and the key to fix."""
    want = expected(config)
    left = {"lm_head.weight"} if config["tie_word_embeddings"] else set()  # tied: unused
    missing = [name for name in want if name not in tensors]
    extra = sorted(set(tensors) - set(want) - left)
    extra = [name for name in extra if not _IGNORED.search(name)]
    if missing or extra:
        held = [f"no file holds {missing[0]!r}" + f" (nor {len(missing) - 1} more)" * (
            len(missing) > 1)] if missing else []  # fmt: skip
        if extra:
            more = f" (and {len(extra) - 1} more)" * (len(extra) > 1)
            held.append(f"the files hold {extra[0]!r}{more}, which it has not")
        raise ValueError(
            f"{api}: {directory / 'config.json'} does not describe the weights beside it: "
            f"{'; '.join(held)}; "
            f"{_names_fix(config, missing, extra, tensors)}."
        )
    for name in want:
        t = tensors[name]
        dims = _dims(name, FAMILIES[config["model_type"]])
        sizes = [math.prod(config[k] for k in d.split("*")) for d in dims]
        if list(t.shape) != sizes:
            keys = dict.fromkeys(k for d in dims for k in d.split("*"))
            given = ", ".join(f"{k}={config[k]}" for k in keys)
            raise ValueError(
                f"{api}: {t.file}: tensor {name!r} has shape {list(t.shape)}, but config.json's "
                f"{given} give {sizes}; {_shape_fix(config, dims, t.shape, sizes)}."
            )
        if t.code not in readable:
            raise ValueError(
                f"{api}: {t.file}: tensor {name!r} is stored as {t.code}, which hf does not "
                f"read (it reads {', '.join(readable)}); convert the checkpoint, e.g. load it "
                f"with transformers and save_pretrained it with torch_dtype=torch.bfloat16."
            )


def _shape_fix(config: dict, dims: tuple[str, ...], shape: tuple, sizes: list[int]) -> str:
    """What to change in config.json for a tensor of ``shape`` where it gives ``sizes``."""
    if len(shape) == 2 and list(shape[::-1]) == sizes:
        return (
            "the tensor is stored transposed ([in, out]; Hugging Face stores [out, in]): "
            "save the model with save_pretrained or hf.save"
        )
    if len(shape) != len(sizes):
        return f"use the config.json saved with these weights, or {AGAIN}"
    dim, have = next((d, h) for d, h, w in zip(dims, shape, sizes, strict=True) if h != w)
    heads, _, per = dim.partition("*")
    if not per:
        return f"set {dim} to {have} in config.json, as the weights were saved with"
    width = config["hidden_size"] // config["num_attention_heads"]
    if heads == "num_attention_heads" and have % config[heads] == 0:
        head_dim = have // config[heads]
        remove = " (or remove head_dim: hidden_size / num_attention_heads)" * (head_dim == width)
        return f"set head_dim to {head_dim}{remove} in config.json, as the weights were saved with"
    if have % config[per] == 0:
        return (
            f"set {heads} to {have // config[per]} in config.json, as the weights were saved with"
        )
    return f"use the config.json saved with these weights ({heads} x {per} = {have})"


def _numbers(pattern: str, names: list[str] | dict) -> set[int]:
    return {int(m.group(1)) for name in names if (m := re.search(pattern, name))}


def _names_fix(config: dict, missing: list[str], extra: list[str], tensors: dict) -> str:
    """What to change in config.json for weights with ``missing`` and ``extra`` tensors."""
    again = f"use the config.json saved with these weights, or {AGAIN}"
    other = _other_kind(FAMILIES[config["model_type"]], extra)
    if other is not None and other.experts:
        return f'they are a {other.name}\'s: set "model_type": "{other.model_type}" in config.json'
    if other is not None:
        return (
            f"they are a {other.name}'s (an MLP per layer, no experts): set "
            f'"model_type": "{other.model_type}"'
        )
    experts_key = FAMILIES[config["model_type"]].experts_key
    for key, pattern in (("num_hidden_layers", r"^model\.layers\.(\d+)\."), (
            experts_key, r"\.experts\.(\d+)\.")):  # fmt: skip
        held = _numbers(pattern, tensors)
        if held and key in config and max(held) + 1 != config[key]:
            what = key.split("_")[-1]
            return f"the files hold {what} 0 to {max(held)}: set {key} to {max(held) + 1}"
    attn = {n.rsplit(".", 2)[-2] for n in tensors if ".self_attn." in n and n.endswith(".bias")}
    if attn == {"q_proj", "k_proj", "v_proj"} and config["model_type"] != "qwen2":
        # biases on the query, key and value projections only: Qwen2's (a Llama's
        # attention_bias puts one on the output projection too)
        return 'they are a Qwen2\'s (biases on q, k and v only): set "model_type": "qwen2"'
    for group, key in (("self_attn", "attention_bias"), ("mlp", "mlp_bias")):
        biases = [n for n in tensors if f".{group}." in n and n.endswith("_proj.bias")]
        if biases and any(n in extra for n in biases):
            return f'the files hold {group} biases: set "{key}": true in config.json'
        if config.get(key) and not biases:
            return f'the files hold no {group} biases: set "{key}": false in config.json'
    if missing == ["lm_head.weight"]:
        return (
            'set "tie_word_embeddings": true in config.json if the model ties its output '
            f"matrix to the token table; else {AGAIN}"
        )
    return again


def _other_kind(family: Family, extra: list[str]) -> Family | None:
    """The first family (in `FAMILIES`' order) with experts where ``family`` has none, or
    none where it has, that names a tensor of ``extra`` (a layer's, in any layer, of any
    expert) which ``family`` does not name; None if there is none."""
    own = {name for name, _ in family.layer_names.values()}
    for other in FAMILIES.values():
        if other.experts == family.experts:
            continue
        patterns = [
            re.escape(name).replace(re.escape("{j}"), r"\d+")
            for name, _ in other.layer_names.values()
            if name not in own
        ]
        layer = re.compile(rf"model\.layers\.\d+\.(?:{'|'.join(patterns)})")
        if any(layer.fullmatch(name) for name in extra):
            return other
    return None
