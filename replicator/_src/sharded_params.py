"""ZeRO-3's stored parameters: `ShardedParam`, and `gather_params`, which makes them whole.

A `ShardedParam` is one parameter flattened, padded to ``N * c`` elements and sharded over the
replicas along its last axis (``zero.Zero.shard_params`` makes them). ``step_fn`` gathers them
with `gather_params` in the forward pass, as late as possible, and autodiff turns that
all-gather into a reduce-scatter of the gradients. Used as an array without being gathered, a
`ShardedParam` raises a ``TypeError`` that says to gather it.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from replicator._src import collectives
from replicator._src.typing import PyTree

_NOT_GATHERED = """\
rp.ShardedParam: parameter of shape {shape} is stored sharded (ZeRO-3) and must be gathered \
before it is used ({what}). Call rp.gather_params in the forward pass, as late as possible \
(per layer, inside the layer scan):

    def loss_fn(params, batch):
        params = rp.gather_params(params)      # full parameters, all-gathered over the replicas
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)"""


@jax.tree_util.register_pytree_node_class
class ShardedParam:
    """A parameter stored ZeRO-3 style: flattened, padded to ``N * c`` and sharded over the
    replicas along its last axis (leading axes, such as a stacked layer axis, are kept).

    ``shape`` is the shape of one un-stacked parameter; `gather_params` rebuilds it. As a pytree
    node its only child is ``flat``, so ``jax.grad``, optax and ``lax.scan`` see a plain array.
    Used as an array without `gather_params` (``x @ w``, ``w + 1``, ``jnp.dot``), it raises a
    ``TypeError`` that says to gather it.
    """

    def __init__(self, flat: Any, shape: tuple[int, ...]) -> None:
        self.flat = flat
        self.shape = tuple(shape)

    def tree_flatten(self):
        return (self.flat,), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(children[0], shape)

    def __repr__(self) -> str:
        return f"ShardedParam(shape={self.shape}, flat={getattr(self.flat, 'shape', self.flat)})"

    def _refuse(self, what: str):
        raise TypeError(_NOT_GATHERED.format(shape=self.shape, what=what))

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


def gather_params(tree: PyTree) -> PyTree:
    """The full parameters of the `ShardedParam` leaves of ``tree``, all-gathered over replicas.

    Call it inside ``step_fn``'s forward pass, as late as possible: per layer, inside the layer
    scan, so that only one layer's full parameters exist at a time (ZeRO-3 / FSDP). Autodiff turns
    the all-gather into a reduce-scatter of the gradients. Other leaves pass through.

    >>> import jax.numpy as jnp, replicator as rp
    >>> rp.gather_params({"w": rp.ShardedParam(jnp.arange(4.0), (3,))})["w"]   # one replica
    Array([0., 1., 2.], dtype=float32)
    """

    def gather(node):
        if not isinstance(node, ShardedParam):
            return node
        flat = collectives.all_gather(node.flat, axis=node.flat.ndim - 1, tiled=True)
        size = math.prod(node.shape)
        return flat[..., :size].reshape((*flat.shape[:-1], *node.shape))

    return jax.tree.map(gather, tree, is_leaf=is_sharded_param)
