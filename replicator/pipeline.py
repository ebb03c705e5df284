"""Pipeline parallelism: micro-batched schedules as one scanned XLA program.

The model is split into stages of identical structure whose parameters are stacked and sharded
over the mesh's ``stage`` axis. Inside a ``step_fn`` that ``Replicator.run`` runs on a mesh such
as ``{"data": 2, "stage": 4}``, `value_and_grad` runs a schedule (`GPipe`, `Circular`,
`OneFOneB`) over the micro-batches of each replica's batch; the ``rp`` collectives in ``step_fn``
still reduce over ``data`` only. Without a ``stage`` axis the same call runs the stages in order
on one device: that is its meaning, and the oracle it is tested against.
"""

from replicator._src.pipeline.engine import apply as apply
from replicator._src.pipeline.engine import value_and_grad as value_and_grad
from replicator._src.pipeline.layers import scan_layers as scan_layers
from replicator._src.pipeline.partition import Partition as Partition
from replicator._src.pipeline.partition import balance as balance
from replicator._src.pipeline.partition import layer_costs as layer_costs
from replicator._src.pipeline.partition import stack_stages as stack_stages
from replicator._src.pipeline.partition import stage_spec as stage_spec
from replicator._src.pipeline.partition import unstack_stages as unstack_stages
from replicator._src.pipeline.schedules import Circular as Circular
from replicator._src.pipeline.schedules import GPipe as GPipe
from replicator._src.pipeline.schedules import OneFOneB as OneFOneB
from replicator._src.pipeline.schedules import Plan as Plan
from replicator._src.pipeline.schedules import render as render
