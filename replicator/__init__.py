"""replicator: in-graph replication for JAX.

Write ``input_fn`` and a one-replica ``step_fn``; ``Replicator`` runs the step on every device as
one compiled program. The top level holds what a training script needs; the planner, TPU
targets and the training run's plumbing are namespaces: `replicator.planner`,
`replicator.targets` and `replicator.training`. See ``README.md`` and the guides in
``docs/guides/``.
"""

from replicator import attention as attention
from replicator import distributed as distributed
from replicator import moe as moe
from replicator import pipeline as pipeline
from replicator import planner as planner
from replicator import targets as targets
from replicator import training as training
from replicator._src.context import Replicator as Replicator
from replicator._src.context import current as current
from replicator._src.context import local_row as local_row
from replicator._src.core.binding import replica_axis_name as replica_axis_name
from replicator._src.core.collectives import all_gather as all_gather
from replicator._src.core.collectives import all_reduce as all_reduce
from replicator._src.core.collectives import broadcast as broadcast
from replicator._src.core.collectives import num_replicas as num_replicas
from replicator._src.core.collectives import reduce_scatter as reduce_scatter
from replicator._src.core.collectives import replica_id as replica_id
from replicator._src.core.data import Batches as Batches
from replicator._src.core.data import DistributedIterator as DistributedIterator
from replicator._src.core.data import InputContext as InputContext
from replicator._src.core.deprecation import moved_names as _moved_names
from replicator._src.core.errors import ReplicasDivergedError as ReplicasDivergedError
from replicator._src.core.placement import to_device as to_device
from replicator._src.core.placement import to_host as to_host
from replicator._src.core.precision import Policy as Policy
from replicator._src.core.sharded_params import ShardedParam as ShardedParam
from replicator._src.core.sharded_params import gather_params as gather_params
from replicator._src.core.sharded_params import regather_policy as regather_policy
from replicator._src.core.targets import quiet_libtpu as _quiet_libtpu
from replicator._src.core.targets import tpu_devices as tpu_devices
from replicator._src.optim.optimizer import DistributedOptimizer as DistributedOptimizer
from replicator._src.optim.zero_plan import ZeroPlan as ZeroPlan
from replicator._src.planner.planning import plan as plan
from replicator._src.report.step_report import StepReport as StepReport
from replicator._src.training.checkpoint import Checkpoints as Checkpoints
from replicator._src.training.checkpoint import StateMismatchError as StateMismatchError
from replicator._src.training.full_disk import CheckpointWriteError as CheckpointWriteError
from replicator._src.training.loop import NonFiniteError as NonFiniteError
from replicator._src.training.loop import fit as fit

__version__ = "0.1.0"

# Names that moved to a namespace or were renamed: served for one release, with a warning.
__getattr__ = _moved_names(
    "replicator",
    {
        "Candidate": "replicator.planner.Candidate",
        "DoesNotFitError": "replicator.targets.DoesNotFitError",
        "Family": "replicator.planner.Ladder",
        "FitResult": "replicator.training.FitResult",
        "HARDWARE": "replicator.planner.HARDWARE_PROFILES",
        "Hardware": "replicator.planner.Hardware",
        "Layout": "replicator.planner.Layout",
        "MetricWriter": "replicator.training.MetricWriter",
        "ModelShape": "replicator.planner.ModelShape",
        "OnTarget": "replicator.targets.TargetReport",
        "PlanReport": "replicator.planner.PlanReport",
        "Price": "replicator.planner.Price",
        "Profile": "replicator.training.Profile",
        "RunDirLockedError": "replicator.training.RunDirLockedError",
        "Target": "replicator.targets.Target",
        "TensorBoardWriter": "replicator.training.TensorBoardWriter",
        "WandbWriter": "replicator.training.WandbWriter",
        "enumerate_layouts": "replicator.planner.enumerate_layouts",
        "hardware": "replicator.planner.hardware_profile",
        "target": "replicator.targets.tpu_target",
    },
)

_quiet_libtpu()  # before JAX starts its backends: libtpu's warnings mean nothing on a CPU host
