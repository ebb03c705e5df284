"""Our parameter tree against Hugging Face's names: which tensor (one per layer, or per layer
and expert) each leaf holds, in one family's checkpoint (`replicator.models.families`: its
`Family` record's ``outer_names`` and ``layer_names``)."""

from __future__ import annotations

from typing import NamedTuple

import jax

from replicator.models.families import FAMILIES, Family

STACKED = ("blocks", "stages")  # the blocks' leaves: layers stacked, or a pipeline's stages


class Leaf(NamedTuple):
    """A leaf of ours and the Hugging Face tensors it holds."""

    where: str  # "params['blocks']['attn']['q']", for messages
    name: str  # the Hugging Face tensor; with "{i}" for the layer in the blocks, "{j}" the expert
    lead: int  # the number of leading axes: the layers', then the expert's (0 outside the blocks)
    transposed: bool
    own: bool = True  # False: not the family's leaf, named as another family names it (refused)

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


def describe(
    path: tuple, ndim: int | None, api: str, family: Family, *, foreign: bool = False
) -> Leaf:
    """Which of ``family``'s Hugging Face tensors hold the leaf at ``path`` (``ndim``
    dimensions, or None for a bare sharding).

    With ``foreign``, a leaf ``family`` does not name but another family does is described as
    the first such family (in `FAMILIES`' order) names it, with ``own=False``: the caller
    refuses it, after telling what else does not match (its tensor missing, say). Without,
    it is refused here, as is a leaf no family names.
    """
    keys, where = dict_keys(path), "params" + jax.tree_util.keystr(path)
    found = _named(keys, family)
    own = found is not None
    if not own and foreign:
        found = next(filter(None, (_named(keys, f) for f in FAMILIES.values())), None)
    if found is None:
        raise _unknown(keys, where, api, family)
    name, transposed, stacked = found
    if not stacked:
        return Leaf(where, name, 0, transposed, own)
    if ndim is None and keys[0] != "blocks":
        raise ValueError(
            f"{api}: {where} is a bare Sharding, so its pipeline layout is unknown; give "
            f"a jax.ShapeDtypeStruct(shape, dtype, sharding=...) for the stages' leaves."
        )
    leaf = Leaf(where, "model.layers.{i}." + name, 0, transposed, own)
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


def _named(keys: tuple[str, ...], family: Family) -> tuple[str, bool, bool] | None:
    """``family``'s tensor of our leaf ``keys``: its name (after ``model.layers.{i}.`` in the
    blocks), whether transposed, and whether in the blocks; None if it names none."""
    if keys in family.outer_names:
        return (*family.outer_names[keys], False)
    if keys[:1] and keys[0] in STACKED and keys[1:] in family.layer_names:
        return (*family.layer_names[keys[1:]], True)
    return None


def _unknown(keys: tuple[str, ...], where: str, api: str, family: Family) -> ValueError:
    """The refusal of a leaf ``family`` does not name, listing the leaves it names."""
    known = [".".join(k) for k in family.outer_names]
    known += [f"blocks.{'.'.join(k)}" for k in family.layer_names]
    other = next((f for f in FAMILIES.values() if _named(keys, f)), None)
    mixed = f" (it is a {other.name}'s leaf)" if other is not None else ""
    return ValueError(
        f"{api}: {where} has no Hugging Face tensor in a {family.name}'s checkpoint{mixed}; "
        f"its leaves are {', '.join(known)} (or stages.* in a pipeline's layout). Load the "
        f"other parameters another way."
    )


def outline(family: Family) -> str:
    """``family``'s blocks for messages: ``blocks (ln1, attn q/k/v/out, ln2, mlp
    gate/up/down)``, or ``blocks.moe (...)`` (biases aside)."""
    keys = [k for k in family.layer_names if not k[-1].endswith("_bias")]
    common = 0
    while all(len(k) > common + 1 and k[common] == keys[0][common] for k in keys):
        common += 1
    groups: dict[str, list[str]] = {}
    for k in keys:
        leaf = ".".join(k[common + 1 :]).removesuffix("scale").removesuffix(".")
        groups.setdefault(k[common], []).extend([leaf] if leaf else [])
    inner = ", ".join(" ".join([g, "/".join(leaves)]).strip() for g, leaves in groups.items())
    return f"{'.'.join(('blocks', *keys[0][:common]))} ({inner})"
