"""ZeRO-3's stored parameters: `ShardedParam`, and `gather_params`, which makes them whole.

A `ShardedParam` is one parameter in its own shape, one of its axes split over the replicas on
top of whatever split it has over ``stage`` or ``model`` (``zero.Zero.shard_params`` makes them;
`zero_layout.split_dim` chooses the axis). ``step_fn`` gathers them with `gather_params` in the
forward pass, as late as possible, and autodiff turns that all-gather into a reduce-scatter of
the gradients. Both run over the data axes only: on a mesh with ``model``, each device gathers
its own ``model`` part, so the product that uses the weight stays split over ``model``. Used as
an array without being gathered, a `ShardedParam` raises a ``TypeError`` that says to gather it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from replicator._src.core import collectives, placement
from replicator._src.core.binding import only
from replicator._src.core.typing import PyTree

_NOT_GATHERED = """\
rp.ShardedParam: parameter of shape {shape} is stored sharded (ZeRO-3) and must be gathered \
before it is used ({what}). Call rp.gather_params in the forward pass, as late as possible \
(per layer, inside the layer scan):

    def loss_fn(params, batch):
        params = rp.gather_params(params)      # full parameters, all-gathered over the replicas
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)"""


@jax.tree_util.register_pytree_with_keys_class
class ShardedParam:
    """A parameter stored ZeRO-3 style: in its own shape, axis ``dim`` split over the replicas.

    Attributes:
      value: the parameter. Outside a step it is the global array, of the parameter's shape,
        with axis ``dim`` split over the data axes besides its split over ``stage`` and
        ``model``; inside ``step_fn`` it is this replica's part (``dim`` 1/N as long).
      dim: the split axis, counted from the end (``-2`` is the second to last), so that it
        still names the same axis once a layer scan has sliced off leading (stacked) axes; None
        for a parameter with no axis that divides by the replicas, kept whole on each.
      auto: the ``PartitionSpec`` entries of the last ``len(auto)`` axes over the axes XLA
        partitions inside a step (``model``): `gather_params` gathers each device's own part.
      axes: the replica axes ``dim`` is split over, when not all of them: hybrid ZeRO's
        ``("data",)``, inside each slice and whole on every one (``wrap_optimizer(zero_axes=
        ...)``); None for all the replica axes.

    As a pytree node its only child is ``value`` (key ``.value``), so ``jax.grad``, optax and
    ``lax.scan`` see a plain array. Used as an array without `gather_params` (``x @ w``,
    ``w + 1``, ``jnp.dot``), it raises a ``TypeError`` that says to gather it.
    """

    def __init__(
        self, value: Any, dim: int | None, auto: tuple = (), axes: tuple | None = None
    ) -> None:
        if dim is not None and dim >= 0:
            raise ValueError(f"ShardedParam: dim counts from the end (negative); got {dim}.")
        self.value = value
        self.dim = dim
        self.auto = tuple(auto)
        self.axes = None if axes is None else tuple(axes)

    def tree_flatten_with_keys(self):
        """The pytree protocol: ``value`` under the key ``.value``; the others static."""
        return ((jax.tree_util.GetAttrKey("value"), self.value),), (self.dim, self.auto, self.axes)

    def tree_flatten(self):
        """The pytree protocol: ``value`` is the only child."""
        return (self.value,), (self.dim, self.auto, self.axes)

    @classmethod
    def tree_unflatten(cls, aux, children):
        """The pytree protocol: a `ShardedParam` of ``children[0]``, unchecked."""
        node = object.__new__(cls)  # no validation: children may be anything jax puts there
        node.value, (node.dim, node.auto, node.axes) = children[0], aux
        return node

    def like(self, value: Any, dim: Any = ..., auto: Any = ...) -> ShardedParam:
        """A `ShardedParam` of ``value`` split as this one (``dim`` and ``auto`` as given)."""
        dim = self.dim if dim is ... else dim
        return ShardedParam(value, dim, self.auto if auto is ... else auto, self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of ``value``: the parameter's outside a step, this replica's part inside."""
        return tuple(getattr(self.value, "shape", ()))

    def __repr__(self) -> str:
        return f"ShardedParam(shape={self.shape}, dim={self.dim})"

    def _refuse(self, what: str):
        shape = list(self.shape)
        n = collectives.num_replicas()  # inside a step, value is this replica's part
        if self.dim is not None and shape:
            shape[self.dim] *= n
        raise TypeError(_NOT_GATHERED.format(shape=tuple(shape), what=what))

    def __jax_array__(self):
        self._refuse("converted to an array")

    def __array__(self, *args, **kwargs):
        self._refuse("converted to an array")

    def __getitem__(self, index):
        self._refuse("indexed")

    def __getattr__(self, name: str):
        if name in ("dtype", "ndim", "T", "astype", "reshape", "sum", "mean"):
            self._refuse(f".{name}")
        raise AttributeError(name)


