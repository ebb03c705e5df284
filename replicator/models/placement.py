"""The decoder's parameters on a mesh: the role of each dimension of each parameter
(`LOGICAL_AXES`, `logical_axes_for`), roles to mesh axes (`MEGATRON_RULES`, `partition_specs`),
`place` and `place_pipeline` (and `pipeline_params`, the stages' layout unplaced), and the
arguments of ZeRO-3's ``shard_params`` (`zero_stacked`, `zero_split`)."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator import moe, pipeline
from replicator._src.core.mesh import EXPERT_AXIS, MODEL_AXIS
from replicator.models.config import DEFAULT, GPTConfig
from replicator.models.layers.common import POST_NORMS, with_biases
from replicator.models.layers.norms import has_bias


def _with_biases(config: GPTConfig, weights: dict) -> dict:
    """``{name: axes}`` of linear layers and their biases' (the last), where they have one."""
    return with_biases(config, weights, lambda axes: axes[-1:])


def _block_axes(config: GPTConfig) -> dict:
    norm = {"scale": ("embed",)}
    if has_bias(config):
        norm["bias"] = ("embed",)
    if config.num_kv_heads is None:
        attn = {"qkv": ("embed", "heads")}  # columns grouped by head (see `project_qkv`)
    else:
        attn = {"q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads")}
    attn["out"] = ("heads", "embed")  # rows: the heads' outputs, in the same order
    mlp = {"gate": ("embed", "mlp")} if config.gated else {}
    mlp |= {"up": ("embed", "mlp"), "down": ("mlp", "embed")}
    attn = _with_biases(config, attn)
    if config.qk_norm:  # one scale over a head's width, every head's
        attn |= {n: jax.tree.map(lambda _: ("head_dim",), norm) for n in ("q_norm", "k_norm")}
    block = {"ln1": norm, "attn": attn, "ln2": norm, "mlp": _with_biases(config, mlp)}
    return block | ({n: norm for n in POST_NORMS.values()} if config.post_norms else {})


def _axes(config: GPTConfig) -> dict:
    is_axes = lambda a: isinstance(a, tuple)
    block = _block_axes(config)
    embed = {"tokens": ("vocab", "embed")}
    if config.position == "learned":
        embed["positions"] = ("seq", "embed")
    head = {"norm": block["ln1"]} | ({} if config.tie_embeddings else {"w": ("embed", "vocab")})
    if not config.num_experts:
        blocks = jax.tree.map(lambda a: ("layers", *a), block, is_leaf=is_axes)
        return {"embed": embed, "blocks": blocks, "head": head}
    experts = moe.logical_axes_for(gated=config.gated, bias=config.bias)
    moe_block = {k: v for k, v in block.items() if k != "mlp"} | {"moe": experts}
    group = {"moe": moe_block}
    if config.moe_every > 1:
        group["dense"] = jax.tree.map(lambda a: ("layers", *a), block, is_leaf=is_axes)
    blocks = jax.tree.map(lambda a: ("layers", *a), group, is_leaf=is_axes)
    return {"embed": embed, "blocks": blocks, "head": head}


LOGICAL_AXES: dict = _axes(DEFAULT)
"""The role of each dimension of each leaf of `init`'s parameters (for the default `GPTConfig`;
`logical_axes_for` gives any config's): ``"heads"`` (attention heads, each ``head_dim`` wide),
``"kv_heads"`` (key/value heads, with ``num_kv_heads``), ``"mlp"`` (the MLP's hidden units),
``"embed"`` (the model width), ``"vocab"``, ``"seq"`` (positions) and ``"layers"`` (the stacked
blocks)."""


def logical_axes_for(config: GPTConfig | None = None) -> dict:
    """`LOGICAL_AXES` for ``config``'s parameters: the role of each dimension of each leaf.

    Args:
      config: the model's `GPTConfig`; None for the default architecture.

    Returns:
      A tree like `init`'s (the architecture's norms, attention and MLP matrices, biases,
      positions and output matrix) of tuples of roles; with ``num_experts``, the grouped
      layout of `init` (``"layers"`` for the group axis and the dense blocks' own,
      ``"experts"`` for the experts of `replicator.moe.LOGICAL_AXES`).

    >>> config = GPTConfig(num_heads=4, num_kv_heads=2, mlp="swiglu", bias=False)
    >>> logical_axes_for(config)["blocks"]["attn"]["k"], logical_axes_for(config)["blocks"]["mlp"]["gate"]
    (('layers', 'embed', 'kv_heads'), ('layers', 'embed', 'mlp'))
    """
    return LOGICAL_AXES if config is None else _axes(config)


