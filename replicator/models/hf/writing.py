"""`save`: a tree written as a Hugging Face checkpoint that transformers' ``from_pretrained``
reads, one tensor at a time gathered to the host (`replicator.models.hf.entries` says which)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import shutil
import struct
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.models.hf import entries as entries_lib
from replicator.models.hf import files
from replicator.models.hf.entries import Entry

PyTree = Any


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


def _local_piece(value: jax.Array, entry: Entry) -> np.ndarray:
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


def _fetch(entry: Entry) -> np.ndarray:
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


def _shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """``entries`` in files of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


def _write(path: pathlib.Path | None, entries: list[Entry]) -> None:
    """One safetensors file of ``entries``, each gathered just before it is written; every
    process gathers (the gathers are collective), the one given a ``path`` writes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for e in entries:
        header[e.name] = {
            "dtype": files.CODES[e.dtype],
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
    """Writes ``params`` as a Hugging Face checkpoint that transformers loads.

    A Llama's checkpoint is what ``transformers.LlamaForCausalLM.from_pretrained(directory)``
    loads; a Mixtral's (``MixtralForCausalLM``, one tensor per expert) is written when
    ``params`` are a Mixtral's tree (``blocks.moe``), and a Qwen2's (``Qwen2ForCausalLM``)
    when ``config`` says ``"model_type": "qwen2"`` or the tree has biases on ``q``, ``k`` and
    ``v`` only.

    The directory gets ``config.json`` and ``model.safetensors`` (or, past ``max_shard_bytes``,
    ``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``). One tensor
    at a time is gathered to the host (a layer, or a layer's expert, of a stacked leaf,
    transposed to ``[out, in]`` and cast on the devices), so the host holds one tensor, not the
    model. Every process must call this (the gathers are collective); process 0 writes, into a
    temporary directory that one rename makes ``directory``, so a reader never sees half a
    checkpoint.

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
      ValueError: if ``params`` lack a leaf of their family, have one that is not, hold
        different numbers of layers or experts, or disagree with ``config``.
      FileExistsError: if ``directory`` is not empty and not ``overwrite``.

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
    """
    directory = pathlib.Path(directory)
    chosen, entries = entries_lib.entries(params, dtype, dict(config))
    text = json.dumps(entries_lib.config_json(dict(config), chosen, entries), indent=2)
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


def _write_index(tmp: pathlib.Path, names: list[str], files: list[list[Entry]]) -> None:
    index = {
        "metadata": {"total_size": sum(e.nbytes for group in files for e in group)},
        "weight_map": {e.name: name for name, group in zip(names, files) for e in group},
    }
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
