"""Mixture-of-experts routing: which expert slot each token-choice of a group takes.

A *group* is one sequence of the batch: routing, capacity and the load-balancing loss are
computed per group and never across groups, so they do not depend on how the batch is split
over devices (`replicator.moe` explains why that makes them exact on every mesh).

Every token picks its ``top_k`` most probable experts (`Routing`). The token-choices of a group
are ranked in GShard's priority order: every token's first choice in position order, then every
token's second choice, and so on. A token-choice's *slot* is the number of token-choices before
it in that order that chose the same expert; it is kept when its slot is below the expert's
capacity (`Routing.capacity`), else dropped.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Routing:
    """How tokens are routed to experts.

    Attributes:
      num_experts: the number of experts E.
      top_k: the experts each token is sent to: 1 (Switch Transformer: the gate is the chosen
        expert's router probability) or more (GShard, Mixtral: the gates are the chosen
        probabilities renormalised to sum to 1). At most ``num_experts``.
      capacity_factor: the slots of each expert in each group, relative to an even share of the
        group's token-choices (`capacity`); None gives every expert room for the whole group,
        so that no token is ever dropped.
      receive_factor: dropless (``capacity_factor=None``) over an ``expert`` axis: the rows
        each device receives in the first all-to-all round, relative to its balanced share (the
        routed rows of a device); rows past that follow in smaller overflow rounds, exactly.
        At least 1.0: a larger buffer makes overflow rounds rarer and counts more FLOPs.
      normalize: with ``top_k > 1``, the gates are the chosen probabilities renormalised to
        sum to 1 (Mixtral's, Qwen3-MoE's ``norm_topk_prob``); False keeps the raw ones.

    >>> from replicator import moe
    >>> routing = moe.Routing(num_experts=8, top_k=2)
    >>> routing.capacity(16)            # ceil(1.25 * 16 * 2 / 8)
    5
    >>> moe.Routing(num_experts=8, capacity_factor=None).capacity(16)
    16
    >>> moe.Routing(num_experts=2, top_k=3)
    Traceback (most recent call last):
    ValueError: moe.Routing: top_k=3 is more than num_experts=2 (each token picks distinct experts); use top_k <= 2, or more experts.
    """

    num_experts: int
    top_k: int = 1
    capacity_factor: float | None = 1.25
    receive_factor: float = 1.05
    normalize: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(
                    f"moe.Routing: {name} must be an int >= 1; got {value!r} (e.g. "
                    f"moe.Routing(num_experts=8, top_k=2))."
                )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"moe.Routing: top_k={self.top_k} is more than num_experts={self.num_experts} "
                f"(each token picks distinct experts); use top_k <= {self.num_experts}, or more "
                f"experts."
            )
        cf = self.capacity_factor
        ok = cf is None or (not isinstance(cf, bool) and isinstance(cf, numbers.Real))
        if not ok or (cf is not None and not (0 < cf < math.inf)):
            raise ValueError(
                f"moe.Routing: capacity_factor must be a positive number, or None to never drop "
                f"a token; got {cf!r} (e.g. capacity_factor=1.25)."
            )
        rf = self.receive_factor
        if isinstance(rf, bool) or not isinstance(rf, numbers.Real) or not 1 <= rf < math.inf:
            raise ValueError(
                f"moe.Routing: receive_factor must be a number >= 1 (the first round's receive "
                f"buffer against a device's share of the rows); got {rf!r} (e.g. "
                f"receive_factor=1.05)."
            )

    def capacity(self, group_size: int) -> int:
        """The slots of each expert in a group of ``group_size`` tokens.

        ``ceil(capacity_factor * group_size * top_k / num_experts)``, at most ``group_size``
        (a token never picks an expert twice); ``group_size`` when ``capacity_factor`` is None.
        """
        if self.capacity_factor is None:
            return group_size
        share = self.capacity_factor * group_size * self.top_k / self.num_experts
        return max(1, min(group_size, math.ceil(round(share, 9))))  # 2.5000000001 is 2.5


class Stats(NamedTuple):
    """Routing statistics, one entry per group (sequence).

    Per-group entries are exact under any split of the batch: sum or average them as the loss
    needs.

    Attributes:
      aux_loss: ``[G]`` fp32, the Switch/GShard load-balancing loss of each group,
        ``E * sum_e f_e * P_e``: ``f_e`` the fraction of the group's tokens whose first choice is
        expert ``e``, ``P_e`` the mean router probability of ``e`` over the group. It is 1 when
        the load is even, and only ``P_e`` carries a gradient.
      dropped: ``[G]`` int32, token-choices dropped for lack of capacity.
      routed: ``[G]`` int32, token-choices routed (kept plus dropped: tokens times ``top_k``).
    """

    aux_loss: jax.Array
    dropped: jax.Array
    routed: jax.Array


class Choices(NamedTuple):
    """Every token-choice of each group, in priority order (``[G, top_k * S]``, choice ``j`` of
    token ``s`` at ``j * S + s``)."""

    expert: jax.Array  # int32: the chosen expert
    slot: jax.Array  # int32: its place in that expert's buffer; kept when < capacity
    gate: jax.Array  # fp32: its weight in the token's output
    token: jax.Array  # int32: the token's position in the group


def route(router: jax.Array, x: jax.Array, routing: Routing) -> tuple[Choices, Stats]:
    """Routes each group of ``x`` (``[G, S, D]``) by ``router`` (``[D, E]``), in fp32.

    Returns:
      ``(choices, stats)``: `Choices` in priority order, and the `Stats` of each group.
    """
    g, s, _ = x.shape
    k, e = routing.top_k, routing.num_experts
    logits = jnp.einsum("gsd,de->gse", x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top, expert = lax.top_k(probs, k)  # [G, S, k]; ties: the lowest index first
    gate = top / jnp.sum(top, axis=-1, keepdims=True) if k > 1 and routing.normalize else top
    # Priority order: choice j of every token (in position order) before choice j + 1.
    expert = jnp.swapaxes(expert, 1, 2).reshape(g, k * s).astype(jnp.int32)
    gate = jnp.swapaxes(gate, 1, 2).reshape(g, k * s)
    onehot = jax.nn.one_hot(expert, e, dtype=jnp.int32)  # [G, kS, E]
    before = jnp.cumsum(onehot, axis=1) - onehot  # earlier token-choices to each expert
    slot = jnp.sum(before * onehot, axis=-1)
    dropped = jnp.sum(slot >= routing.capacity(s), axis=-1, dtype=jnp.int32)
    first = jnp.mean(onehot[:, :s].astype(jnp.float32), axis=1)  # f_e: first choices only
    aux = e * jnp.sum(first * jnp.mean(probs, axis=1), axis=-1)
    token = jnp.broadcast_to(jnp.tile(jnp.arange(s, dtype=jnp.int32), k), (g, k * s))
    stats = Stats(aux, dropped, jnp.full((g,), k * s, jnp.int32))
    return Choices(expert, slot, gate, token), stats