def zero_stacked(config: GPTConfig) -> dict[str, int]:
    """The ``stacked`` argument of ZeRO-3's ``shard_params`` for `init`'s parameters.

    Args:
      config: the model's `GPTConfig`.

    Returns:
      ``{"blocks": n}``: the blocks' leading layer axes, which a layer scan slices (two with
      ``moe_every > 1``: groups, then each group's dense blocks).
    """
    return {"blocks": 2 if config.num_experts and config.moe_every > 1 else 1}


def zero_split(config: GPTConfig) -> dict[str, int]:
    """The ``split`` argument of ZeRO-3's ``shard_params`` for `init`'s parameters.

    The embedding tables are split by their width (columns), so that `embed` looks up each
    replica's columns of every token's row and exchanges them (one all-to-all of the
    activations' size) instead of gathering the ``[V, D]`` table and reduce-scattering its
    gradient (MaxText's FSDP layout of the embedding).

    Args:
      config: the model's `GPTConfig` (every architecture has the same split).

    Returns:
      ``{"embed": -1}``.
    """
    del config
    return {"embed": -1}


MEGATRON_RULES: Mapping[str, str | None] = types.MappingProxyType(
    {"heads": MODEL_AXIS, "mlp": MODEL_AXIS, "kv_heads": MODEL_AXIS}
)
"""Role to mesh axis, Megatron-LM's layout: attention heads (query and key/value heads alike)
and MLP hidden units split over ``model``, so the q/k/v (or qkv) and first MLP (gate, up)
matrices are split by columns and the attention output and second MLP matrices by rows; every
other role is whole. ``{**MEGATRON_RULES, "vocab": "model"}`` also splits the embedding table by
rows and the output matrix by columns; ``{**MEGATRON_RULES, "kv_heads": None}`` keeps the keys
and values whole on every device (for fewer key/value heads than ``model`` devices)."""


_ROLE_SIZES = {
    "heads": "num_heads",
    "kv_heads": "kv_heads",
    "mlp": "hidden",
    "vocab": "vocab_size",
    "embed": "d_model",
    "experts": "num_experts",
}


def partition_specs(
    *, rules: Mapping[str, str | None] = MEGATRON_RULES, config: GPTConfig | None = None
) -> dict:
    """The ``PartitionSpec`` of every leaf of `init`'s parameters, by role.

    `LOGICAL_AXES` are mapped to mesh axes by ``rules`` (roles not in ``rules`` are whole). On
    a mesh without the axes they name, ``Replicator.place`` drops them: the same specs place a
    replicated model on ``{"data": 8}``.

    Args:
      rules: role to mesh axis; the roles are those of `LOGICAL_AXES` and the axis ``"model"``
        (an axis XLA partitions inside a step, so that ``step_fn`` sees whole parameters);
        ``"experts"`` (the mixture-of-experts blocks' experts) goes to ``"expert"`` unless
        ``rules`` says otherwise.
      config: the model's sizes, for a mixture-of-experts model's layout (`logical_axes_for`).

    Returns:
      A tree like `init`'s of ``PartitionSpec``.

    Raises:
      ValueError: for a role `LOGICAL_AXES` does not use, or an axis other than ``"model"``
        (and ``"expert"`` for ``"experts"``).

    >>> from replicator.models import gpt
    >>> specs = gpt.partition_specs()
    >>> specs["blocks"]["attn"]["qkv"], specs["blocks"]["mlp"]["down"], specs["head"]["w"]
    (P(None, None, 'model'), P(None, 'model', None), P(None, None))
    """
    rules = {"experts": EXPERT_AXIS, **rules}
    roles = ("heads", "kv_heads", "mlp", "vocab", "embed", "seq", "layers", "experts", "head_dim")
    for role, axis in rules.items():
        if role not in roles:
            raise ValueError(
                f"gpt.partition_specs: rules name role {role!r}, which no parameter has; the "
                f"roles are {', '.join(map(repr, roles))}, e.g. rules={{'heads': 'model'}}."
            )
        if axis not in (MODEL_AXIS, None) and (role, axis) != ("experts", EXPERT_AXIS):
            raise ValueError(
                f"gpt.partition_specs: rules map {role!r} to {axis!r}; only {MODEL_AXIS!r} (or "
                f"None, whole) can split parameters that step_fn sees whole. Shard over data with "
                f"ZeRO (repl.wrap_optimizer(zero_stage=...)) and over stage with place_pipeline."
            )
    return jax.tree.map(
        lambda axes: P(*(rules.get(a) for a in axes)),
        logical_axes_for(config),
        is_leaf=lambda a: isinstance(a, tuple),
    )


