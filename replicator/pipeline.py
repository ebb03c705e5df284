"""Pipeline parallelism: micro-batched schedules as one scanned XLA program.

The model is split into stages: identical ones whose parameters are stacked (`stack_stages`),
or stages that differ in function, parameters and shapes (`sequential`), packed into one buffer
per device. Either way they are sharded over the mesh's ``stage`` axis. Inside a ``step_fn``
that ``Replicator.run`` runs on a mesh such as ``{"data": 2, "stage": 4}``, `value_and_grad`
runs a schedule (`GPipe`, `Circular`, `OneFOneB`, `Interleaved1F1B`, `ZeroBubble`) over the micro-batches of each
replica's batch; the ``rp`` collectives in ``step_fn`` still reduce over ``data`` only. Without
a ``stage`` axis the same call runs the stages in order on one device: that is its meaning, and
the oracle it is tested against. `step_time` models a schedule's step on parallel hardware from
each stage's measured costs (`stage_costs`).
"""

from replicator._src.core.deprecation import moved_names as _moved_names
from replicator._src.pipeline import remat as _remat
from replicator._src.pipeline.costs import layer_costs as layer_costs
from replicator._src.pipeline.costs import stage_costs as stage_costs
from replicator._src.pipeline.costs import stage_costs_stacked as stage_costs_stacked
from replicator._src.pipeline.engine import apply as apply
from replicator._src.pipeline.engine import value_and_grad as value_and_grad
from replicator._src.pipeline.layer_stack import scan_layers as scan_layers
from replicator._src.pipeline.partition import Partition as Partition
from replicator._src.pipeline.partition import balance as balance
from replicator._src.pipeline.partition import stack_stages as stack_stages
from replicator._src.pipeline.partition import stage_spec as stage_spec
from replicator._src.pipeline.partition import unstack_stages as unstack_stages
from replicator._src.pipeline.pictures import render as render
from replicator._src.pipeline.remat import Remat as Remat
from replicator._src.pipeline.schedules import Circular as Circular
from replicator._src.pipeline.schedules import GPipe as GPipe
from replicator._src.pipeline.schedules import Interleaved1F1B as Interleaved1F1B
from replicator._src.pipeline.schedules import OneFOneB as OneFOneB
from replicator._src.pipeline.schedules import Timetable as Timetable
from replicator._src.pipeline.schedules import ZeroBubble as ZeroBubble
from replicator._src.pipeline.stages import SequentialStages as SequentialStages
from replicator._src.pipeline.stages import sequential as sequential
from replicator._src.pipeline.stages import stages_from_layers as stages_from_layers
from replicator._src.pipeline.timing import StageCosts as StageCosts
from replicator._src.pipeline.timing import StepTime as StepTime
from replicator._src.pipeline.timing import step_time as step_time

REMAT_ACTIVATIONS = _remat.ACTIVATIONS  # the activations the decoder names, for remat by name
REMAT_PRESETS = _remat.PRESETS  # MaxText's presets: (saved on device, offloaded to the host)
remat_policy = _remat.as_remat  # a Remat for "full", "save_dot_except_mlpwi", {name: action}, ...

__getattr__ = _moved_names(
    "replicator.pipeline",
    {
        "Plan": "replicator.pipeline.Timetable",
        "Sequential": "replicator.pipeline.SequentialStages",
    },
)  # renamed: one release