def _binary(symbol: str):
    def refuse(self, other):
        self._refuse(f"the operator {symbol}")

    return refuse


for _name, _symbol in [
    ("matmul", "@"),
    ("add", "+"),
    ("sub", "-"),
    ("mul", "*"),
    ("truediv", "/"),
    ("pow", "**"),
]:
    setattr(ShardedParam, f"__{_name}__", _binary(_symbol))
    setattr(ShardedParam, f"__r{_name}__", _binary(_symbol))


def is_sharded_param(x) -> bool:
    """Whether ``x`` is a `ShardedParam` (the ``is_leaf`` of tree maps that stop at them)."""
    return isinstance(x, ShardedParam)


def has_sharded_params(tree: PyTree) -> bool:
    """Whether any leaf of ``tree`` is a `ShardedParam`."""
    return any(map(is_sharded_param, jax.tree.leaves(tree, is_leaf=is_sharded_param)))


def values(tree: PyTree) -> PyTree:
    """``tree`` with each `ShardedParam` replaced by its ``value`` (the parameter itself)."""
    return jax.tree.map(
        lambda x: x.value if isinstance(x, ShardedParam) else x, tree, is_leaf=is_sharded_param
    )


def gather_params(tree: PyTree) -> PyTree:
    """The full parameters of the `ShardedParam` leaves of ``tree``, all-gathered over replicas.

    Call it inside ``step_fn``'s forward pass, as late as possible: per layer, inside the layer
    scan, so that only one layer's full parameters exist at a time (ZeRO-3 / FSDP). Autodiff turns
    the all-gather into a reduce-scatter of the gradients. Both move data over the replica axes
    only: a parameter split over ``model`` stays split over it. Other leaves pass through, so
    the same code runs on one device with plain parameters.

    Args:
      tree: a pytree of parameters, some of them `ShardedParam`.

    Returns:
      ``tree`` with each `ShardedParam` replaced by the whole parameter (each device's own
      part of it over ``model``); a leaf kept in host memory (`rp.to_host`) is copied to the
      device first.

    >>> import jax.numpy as jnp, replicator as rp
    >>> rp.gather_params({"w": rp.ShardedParam(jnp.arange(3.0), -1)})["w"]   # one replica
    Array([0., 1., 2.], dtype=float32)
    """

    def gather(node):
        if _gathers_itself(node):  # ZeRO-3's packed stages: their whole rows
            return node.gathered()
        if not isinstance(node, ShardedParam):
            return placement.to_device(node)
        value = placement.to_device(node.value)  # kept in host memory: `rp.to_host`
        if node.dim is None:
            return value
        with only(node.axes):  # hybrid ZeRO: inside the slice
            whole = collectives.gather_replicas(value, node.dim, node.auto)
        return checkpoint_name(whole, GATHERED)

    return jax.tree.map(gather, tree, is_leaf=lambda x: is_sharded_param(x) or _gathers_itself(x))


def _gathers_itself(x: Any) -> bool:
    """A node that stores parameters split in a layout of its own, with a ``gathered()``."""
    return callable(getattr(type(x), "gathered", None))


GATHERED = "replicator_gathered_params"
"""The ``jax.ad_checkpoint.checkpoint_name`` of every parameter `gather_params` gathers."""


