"""The training run: `fit`, its options, its results, checkpoints, writers and errors.

`fit`'s option records (`CheckpointOptions`, `LoggingOptions`, `EvalOptions`), what it returns
(`FitResult`), its checkpoints, metric writers and profiles, and the errors a run raises.
"""

from replicator._src.training.checkpoint import Checkpoints as Checkpoints
from replicator._src.training.checkpoint import StateMismatchError as StateMismatchError
from replicator._src.training.full_disk import CheckpointWriteError as CheckpointWriteError
from replicator._src.training.loop import FitResult as FitResult
from replicator._src.training.loop import NonFiniteError as NonFiniteError
from replicator._src.training.loop import fit as fit
from replicator._src.training.options import CheckpointOptions as CheckpointOptions
from replicator._src.training.options import EvalOptions as EvalOptions
from replicator._src.training.options import LoggingOptions as LoggingOptions
from replicator._src.training.preflight import RestoreCheck as RestoreCheck
from replicator._src.training.preflight import check_restore as check_restore
from replicator._src.training.profiling import Profile as Profile
from replicator._src.training.rundir import RunDirLockedError as RunDirLockedError
from replicator._src.training.writers import MetricWriter as MetricWriter
from replicator._src.training.writers import TensorBoardWriter as TensorBoardWriter
from replicator._src.training.writers import WandbWriter as WandbWriter
