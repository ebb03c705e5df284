"""`load`: a checkpoint's tensors as global arrays, each device's blocks read from the files
(`replicator.models.hf.files`) and placed, one group of blocks at a time."""

from __future__ import annotations

import itertools
import math
import os
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from replicator.models.families import FAMILIES
from replicator.models.hf import checks, configs, files
from replicator.models.hf.files import Box, Reader
from replicator.models.hf.leaves import Leaf, describe, outline

PyTree = Any


class _Plan(NamedTuple):
    leaf: Leaf
    names: list[str]  # the Hugging Face tensor at each position of the leading axes, row-major
    shape: tuple[int, ...]  # ours
    dtype: Any
    sharding: jax.sharding.Sharding


def _plan(
    tensors: dict[str, files.Tensor], config: dict, path: tuple, like: Any, dtype: Any
) -> _Plan:
    """The leaf at ``path``: its tensors, shape, dtype and sharding, checked against the files."""
    bare = isinstance(like, jax.sharding.Sharding)
    ndim = None if bare else len(like.shape)
    leaf = describe(path, ndim, "hf.load", FAMILIES[config["model_type"]], foreign=True)
    family = FAMILIES[config["model_type"]].name
    layers, experts = config["num_hidden_layers"], FAMILIES[config["model_type"]].experts_in(config)
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
        if t.shape != tuple(want) or t.code not in files.DTYPES:
            turned = " (our layout, transposed)" if leaf.transposed else ""
            raise ValueError(
                f"hf.load: {t.file}: tensor {name!r} has shape {list(t.shape)} and dtype "
                f"{t.code}, but {leaf.where} of shape {list(shape)} needs shape {list(want)}"
                f"{turned} in one of {', '.join(files.DTYPES)}. Make the tree from this "
                f"checkpoint's config: hf.abstract(hf.read_config(directory), ...)."
            )
    sharding = like if bare else getattr(like, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        raise ValueError(
            f"hf.load: {leaf.where} has no sharding; give each leaf of target a Sharding or a "
            f"jax.ShapeDtypeStruct(shape, dtype, sharding=...), e.g. from hf.abstract or "
            f"repl.abstract(lambda: gpt.place(repl, ...))."
        )
    return _Plan(leaf, names, shape, dtype if bare else like.dtype, sharding)


def _check_lead(leaf: Leaf, shape: tuple[int, ...], counts: tuple[int, ...]) -> None:
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


def _check_own(leaves: list[Leaf], config: dict) -> None:
    """Refuses the leaves that are not of the checkpoint's family (those `_plan` let through,
    named as another family names them, to say first what else does not match)."""
    foreign = [leaf.where for leaf in leaves if not leaf.own]
    if foreign:
        family = FAMILIES[config["model_type"]]
        more = f" (and {len(foreign) - 1} more)" * (len(foreign) > 1)
        raise ValueError(
            f"hf.load: {foreign[0]}{more} is not a leaf of a {family.name}'s tree, and the "
            f"checkpoint is a {family.name} (model_type={family.model_type!r}); its blocks are "
            f"{outline(family)}. Make the tree from its config: "
            f"hf.abstract(hf.read_config(directory), ...)."
        )


def _hf_box(plan: _Plan, box: Box) -> Box:
    """The block of each of its Hugging Face tensors that our block ``box`` of the leaf holds."""
    inner = box[plan.leaf.lead :]
    return inner[::-1] if plan.leaf.transposed else inner


def _sharing(plan: _Plan, boxes: list[Box]) -> list[list[Box]]:
    """``boxes`` in groups that read the same rows of a tensor (a position on the leading axes
    both hold, and rows of its tensor both touch), transitively: a group's rows are read once
    for all of it, and no two groups read the same bytes. Consecutive groups whose rows only
    abut are joined while their blocks fit in `files.CHUNK_BYTES` together (a norm's small
    blocks: one read, not one each)."""
    n = plan.leaf.lead
    meets = lambda a, b, touch=False: max(a[0], b[0]) < min(a[1], b[1]) + touch

    def shares(a: Box, b: Box, touch: bool = False) -> bool:
        lead = all(meets(x, y) for x, y in zip(a[:n], b[:n], strict=True))
        return lead and meets(_hf_box(plan, a)[0], _hf_box(plan, b)[0], touch)

    groups: list[list[Box]] = []
    for box in boxes:
        joined = [g for g in groups if any(shares(box, other) for other in g)]
        groups = [g for g in groups if all(g is not j for j in joined)]
        groups.append([b for g in joined for b in g] + [box])
    itemsize = np.dtype(plan.dtype).itemsize
    size = lambda group: sum(math.prod(z - a for a, z in box) for box in group) * itemsize
    out: list[list[Box]] = []
    for group in groups:
        small = out and size(out[-1]) + size(group) <= files.CHUNK_BYTES
        if small and any(shares(a, b, touch=True) for a in out[-1] for b in group):
            out[-1] = out[-1] + group
        else:
            out.append(group)
    return out


def _fill(reader: Reader, plan: _Plan, blocks: dict[Box, np.ndarray]) -> None:
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
                checks.check_finite(part, name, reader.tensors[name].file, ((a, z), *rest))
                into = blocks[box][tuple(i - s for i, (s, _) in zip(position, box))]
                if transposed:  # the tensor's rows are our block's last axis; compact and
                    part = np.ascontiguousarray(part).astype(into.dtype, copy=False)  # cast
                    into[..., a - r0 : z - r0] = part.T  # first: 1.7x faster than at once
                else:
                    into[a - r0 : z - r0] = part


def _build(reader: Reader, plan: _Plan) -> jax.Array:
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
    dtypes = {reader.tensors[name].dtype for name in plan.names}
    held = dtypes.pop() if len(dtypes) == 1 else np.dtype(plan.dtype)  # a narrower file dtype
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
    """A Hugging Face checkpoint of a family (`replicator.models.families`), placed as ``target``.

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
      ValueError: for a model of no family (`replicator.models.families`), a leaf with no
        Hugging Face tensor or no sharding, a leaf of another number of layers or experts, a
        tensor that is missing or of another shape, a file that is truncated or not
        safetensors, or a tensor that holds a NaN or an infinity (naming file and tensor).
      FileNotFoundError: if ``directory`` lacks ``config.json`` or ``*.safetensors`` files.

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
    """
    directory = pathlib.Path(directory)
    config = configs.config_file(directory, "hf.load")
    tensors = files.tensors(directory)
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_sharding)
    plans = [_plan(tensors, config, path, like, dtype) for path, like in flat]
    _check_own([plan.leaf for plan in plans], config)
    reader = Reader(tensors)
    try:
        leaves = [_build(reader, plan) for plan in plans]
    finally:
        reader.close()
    return jax.tree.unflatten(treedef, leaves)


# -- save ----------------------------------------------------------------------------------------
