"""A mixture-of-experts layer, with expert parallelism over the mesh's ``expert`` axis.

`apply` replaces a dense MLP by ``num_experts`` of them (`init`) and a router. Each token goes
to its ``top_k`` most probable experts (`Routing`), and its output is theirs, weighted by its
gates. The residual connection is the caller's.

**Groups.** Each sequence of the batch ``[B, S, D]`` is one routing group. Routing, expert
capacity, dropping and the load-balancing loss are computed within a group, never across groups.

**Capacity and drop order.** Each expert takes at most ``C = routing.capacity(S)`` token-choices
of a group (``ceil(capacity_factor * S * top_k / E)``). They are taken in GShard's priority
order: every token's first choice in position order, then every token's second choice, and so
on. A token-choice that finds its expert's ``C`` slots taken is dropped: it adds nothing to
the token's output, which keeps only its residual path. With ``capacity_factor=None`` no token
is ever dropped, and no slots are made (**dropless**, `replicator._src.sharded.dropless`): the
token-choices are sorted by expert and each expert computes only its own rows (a grouped
matmul), ``top_k`` rows a token, where ``C = S`` slots would compute ``E / top_k`` times
more.

**Dispatch by indices.** Each group gets an index buffer ``[E, C]`` of token positions, and the
tokens are gathered into a ``[G, E, C, D]`` buffer (empty slots zero), each expert's FFN runs on
its ``C`` rows, and each kept token-choice gathers its slot's output back. This is linear in
``S``; the one-hot dispatch einsum of Mesh-TensorFlow costs ``S * E * C * D`` FLOPs, quadratic in
``S``.

**Aux loss.** `Stats` gives each group's Switch/GShard load-balancing loss, ``E * sum_e f_e *
P_e`` (``f_e`` the fraction of the group's tokens whose first choice is ``e``, ``P_e`` the mean
router probability of ``e``), and its dropped and routed token-choice counts.

**Expert parallelism.** Inside ``Replicator.run`` on a mesh with an ``expert`` axis of ``N > 1``
devices, the experts' weights are split over it by expert (`partition_specs`), and the groups of
each data replica are split over it too: a device routes its ``G / N`` groups, sends each
expert's rows to the device holding that expert (one ``all_to_all``), runs its ``E / N``
experts on every device's rows, and sends the results back (a second ``all_to_all``). Dropless,
the rows sent are the routed ones, in rounds whose receive buffers hold about a device's share
(``Routing.receive_factor``) and an exact overflow round for the rest
(`replicator._src.sharded.exchange`).

**Exact on every mesh.** A group is never split over devices, and what happens to a token
depends only on its own group. So on any mesh, and for any split of the batch over data
replicas and experts, every token is routed to the same slots, the dropped token-choices are
the same set as one device's for the same global batch in the same order, and the aux loss and
counts of each group are the same numbers. Without an ``expert`` axis (or outside a mesh) the
same code runs without any mapping: that is the one-device program the meshes are tested
against.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from replicator._src.core import collectives
from replicator._src.core.mesh import EXPERT_AXIS
from replicator._src.core.sharded_params import gather_params
from replicator._src.sharded import dropless
from replicator._src.sharded.routing import Choices, Routing, Stats, route

LOGICAL_AXES: dict = {
    "router": ("embed", None),
    "gate": ("experts", "embed", "mlp"),
    "up": ("experts", "embed", "mlp"),
    "up_bias": ("experts", "mlp"),
    "down": ("experts", "mlp", "embed"),
    "down_bias": ("experts", "embed"),
}
"""The role of each dimension of `init`'s parameters (``gate`` with ``gated=True`` only, the
biases with ``bias=True`` only): ``"experts"`` (one entry per expert), ``"embed"`` (the model
width) and ``"mlp"`` (each expert's hidden units)."""

_EXPERT_LEAVES = ("gate", "up", "up_bias", "down", "down_bias")


def logical_axes_for(*, gated: bool = False, bias: bool = True) -> dict:
    """`LOGICAL_AXES` of the leaves `init` makes with these options.

    Args:
      gated: as for `init`.
      bias: as for `init`.

    Returns:
      A dict: each parameter's name to the role of each of its dimensions.

    >>> from replicator import moe
    >>> sorted(moe.logical_axes_for(gated=True, bias=False))
    ['down', 'gate', 'router', 'up']
    """
    drop = (set() if gated else {"gate"}) | (set() if bias else {"up_bias", "down_bias"})
    return {name: axes for name, axes in LOGICAL_AXES.items() if name not in drop}


def partition_specs(*, gated: bool = False, bias: bool = True) -> dict:
    """The ``PartitionSpec`` of each of `init`'s parameters: the experts split over ``expert``.

    Everything else is whole. On a mesh without ``expert``, ``Replicator.place`` drops the axis.

    Args:
      gated: as for `init`.
      bias: as for `init`.

    Returns:
      A dict of ``PartitionSpec``, one per parameter `init` makes with these options.

    >>> from replicator import moe
    >>> moe.partition_specs()["up"], moe.partition_specs()["router"]
    (P('expert', None, None), P(None, None))
    """
    entry = lambda role: EXPERT_AXIS if role == "experts" else None
    axes = logical_axes_for(gated=gated, bias=bias)
    return {name: P(*map(entry, roles)) for name, roles in axes.items()}


def init(
    key: jax.Array,
    *,
    d_model: int,
    hidden: int,
    num_experts: int,
    out_std: float = 0.02,
    gated: bool = False,
    bias: bool = True,
) -> dict:
    """The fp32 parameters of `apply`: a router and ``num_experts`` MLPs.

    Weights are normal with standard deviation 0.02 (``out_std`` for ``down``), biases zero.

    Args:
      key: the random key.
      d_model: the model width D.
      hidden: each expert's hidden width F.
      num_experts: the number of experts E.
      out_std: the standard deviation of ``down`` (GPT-2 scales it by
        ``1 / sqrt(2 * num_layers)``).
      gated: add ``"gate": [E, D, F]`` (SwiGLU experts, as Mixtral's).
      bias: with the biases (False leaves them out).

    Returns:
      A dict with ``router`` ``[D, E]``, ``up`` ``[E, D, F]``, ``up_bias`` ``[E, F]``,
      ``down`` ``[E, F, D]`` and ``down_bias`` ``[E, D]``, and ``gate`` as ``gated`` says.

    Raises:
      ValueError: if ``d_model``, ``hidden`` or ``num_experts`` is not an int >= 1.

    >>> import jax
    >>> from replicator import moe
    >>> params = moe.init(jax.random.key(0), d_model=8, hidden=16, num_experts=4)
    >>> params["up"].shape, params["down"].shape, params["router"].shape
    ((4, 8, 16), (4, 16, 8), (8, 4))
    """
    for name, value in (("d_model", d_model), ("hidden", hidden), ("num_experts", num_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"moe.init: {name} must be an int >= 1; got {value!r}.")
    d, f, e = d_model, hidden, num_experts
    k = jax.random.split(key, 4 if gated else 3)
    normal = lambda key, shape, std=0.02: std * jax.random.normal(key, shape, jnp.float32)
    params = {
        "router": normal(k[0], (d, e)),
        "up": normal(k[1], (e, d, f)),
        "up_bias": jnp.zeros((e, f), jnp.float32),
        "down": normal(k[2], (e, f, d), out_std),
        "down_bias": jnp.zeros((e, d), jnp.float32),
    }
    if gated:
        params["gate"] = normal(k[3], (e, d, f))
    return {name: params[name] for name in logical_axes_for(gated=gated, bias=bias)}


def apply(
    params: dict,
    x: jax.Array,
    *,
    routing: Routing,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    dtype: Any = None,
) -> tuple[jax.Array, Stats]:
    """The mixture of experts on ``x`` (``[B, S, D]``, each sequence one routing group).

    Each expert is ``down(activation(x @ up + up_bias)) + down_bias``, or with a ``gate`` leaf
    (``init(gated=True)``) ``down(activation(x @ gate) * (x @ up))`` (SwiGLU with
    ``activation=jax.nn.silu``, as Mixtral's experts); biases are added where ``params`` have
    them. Each token's output is the sum over its kept token-choices of the gate times the
    chosen expert's output: zero for a token whose every choice was dropped (add the residual
    yourself). The router's logits and softmax are fp32; the experts run in ``dtype`` (default
    ``x.dtype``), which the result has. ZeRO-3 parameters (`rp.ShardedParam`) are gathered
    here; plain arrays pass through.

    Inside ``Replicator.run`` on a mesh with an ``expert`` axis, each device runs its own
    experts (``params`` placed by `partition_specs`) on the tokens routed to them, which travel
    by ``all_to_all``; the result is the same as on one device (module docstring).

    Args:
      params: `init`'s parameters (or ZeRO-3's `rp.ShardedParam` versions of them).
      x: ``[B, S, D]``, B groups of S tokens.
      routing: the `Routing` (its ``num_experts`` is that of ``params``).
      activation: the experts' nonlinearity.
      dtype: the experts' compute dtype; None for ``x.dtype``.

    Returns:
      ``(y, stats)``: ``y`` of ``x``'s shape in the compute dtype, and the `Stats` of each group.

    Raises:
      TypeError: if ``routing`` is not a `Routing`.
      ValueError: if ``x`` is not ``[B, S, D]``, ``params`` do not match ``x`` and ``routing``,
        or, on an ``expert`` axis of N devices, ``num_experts`` or the B groups of the step do
        not divide by N.

    >>> import jax
    >>> from replicator import moe
    >>> params = moe.init(jax.random.key(0), d_model=8, hidden=16, num_experts=4)
    >>> x = jax.random.normal(jax.random.key(1), (2, 6, 8))          # 2 groups of 6 tokens
    >>> y, stats = moe.apply(params, x, routing=moe.Routing(num_experts=4, top_k=2))
    >>> y.shape, stats.routed.tolist()                                 # 6 tokens x 2 choices
    ((2, 6, 8), [12, 12])
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"moe.apply: routing must be a moe.Routing; got {routing!r}.")
    params = gather_params(params)
    _check_shapes(params, x, routing)
    dtype = jnp.dtype(dtype or x.dtype)
    experts = {k: params[k].astype(dtype) for k in _EXPERT_LEAVES if k in params}
    n = collectives.auto_axis_size(EXPERT_AXIS)
    _check_split(x.shape[0], routing.num_experts, n)
    local = functools.partial(_local, routing=routing, activation=activation, dtype=dtype, n=n)
    groups, by_expert = P(EXPERT_AXIS), {k: P(EXPERT_AXIS) for k in experts}
    mapped = collectives.map_over(
        local,
        in_specs=(P(), by_expert, groups),
        out_specs=(groups, Stats(groups, groups, groups)),
        axes=(EXPERT_AXIS,),
    )
    return mapped(params["router"], experts, x)


def _local(router, experts, x, *, routing, activation, dtype, n):
    """One device's part of `apply`: route its groups, dispatch them to every expert (over the
    ``n`` devices of ``expert`` when ``n > 1``), run its experts, and combine."""
    choices, stats = route(router, x, routing)
    if routing.capacity_factor is None:  # the routed rows only, sorted by expert
        kwargs = dict(num_experts=routing.num_experts, activation=activation, n=n,
                      receive_factor=routing.receive_factor)  # fmt: skip
        return dropless.apply(experts, x.astype(dtype), choices, **kwargs), stats
    c = routing.capacity(x.shape[1])
    buffer = _dispatch(x.astype(dtype), choices, routing.num_experts, c)  # [G, E, C, D]
    if n > 1:  # [G/n, E, C, D] -> [G, E/n, C, D]: each device gets its experts' rows
        buffer = collectives.all_to_all(buffer, EXPERT_AXIS, split=1, concat=0)
    out = _ffn(experts, buffer, activation)
    if n > 1:  # and back: [G, E/n, C, D] -> [G/n, E, C, D]
        out = collectives.all_to_all(out, EXPERT_AXIS, split=0, concat=1)
    return _combine(out, choices, c, x.shape[1]), stats


def _dispatch(x: jax.Array, choices: Choices, num_experts: int, capacity: int) -> jax.Array:
    """``[G, E, C, D]``: slot ``c`` of expert ``e`` holds the token that took it (zeros if
    none), gathered through an index buffer ``[G, E * C]`` of token positions."""
    g, s, d = x.shape
    size = num_experts * capacity
    kept = choices.slot < capacity
    past_end = size + jnp.arange(choices.slot.shape[-1], dtype=jnp.int32)  # unique, dropped
    where = jnp.where(kept, choices.expert * capacity + choices.slot, past_end)
    empty = jnp.full((size,), s, jnp.int32)  # position s: the row of zeros below
    fill = lambda w, t: empty.at[w].set(t, mode="drop", unique_indices=True)
    index = jax.vmap(fill)(where, choices.token)  # [G, E * C]
    padded = jnp.concatenate([x, jnp.zeros((g, 1, d), x.dtype)], axis=1)
    rows = jax.vmap(lambda p, i: p[i])(padded, index)
    return rows.reshape(g, num_experts, capacity, d)


def _ffn(experts: dict, buffer: jax.Array, activation) -> jax.Array:
    """Each expert's MLP on its rows of ``buffer`` (``[G, E, C, D]``)."""
    linear = lambda x, name, spec: (
        jnp.einsum(spec, x, experts[name])
        + (experts[f"{name}_bias"][:, None] if f"{name}_bias" in experts else 0)
    )
    h = linear(buffer, "up", "gecd,edf->gecf")
    if "gate" in experts:
        h = activation(jnp.einsum("gecd,edf->gecf", buffer, experts["gate"])) * h
    else:
        h = activation(h)
    return linear(h, "down", "gecf,efd->gecd")


def _combine(out: jax.Array, choices: Choices, capacity: int, s: int) -> jax.Array:
    """``[G, S, D]``: each token's kept token-choices' outputs (their slots of ``out``, ``[G, E,
    C, D]``) times their gates, summed."""
    g, e, c, d = out.shape
    kept = choices.slot < capacity
    where = choices.expert * capacity + jnp.minimum(choices.slot, capacity - 1)
    rows = jax.vmap(lambda o, i: o[i])(out.reshape(g, e * c, d), where)  # [G, kS, D]
    weight = jnp.where(kept, choices.gate, 0.0).astype(out.dtype)
    return jnp.sum((rows * weight[..., None]).reshape(g, -1, s, d), axis=1)


def _check_shapes(params: dict, x: jax.Array, routing: Routing) -> None:
    """Refuses an ``x`` that is not ``[B, S, D]`` and parameters of other sizes."""
    if x.ndim != 3:
        raise ValueError(
            f"moe.apply: x must be [batch, seq, d_model] (each sequence one routing group); got "
            f"shape {tuple(x.shape)}. Reshape a flat [tokens, d_model] batch to [1, tokens, "
            f"d_model] for one group."
        )
    d, e = x.shape[-1], routing.num_experts
    if params["router"].shape != (d, e):
        raise ValueError(
            f"moe.apply: params['router'] has shape {tuple(params['router'].shape)}, but x has "
            f"d_model={d} and routing has num_experts={e}: expected ({d}, {e}). Build params "
            f"with moe.init(key, d_model={d}, hidden=..., num_experts={e})."
        )
    f = params["up"].shape[-1]
    want = {"gate": (e, d, f), "up": (e, d, f), "up_bias": (e, f), "down": (e, f, d)}
    want["down_bias"] = (e, d)
    if ("up_bias" in params) != ("down_bias" in params) or "down" not in params:
        raise ValueError(
            f"moe.apply: params have {sorted(params)}; expected router, up, down, with gate "
            f"(gated experts) or not, and both up_bias and down_bias or neither, as moe.init "
            f"makes."
        )
    for name, shape in want.items():
        if name in params and tuple(params[name].shape) != shape:
            raise ValueError(
                f"moe.apply: params[{name!r}] has shape {tuple(params[name].shape)}; expected "
                f"{shape} (num_experts={e}, d_model={d}, hidden={f}), as moe.init makes."
            )


def _check_split(groups: int, num_experts: int, n: int) -> None:
    """Refuses an ``expert`` axis of ``n`` devices that the groups or experts do not divide."""
    if n == 1:
        return
    if num_experts % n:
        raise ValueError(
            f"moe.apply: num_experts={num_experts} does not split over the {n} devices of the "
            f"{EXPERT_AXIS!r} axis; use num_experts a multiple of {n} (e.g. "
            f"{n * math.ceil(num_experts / n)}), or a smaller {EXPERT_AXIS!r} axis."
        )
    if groups % n:
        raise ValueError(
            f"moe.apply: the step's batch has {groups} groups (sequences), which do not split "
            f"over the {n} devices of the {EXPERT_AXIS!r} axis (each device routes whole "
            f"groups); use a per-replica batch that is a multiple of {n} (a global batch that "
            f"is a multiple of {n} x the number of data replicas), or a smaller "
            f"{EXPERT_AXIS!r} axis."
        )