def regather_policy():
    """A ``jax.checkpoint`` policy that gathers ZeRO-3's parameters again in the backward pass.

    It saves everything for the backward pass but the parameters `gather_params` gathered:
    FSDP's ``reshard_after_forward``. Without it, the backward pass of a layer scan keeps every
    layer's gathered weights (the whole model, 1/T of it with ``model``): 2 Psi words on the
    wire per step. With it, each layer's weights are gathered again in the backward pass
    instead (3 Psi words, only one layer's weights whole at a time), and nothing else is
    recomputed. ``gpt.blocks`` applies it; wrap your own layer with it::

        step = jax.checkpoint(layer, policy=rp.regather_policy(), prevent_cse=False)
        h, _ = jax.lax.scan(step, h, params["layers"])

    Returns:
      A policy: a function ``jax.checkpoint`` calls on each primitive.

    >>> import jax, replicator as rp
    >>> policy = rp.regather_policy()   # a function jax.checkpoint calls on each primitive
    >>> callable(policy)
    True
    """
    return _save_all_but_gathers


def _save_all_but_gathers(prim, *_, **params) -> bool:
    """Whether ``jax.checkpoint`` may keep an output of ``prim`` for the backward pass: all but
    all-gathers (and the ``shard_map`` over ``model`` that wraps one, `gather_replicas`)."""
    if prim.name == "all_gather":
        return False
    if prim.name == "shard_map":
        body = getattr(params.get("jaxpr"), "eqns", None) or getattr(
            getattr(params.get("jaxpr"), "jaxpr", None), "eqns", ()
        )
        return [e.primitive.name for e in body] != ["all_gather"]
    return not (prim.name == "name" and params.get("name") == GATHERED)


def take_rows(table: Any, indices: jax.Array, dtype: Any = None) -> jax.Array:
    """``table[indices]`` (as ``dtype``), for a ``[V, D]`` table stored whole or as a ZeRO-3
    `ShardedParam`: the embedding lookup, with JAX's index rules (negative indices count from
    the end, others are clamped to ``[0, V)``).

    A table split over the replicas is not gathered. Every replica's indices are gathered
    (``R n`` integers, ``n`` a replica's), and:

    * split by columns (``[V, D / R]`` a replica, MaxText's FSDP embedding): each replica looks
      up its columns of all ``R n`` rows, and one all-to-all gives each its own ``n`` rows
      whole: ``(R - 1) n D / R`` elements of ``dtype`` each way on the wire;
    * split by rows (``[V / R, D]``, Megatron's vocabulary-parallel embedding): each replica
      looks up the rows it holds (zeros for the others, so each sum has one non-zero term and
      is exact in any dtype), and a reduce-scatter returns each replica its own ``n``:
      ``(R - 1) n D`` elements each way.

    Either way the table's gradient is the replica's part only, not a ``[V, D]`` array
    reduce-scattered, and nothing of the table's size moves. Gathering the table moves ``(R -
    1) V D / R`` elements: it is gathered (and indexed) where that is fewer (``n >= V`` by
    columns, ``R n >= V`` by rows), and where the table is split over ``model`` too.

    >>> import jax.numpy as jnp
    >>> take_rows(jnp.arange(6.0).reshape(3, 2), jnp.array([2, -1, 7]))   # one replica
    Array([[4., 5.],
           [4., 5.],
           [4., 5.]], dtype=float32)
    """
    with only(table.axes if isinstance(table, ShardedParam) else None):
        return _take_rows(table, indices, dtype)


def _take_rows(table: Any, indices: jax.Array, dtype: Any) -> jax.Array:
    if not _looked_up_in_parts(table, indices):
        whole = gather_params(table)
        out = whole[in_range(indices, whole.shape[0])]
        return out if dtype is None else out.astype(dtype)
    part, r = table.value, collectives.num_replicas()
    rows = part.shape[0] if table.dim == -1 else part.shape[0] * r
    every = collectives.gather_replicas(in_range(indices, rows).reshape(-1), 0)  # [R n]
    if table.dim == -1:  # this replica's columns of every row, then each its own rows
        return _columns_of_every_row(part, every, dtype).reshape(*indices.shape, -1)
    n = part.shape[0]  # replica i holds rows i n onwards
    local = every - collectives.replica_id() * n
    local = jnp.where((local >= 0) & (local < n), local, n)  # others' rows: out of bounds
    found = part.at[local].get(mode="fill", fill_value=0)  # zeros there (dropped backward)
    found = found if dtype is None else found.astype(dtype)
    out = collectives.scatter_replicas(found, 0)  # [n, D]: this replica's indices' rows
    return out.reshape(*indices.shape, part.shape[1])