def _check_layout(params: dict, config: GPTConfig | None, api: str) -> None:
    """Refuses parameters whose leaves are not those of ``config``'s `init`."""
    axes = jax.tree.structure(logical_axes_for(config), is_leaf=lambda a: isinstance(a, tuple))
    if jax.tree.structure(params) != axes:
        made = "the default GPTConfig" if config is None else "config"
        raise ValueError(
            f"{api}: params do not have the leaves of {made}'s parameters (gpt.init(config, "
            f"key)); pass the config they were made with, e.g. {api}(repl, params, "
            f"config=config)."
        )


def _check_split(mesh, config: GPTConfig | None, rules: Mapping, api: str) -> None:
    """Refuses a split of a role that does not give each device whole heads (units, rows)."""
    split = {r: a for r, a in rules.items() if a in mesh.shape and mesh.shape[a] > 1}
    if config is None or config.num_kv_heads is None:
        split.pop("kv_heads", None)  # the fused qkv: key/value heads are the heads
    if not split:
        return
    if config is None:
        raise ValueError(
            f"{api}: the mesh splits {', '.join(map(repr, split))} over {dict(mesh.shape)}; pass "
            f"config= (the model's GPTConfig) so the split can be checked to give each device "
            f"whole heads, e.g. {api}(repl, params, config=config)."
        )
    for role, axis in split.items():
        t, name = mesh.shape[axis], _ROLE_SIZES.get(role)
        if name is None or getattr(config, name) % t == 0:
            continue
        n = getattr(config, name)
        field = {"hidden": "d_ff", "kv_heads": "num_kv_heads"}.get(name, name)
        whole = (
            ", or rules={**gpt.MEGATRON_RULES, 'kv_heads': None} to keep keys and values whole "
            "on every device"
            if role == "kv_heads"
            else ""
        )
        raise ValueError(
            f"{api}: {field}={n} does not split over the {t} devices of {axis!r} (rules map "
            f"{role!r} to {axis!r}); use {field} a multiple of {t} (e.g. {t * math.ceil(n / t)}), "
            f"or a smaller {axis!r} axis{whole}."
        )


def place(
    repl: rp.Replicator,
    params: dict,
    *,
    config: GPTConfig | None = None,
    rules: Mapping[str, str | None] = MEGATRON_RULES,
) -> dict:
    """`init`'s parameters placed on ``repl``'s mesh for `loss`, split by `partition_specs`.

    On ``{"data": D, "model": T}`` each device holds ``num_heads / T`` heads (and with
    ``num_kv_heads``, ``num_kv_heads / T`` key/value heads: those its query heads use) and
    ``hidden / T`` MLP units of every block; ``step_fn`` still sees whole parameters (XLA
    partitions the ``model`` axis and adds its all-reduces: two per block forward, two
    backward). On a mesh without ``model`` every leaf is replicated, as
    ``repl.replicate(params)``.

    Args:
      repl: the Replicator whose mesh holds the parameters.
      params: `init`'s ``{"embed", "blocks", "head"}``.
      config: the model's sizes and architecture; needed when the mesh splits a role (to
        check whole heads) and for any but the default architecture (its leaves).
      rules: role to mesh axis (`partition_specs`).

    Returns:
      ``params``, placed.

    Raises:
      ValueError: if a role split over ``model`` (``num_heads``, ``num_kv_heads``, the hidden
        units) does not divide by its size, or ``config`` is missing for that check, or
        ``params`` do not have ``config``'s leaves.

    >>> import jax, replicator as rp
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=2)
    >>> repl = rp.Replicator(mesh_shape={"data": 2, "model": 2}, devices=jax.devices()[:4])
    >>> placed = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
    >>> qkv = placed["blocks"]["attn"]["qkv"]      # [layers, d_model, 3 d_model]
    >>> qkv.shape, qkv.addressable_shards[0].data.shape    # one head's q, k, v columns each
    ((2, 16, 48), (2, 16, 24))
    """
    specs = partition_specs(rules=rules, config=config)
    _check_layout(params, config, "gpt.place")
    _check_split(repl.mesh, config, {"experts": EXPERT_AXIS, **rules}, "gpt.place")
    return repl.place(params, specs)


