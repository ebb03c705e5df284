"""Plan a layout: the layouts of a model on N devices, compiled from shapes (or priced from
formulas) and ranked by modelled step time on a hardware profile.

>>> from replicator import planner
>>> planner.hardware_profile("tpu-v5p").name
'tpu-v5p'
"""

from replicator._src.planner.layouts import Ladder as Ladder
from replicator._src.planner.layouts import Layout as Layout
from replicator._src.planner.layouts import enumerate_layouts as enumerate_layouts
from replicator._src.planner.model_shape import ModelShape as ModelShape
from replicator._src.planner.planning import Candidate as Candidate
from replicator._src.planner.planning import PlanReport as PlanReport
from replicator._src.planner.planning import plan as plan
from replicator._src.planner.pricing import Price as Price
from replicator._src.report.hardware import HARDWARE_PROFILES as HARDWARE_PROFILES
from replicator._src.report.hardware import Hardware as Hardware
from replicator._src.report.hardware import hardware_profile as hardware_profile
