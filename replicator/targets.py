"""TPU targets: a TPU slice's devices to compile for, and what a step costs on them.

A target compiles on any machine with libtpu installed (``pip install "replicator[tpu]"``);
``repl.explain`` says what a step costs there.

>>> from replicator import targets
>>> targets.tpu_target("v5p-16")
Target(name='v5p-16', generation='v5p', chips=8, slices=1, topology='v5p:2x2x2')
"""

from replicator._src.core.errors import DoesNotFitError as DoesNotFitError
from replicator._src.core.targets import Target as Target
from replicator._src.core.targets import tpu_devices as tpu_devices
from replicator._src.core.targets import tpu_target as tpu_target
from replicator._src.report.target_report import TargetReport as TargetReport