def place_pipeline(
    repl: rp.Replicator,
    params: dict,
    *,
    num_stages: int,
    repeats: int = 1,
    config: GPTConfig | None = None,
    rules: Mapping[str, str | None] = MEGATRON_RULES,
) -> dict:
    """`init`'s parameters placed on ``repl``'s mesh for `pipeline_value_and_grad`.

    The blocks are stacked into ``num_stages`` stages (``repeats`` virtual stages per device,
    for the circular and interleaved schedules) and sharded over the ``stage`` axis; inside
    each stage, and in the embedding and head, every leaf is split as `partition_specs` says
    (heads and MLP units over ``model`` when the mesh has it; else replicated).

    Args:
      repl: the Replicator whose mesh holds the parameters.
      params: `init`'s ``{"embed", "blocks", "head"}``.
      num_stages: the size of the mesh's ``stage`` axis.
      repeats: virtual stages per device.
      config: the model's sizes and architecture (as for `place`).
      rules: role to mesh axis (`partition_specs`).

    Returns:
      ``{"embed", "stages", "head"}``, placed.

    Raises:
      ValueError: as `place` does.

    >>> import jax, replicator as rp
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=4)
    >>> repl = rp.Replicator(lowering="local")
    >>> placed = gpt.place_pipeline(repl, gpt.init(config, jax.random.key(0)), num_stages=2)
    >>> placed["stages"]["attn"]["qkv"].shape       # [stages, layers per stage, ...]
    (2, 2, 16, 48)
    """
    specs = partition_specs(rules=rules, config=config)
    _check_layout(params, config, "gpt.place_pipeline")
    _check_split(repl.mesh, config, rules, "gpt.place_pipeline")
    lead = tuple(pipeline.stage_spec(repeats))  # the stage axes, then the layers' own specs
    staged = pipeline_params(params, num_stages=num_stages, repeats=repeats)
    stage_specs = jax.tree.map(
        lambda spec: P(*lead, *spec), specs.pop("blocks"), is_leaf=lambda x: isinstance(x, P)
    )
    return {
        "embed": repl.place(staged["embed"], specs["embed"]),
        "stages": repl.place(staged["stages"], stage_specs),
        "head": repl.place(staged["head"], specs["head"]),
    }


def pipeline_params(params: dict, *, num_stages: int, repeats: int = 1) -> dict:
    """`init`'s parameters in `pipeline_value_and_grad`'s layout, unplaced.

    Args:
      params: `init`'s ``{"embed", "blocks", "head"}``.
      num_stages: pipeline stages.
      repeats: virtual stages per device.

    Returns:
      ``{"embed", "stages", "head"}``: the blocks stacked into stages
      (`replicator.pipeline.stack_stages`), the embedding and head as they are.

    >>> import jax
    >>> from replicator.models import gpt
    >>> config = gpt.GPTConfig(seq_len=8, d_model=16, num_heads=2, num_layers=4)
    >>> shapes = jax.eval_shape(
    ...     lambda: gpt.pipeline_params(gpt.init(config, jax.random.key(0)), num_stages=2))
    >>> sorted(shapes), shapes["stages"]["mlp"]["up"].shape
    (['embed', 'head', 'stages'], (2, 2, 16, 64))
    """
    stacked = pipeline.stack_stages(params["blocks"], num_stages=num_stages, repeats=repeats)
    return {"embed": params["embed"], "stages": stacked, "head": params["head"]}
