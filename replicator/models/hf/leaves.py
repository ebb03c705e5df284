"""Our parameter tree against Hugging Face's names: which tensor (one per layer, or per layer
and expert) each leaf holds, for every family (`replicator.models.families`)."""

from __future__ import annotations

from typing import NamedTuple

import jax

from replicator.models.families import FAMILIES
from replicator.models.families.family import OUTER_NAMES

STACKED = ("blocks", "stages")  # the blocks' leaves: layers stacked, or a pipeline's stages
TOP = OUTER_NAMES  # our leaves outside the blocks: the tensor, and whether transposed
LAYER = {k: v for f in FAMILIES.values() for k, v in f.layer_names.items()}  # in a block


class Leaf(NamedTuple):
    """A leaf of ours and the Hugging Face tensors it holds."""

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


def dict_keys(path: tuple) -> tuple[str, ...]:
    """A leaf's dict keys (a `ShardedParam`'s ``.value`` is not one)."""
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def describe(path: tuple, ndim: int | None, api: str) -> Leaf:
    """Which Hugging Face tensors hold the leaf at ``path`` (``ndim`` dimensions, or None for
    a bare sharding)."""
    keys, where = dict_keys(path), "params" + jax.tree_util.keystr(path)
    if keys in TOP:
        name, transposed = TOP[keys]
        return Leaf(where, name, 0, transposed)
    if keys[:1] and keys[0] in STACKED and keys[1:] in LAYER:
        suffix, transposed = LAYER[keys[1:]]
        if ndim is None and keys[0] != "blocks":
            raise ValueError(
                f"{api}: {where} is a bare Sharding, so its pipeline layout is unknown; give "
                f"a jax.ShapeDtypeStruct(shape, dtype, sharding=...) for the stages' leaves."
            )
        leaf = Leaf(where, "model.layers.{i}." + suffix, 0, transposed)
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
    known = [".".join(k) for k in TOP] + [f"blocks.{'.'.join(k)}" for k in LAYER]
    raise ValueError(
        f"{api}: {where} has no Hugging Face tensor; the leaves are "
        f"{', '.join(known)} (or stages.* in a pipeline's layout). Load the other parameters "
        f"another way."
    )
