"""The token embedding's lookup over the token axes: `lookup`.

Inside ``Replicator.run`` the tokens of a step are held split over the token axes, ``context``
(their sequence) and ``expert`` (their sequences), and each device looks up its own chunk. The
lookup's backward pass is a scatter-add of the cotangents into the table's gradient, which
every device of those axes holds whole. Left to XLA, every device gathers every chunk's
cotangents (an all-gather of the activations' size, ``(C - 1) / C`` of ``n D`` elements for a
data replica's ``n`` tokens over ``C`` devices) and scatters them all. `lookup` can map the
lookup by hand over the token axes instead (`collectives.map_over`): each device scatters only
its own chunk into its gradient, and the gradients are summed over the token axes, as every
other weight's gradient is (an all-reduce of the device's part of the table: ``2 (C - 1) / C``
of ``V D`` elements, ``V D / R`` for a ZeRO-3 table split over ``R`` replicas). Whichever moves
fewer bytes is taken (`scatters_locally`): the sum over the chunks for a small vocabulary and
many tokens, the gather of the cotangents for a large vocabulary (Llama 3's 128,256 rows
against a few sequences a replica).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from replicator._src.core import collectives, sharded_params
from replicator._src.core.mesh import CONTEXT_AXIS, EXPERT_AXIS
from replicator._src.sharded import attention as attention_lib


def lookup(table: Any, tokens: jax.Array, dtype: Any = None) -> jax.Array:
    """``table[tokens]`` (as ``dtype``), the rows of a ``[V, D]`` token table stored whole or
    as a ZeRO-3 `rp.ShardedParam` (`sharded_params.take_rows`, JAX's index rules), for
    ``[B, S]`` tokens, the result ``[B, S, D]`` held split over the token axes like the tokens
    (`attention.constrain_tokens`).

    Where `scatters_locally` says it moves fewer bytes, the lookup is mapped by hand over the
    token axes, so that each device's backward pass scatters its own tokens' cotangents and the
    table's gradient is summed over the token axes (module docstring); otherwise XLA gathers
    the cotangents. Without a ``context`` or ``expert`` axis: ``take_rows`` itself.

    Equivalent to: ``table[clip(where(tokens < 0, tokens + V, tokens), 0, V - 1)].astype(dtype)``

    >>> import jax.numpy as jnp
    >>> lookup(jnp.arange(6.0).reshape(3, 2), jnp.array([[2, 0]]))   # one device
    Array([[[4., 5.],
            [0., 1.]]], dtype=float32)
    """
    tokens = attention_lib.constrain_tokens(tokens)  # each device looks up its own chunk
    axes = _token_axes(tokens)
    take = lambda t, i: sharded_params.take_rows(t, i, dtype)
    if not axes or not scatters_locally(
        part=_part_size(table),
        tokens=tokens.size,
        width=_width(table),
        part_bytes=_dtype(table).itemsize,
        cotangent_bytes=jnp.dtype(dtype or _dtype(table)).itemsize,
    ):
        return take(table, tokens)
    spec = P(EXPERT_AXIS, CONTEXT_AXIS)
    mapped = collectives.map_over(take, in_specs=(P(), spec), out_specs=spec, axes=axes)
    return mapped(table, tokens)


def scatters_locally(
    *, part: float, tokens: float, width: float, part_bytes: int = 4, cotangent_bytes: int = 4
) -> bool:
    """Whether the embedding's backward pass over the token axes moves fewer bytes (or as
    many) when each device scatters its own tokens and the table's gradient is summed (an
    all-reduce of ``part`` elements, the device's part of the table, of ``part_bytes`` each)
    than when the cotangents are gathered (``tokens x width`` elements, a data replica's tokens
    and the table's width, of ``cotangent_bytes`` each): ``2 part part_bytes <= tokens width
    cotangent_bytes``. Over ``C`` devices the one moves ``2 (C - 1) / C`` of its buffer, the
    other ``(C - 1) / C``.

    >>> scatters_locally(part=256 * 64, tokens=1024, width=64)        # a small vocabulary
    True
    >>> scatters_locally(part=128256 * 4096, tokens=16384, width=4096, cotangent_bytes=2)
    False
    """
    return 2 * part * part_bytes <= tokens * width * cotangent_bytes


def _token_axes(tokens: jax.Array) -> tuple[str, ...]:
    """The token axes XLA splits ``tokens`` over, where they divide its batch and sequence."""
    axes = []
    e, c = collectives.auto_axis_size(EXPERT_AXIS), collectives.auto_axis_size(CONTEXT_AXIS)
    if tokens.ndim == 2 and e > 1 and tokens.shape[0] % e == 0:
        axes.append(EXPERT_AXIS)
    if tokens.ndim == 2 and c > 1 and tokens.shape[1] % c == 0:
        axes.append(CONTEXT_AXIS)
    return tuple(axes)


def _value(table: Any) -> Any:
    return table.value if sharded_params.is_sharded_param(table) else table


def _part_size(table: Any) -> int:
    """The elements of the table a replica holds (its gradient's, summed over the token axes)."""
    return _value(table).size


def _dtype(table: Any) -> jnp.dtype:
    return jnp.dtype(_value(table).dtype)


def _width(table: Any) -> int:
    """The table's width ``D`` (a ZeRO-3 table split by columns holds ``D / R`` of it)."""
    d = _value(table).shape[-1]
    if sharded_params.is_sharded_param(table) and table.dim == -1:
        d *= collectives.num_replicas()
    return d
