"""Plan a layout: the layouts of a model on N devices, ranked by modelled step time.

Each layout is compiled from shapes (or first priced from formulas) and its step time modelled
on a hardware profile. `enumerate_layouts` lists a model's layouts, in ladders; its options
come in records (`ModelSizes`, `SearchOptions`, `AxisLimits`), as do `plan`'s
(`TimingOptions`, `PricingOptions`).

>>> from replicator import planner
>>> planner.hardware_profile("tpu-v5p").name
'tpu-v5p'
>>> ladders = planner.enumerate_layouts(
...     8, sizes=planner.ModelSizes(global_batch=16, num_layers=4, num_heads=4),
...     search=planner.SearchOptions(zero_stages=(1,)), limits=planner.AxisLimits(max_stage=1))
>>> str(ladders[0])
'data=8 zero=1'
"""

from replicator._src.planner.enumeration import enumerate_layouts as enumerate_layouts
from replicator._src.planner.layouts import Ladder as Ladder
from replicator._src.planner.layouts import Layout as Layout
from replicator._src.planner.model_shape import ModelShape as ModelShape
from replicator._src.planner.options import AxisLimits as AxisLimits
from replicator._src.planner.options import ModelSizes as ModelSizes
from replicator._src.planner.options import PricingOptions as PricingOptions
from replicator._src.planner.options import SearchOptions as SearchOptions
from replicator._src.planner.options import TimingOptions as TimingOptions
from replicator._src.planner.planning import Candidate as Candidate
from replicator._src.planner.planning import PlanReport as PlanReport
from replicator._src.planner.planning import plan as plan
from replicator._src.planner.pricing import Price as Price
from replicator._src.report.hardware import HARDWARE_PROFILES as HARDWARE_PROFILES
from replicator._src.report.hardware import Hardware as Hardware
from replicator._src.report.hardware import hardware_profile as hardware_profile
