"""replicator: in-graph replication for JAX.

Write ``input_fn`` and a one-replica ``step_fn``; ``Replicator`` runs the step on every device as
one compiled program. See ``README.md`` and the guides in ``docs/guides/``.
"""

from replicator import attention as attention
from replicator import distributed as distributed
from replicator import moe as moe
from replicator import pipeline as pipeline
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
from replicator._src.core.errors import DoesNotFitError as DoesNotFitError
from replicator._src.core.errors import ReplicasDivergedError as ReplicasDivergedError
from replicator._src.core.precision import Policy as Policy
from replicator._src.core.sharded_params import ShardedParam as ShardedParam
from replicator._src.core.sharded_params import gather_params as gather_params
from replicator._src.core.sharded_params import regather_policy as regather_policy
from replicator._src.core.targets import Target as Target
from replicator._src.core.targets import quiet_libtpu as _quiet_libtpu
from replicator._src.core.targets import target as target
from replicator._src.core.targets import tpu_devices as tpu_devices
from replicator._src.optim.optimizer import DistributedOptimizer as DistributedOptimizer
from replicator._src.optim.zero_plan import ZeroPlan as ZeroPlan
from replicator._src.planner.layouts import Family as Family
from replicator._src.planner.layouts import Layout as Layout
from replicator._src.planner.layouts import enumerate_layouts as enumerate_layouts
from replicator._src.planner.model_shape import ModelShape as ModelShape
from replicator._src.planner.planning import Candidate as Candidate
from replicator._src.planner.planning import PlanReport as PlanReport
from replicator._src.planner.planning import plan as plan
from replicator._src.planner.pricing import Price as Price
from replicator._src.report.hardware import HARDWARE as HARDWARE
from replicator._src.report.hardware import Hardware as Hardware
from replicator._src.report.hardware import hardware as hardware
from replicator._src.report.on_target import OnTarget as OnTarget
from replicator._src.report.step_report import StepReport as StepReport
from replicator._src.training.checkpoint import Checkpoints as Checkpoints
from replicator._src.training.checkpoint import StateMismatchError as StateMismatchError
from replicator._src.training.full_disk import CheckpointWriteError as CheckpointWriteError
from replicator._src.training.loop import FitResult as FitResult
from replicator._src.training.loop import NonFiniteError as NonFiniteError
from replicator._src.training.loop import fit as fit
from replicator._src.training.profiling import Profile as Profile
from replicator._src.training.rundir import RunDirLockedError as RunDirLockedError
from replicator._src.training.writers import MetricWriter as MetricWriter
from replicator._src.training.writers import TensorBoardWriter as TensorBoardWriter
from replicator._src.training.writers import WandbWriter as WandbWriter

__version__ = "0.1.0"

_quiet_libtpu()  # before JAX starts its backends: libtpu's warnings mean nothing on a CPU host