# The largest lookup of a table split by columns done at once, in bytes as a TPU lays it out
# (a replica's columns padded to 128 lanes, in fp32): `_columns_of_every_row` looks up a
# larger one in chunks, as few as bring each within it. Each chunk's lookup, all-to-all and
# scatter hold buffers of their own: on Llama 3.1 8B / v6e-256 (a 4 GiB lookup) the step's
# peak is 12.64 GiB whole, 10.58 in 2 chunks, 11.03 in 4 and 11.10 in 16; on Llama 2 70B /
# v5p-512 (2 GiB) 83.54 GiB whole and 83.81 in 8.
LOOKUP_CHUNK_BYTES = 2 * 2**30


def lookup_chunks(*, rows: int, columns: int, n: int) -> int:
    """The chunks `_columns_of_every_row` looks ``rows`` rows of ``columns`` columns up in:
    the fewest that divide a replica's ``n`` rows and bring a chunk within `LOOKUP_CHUNK_BYTES`
    as a TPU lays it out (fp32, the columns padded to 128 lanes); ``n`` if none does.

    >>> lookup_chunks(rows=256 * 32768, columns=16, n=32768)   # Llama 3 8B on 256 chips
    2
    """
    padded = rows * -(-columns // 128) * 128 * 4
    return next(k for k in range(1, n + 1) if (n % k == 0 and padded <= LOOKUP_CHUNK_BYTES * k)
                or k == n)  # fmt: skip


def _columns_of_every_row(part: jax.Array, every: jax.Array, dtype: Any) -> jax.Array:
    """``[n, D]``: this replica's ``n`` rows whole, from its columns ``part`` (``[V, D / R]``)
    of every replica's rows ``every`` (``[R n]``, replica-major), looked up and then sent to
    their replicas by one all-to-all.

    The looked-up ``[R n, D / R]`` array is as many elements as the result, but with few
    columns a replica (16 of Llama 3 8B's 4,096 over 256 chips) a TPU pads it to 128 lanes, and
    its fp32 cotangent, scattered into the table's gradient, is 8 times the result's bytes (4 GiB
    a chip for 4 sequences of 8,192 tokens). Over `LOOKUP_CHUNK_BYTES` it is looked up in ``k``
    chunks by a scan, chunk ``j`` holding each replica's ``j``-th ``n / k`` rows, one
    all-to-all each: the same elements on the wire, ``k`` times fewer live at once, forward and
    backward. The gradient sums the chunks' scatters in fp32: the same terms as one scatter's.
    """
    r, n = collectives.num_replicas(), every.shape[0] // collectives.num_replicas()
    k = lookup_chunks(rows=every.shape[0], columns=part.shape[1], n=n)

    def look_up(rows: jax.Array) -> jax.Array:
        found = part[rows]
        found = found if dtype is None else found.astype(dtype)
        return collectives.replica_all_to_all(found, split=0, concat=1)  # [len(rows) / R, D]

    if k == 1:
        return look_up(every)
    chunks = every.reshape(r, k, n // k).transpose(1, 0, 2).reshape(k, r * (n // k))
    _, out = jax.lax.scan(lambda carry, rows: (carry, look_up(rows)), None, chunks)
    return out.reshape(n, out.shape[-1])  # [k, n / k, D]: chunk j is rows j n / k onwards


def _looked_up_in_parts(table: Any, indices: jax.Array) -> bool:
    """Whether `take_rows` looks ``indices`` up in each replica's part of ``table``: a table
    split over the replicas (and not over ``model``), by columns when a replica has fewer
    indices ``n`` than the table has rows ``V``, by rows when all replicas together have fewer
    (``R n < V``). Otherwise gathering the table moves fewer bytes, and it is gathered."""
    r = collectives.num_replicas()
    if not isinstance(table, ShardedParam) or table.value.ndim != 2 or r == 1:
        return False
    if table.dim not in (-1, -2) or any(e is not None for e in table.auto):
        return False
    n, v = indices.size, table.value.shape[0] * (r if table.dim == -2 else 1)
    return n < v if table.dim == -1 else r * n < v


def in_range(indices: jax.Array, size: int) -> jax.Array:
    """``indices`` as JAX's indexing reads them: negative ones from the end, then clamped."""
    return jnp.clip(jnp.where(indices < 0, indices + size, indices), 0, size - 1)
