"""Mixture of experts with expert parallelism, exact on every mesh.

Tokens are routed per sequence (group) to their ``top_k`` experts within a capacity, the experts
split over the mesh's ``expert`` axis and the tokens carried to them by ``all_to_all``. Each
group is routed, dropped and balanced as on one device (see `replicator._src.sharded.experts`).

>>> import jax
>>> from replicator import moe
>>> params = moe.init(jax.random.key(0), d_model=8, hidden=16, num_experts=4)
>>> y, stats = moe.apply(params, jax.numpy.ones((2, 4, 8)), routing=moe.Routing(num_experts=4))
>>> y.shape, stats.aux_loss.shape
((2, 4, 8), (2,))
"""

from replicator._src.core.deprecation import moved_names as _moved_names
from replicator._src.sharded.experts import LOGICAL_AXES as LOGICAL_AXES
from replicator._src.sharded.experts import apply as apply
from replicator._src.sharded.experts import init as init
from replicator._src.sharded.experts import logical_axes_for as logical_axes_for
from replicator._src.sharded.experts import partition_specs as partition_specs
from replicator._src.sharded.routing import Routing as Routing
from replicator._src.sharded.routing import Stats as Stats

__getattr__ = _moved_names(
    "replicator.moe", {"logical_axes": "replicator.moe.logical_axes_for"}
)  # renamed: one release
