"""Multi-process jobs on JAX's distributed runtime.

`initialize` joins a process to its job; `launch` is the local launcher (restarts, elastic
resizing); `heartbeat` reports a process's progress to it. `ProgramsDifferError` is what
``rp.fit`` raises before its first step when the processes built different step programs.
"""

from replicator._src.distributed.initialize import ProcessInfo as ProcessInfo
from replicator._src.distributed.initialize import heartbeat as heartbeat
from replicator._src.distributed.initialize import initialize as initialize
from replicator._src.distributed.launcher import elastic_size as elastic_size
from replicator._src.distributed.launcher import free_port as free_port
from replicator._src.distributed.launcher import launch as launch
from replicator._src.distributed.programs import ProgramsDifferError as ProgramsDifferError
from replicator._src.distributed.restarts import Restarts as Restarts
