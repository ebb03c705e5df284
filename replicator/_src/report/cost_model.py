"""The modelled step time of a compiled layout on a hardware profile.

The program says what one device does per step: its FLOPs, every collective with the mesh axes
it spans and the bytes it sends, and each pipeline's idle share. The hardware profile says how
fast a device does each. Nothing else is assumed about the model::

    compute       = sum over kernels of max(FLOPs / peak_flops, bytes / bandwidth)
                    bandwidth: the cache's for the share of a step's bytes that its
                    temporaries' fit in the profile's cache, else hbm_bandwidth
                                                          (shared devices: all devices')
    bubble        = idle FLOPs of a pipeline that skips its idle ticks (1F1B, interleaved,
                    ZeroBubble) / peak_flops
    communication = sum over collectives of  wire bytes / bandwidth of the link it crosses
                                           + executions * collective_latency
    step          = compute + bubble + communication - hidden

A collective crosses the DCN when the device groups of one of its axes span more devices than
an island holds (the mesh is laid out with its last axis fastest, as ``jax.make_mesh`` does),
else it runs over ICI/NVLink. That holds for every axis alike: the ``context`` axis's ring
(collective-permutes of K/V blocks and, backward, of their gradients) and all-to-alls, and the
``expert`` axis's all-to-alls (tokens to their experts and back) are priced from the compiled
program's bytes at the bandwidth of the link their groups cross, as ``model``'s all-reduces are.

``hidden`` is the share ``overlap`` of the gradient reductions, at most the compute time, that
runs behind compute: every collective over the data axes (gradient reduction and ZeRO's
gathers), and the all-reduces and reduce-scatters over the token axes (``context``,
``expert``, which split each replica's tokens as a data axis does: their reductions sum the
parameters' gradients). Collectives over ``model`` and ``stage``, and the token axes'
all-to-alls, collective-permutes and all-gathers (activations), sit on the critical path and
are always exposed.

What the model leaves out is said in docs/guides/explain_and_plan.md ("What the time model
includes"): kernel efficiency below peak, memory-bound operations at HBM speed, host input, and
launch overheads other than the per-collective latency.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from replicator._src.report.hardware import Hardware

# Axes whose collectives reduce gradients or gather ZeRO shards: what `overlap` may hide.
DATA_AXES = frozenset({"data", "dcn_data"})
# Axes that split a replica's tokens: their reductions (with the data axes') are gradient sums,
# which `overlap` may hide too; their other collectives move activations.
TOKEN_AXES = frozenset({"context", "expert"})
REDUCTIONS = frozenset({"all-reduce", "reduce-scatter"})
# Schedules with explicit backward ticks, which skip their idle passes under lax.cond: their
# bubble is idle time, not in the FLOPs. GPipe and circular compute through theirs.
SKIPS_IDLE = frozenset({"1f1b", "interleaved", "zerobubble"})


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """A collective as the cost model needs it: one device's view, per step."""

    kind: str
    axes: tuple[str, ...]
    wire_bytes: float  # bytes one device sends per step (ring algorithms), all executions
    count: float  # executions per step
    across: bool = False  # read as a TPU program's part across slices (`hlo.Collective`)


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """What the compiled program of one layout does per device per step (from `StepReport`).

    Attributes:
      mesh: the mesh's axes and sizes, in layout order (the last axis is the fastest).
      memory: bytes per device: ``arguments``, ``outputs``, ``aliased``, ``temporaries`` and
        ``peak``.
      flops: FLOPs per device per step, loops counted per trip.
      collectives: every collective (`CollectiveCost`).
      idle_flops: a pipeline's idle time on each device, in FLOPs at the stages' rate, where the
        schedule skips its idle ticks (1F1B, interleaved 1F1B, ZeroBubble: `SKIPS_IDLE`); 0
        where the program computes through them (GPipe, circular: already in ``flops``).
      bubble: the pipelines' modelled idle share (0 without a pipeline).
      compile_seconds: time to build, trace and compile.
      bytes_accessed: memory the kernels read and write per step (`StepReport.bytes_accessed`).
      roofline: the kernels' ``(FLOPs, bytes)`` by arithmetic intensity (`StepReport.roofline`).
      host_bytes: bytes moved between host and device memory per step (`StepReport.host_bytes`).
      kernel_flops: the share of ``flops`` in Pallas kernels (`StepReport.kernel_flops`).
    """

    mesh: dict[str, int]
    memory: dict[str, int]
    flops: float
    collectives: tuple[CollectiveCost, ...]
    idle_flops: float = 0.0
    bubble: float = 0.0
    compile_seconds: float = 0.0
    bytes_accessed: float = 0.0
    roofline: tuple[tuple[float, float], ...] = ()
    host_bytes: float = 0.0
    kernel_flops: float = 0.0

    @classmethod
    def from_report(cls, report: Any) -> CompiledStep:
        """The figures of a `StepReport` that the cost model reads."""
        idle = 0.0
        bubble = 0.0
        for p in report.pipelines:
            bubble = max(bubble, p.modelled_bubble)
            if p.schedule not in SKIPS_IDLE:
                continue  # GPipe and circular compute through their bubbles: in the FLOPs
            if p.cost_unit == "flops" and p.modelled_time > 0:
                idle += p.modelled_time * p.modelled_bubble
            elif p.modelled_bubble < 1:  # equal costs: the idle share of the device's FLOPs
                idle += report.flops * p.modelled_bubble / (1 - p.modelled_bubble)
        m = report.memory
        return cls(
            mesh=dict(report.mesh),
            memory={
                "arguments": m.arguments,
                "outputs": m.outputs,
                "aliased": m.aliased,
                "temporaries": m.temporaries,
                "peak": m.peak,
                "host": getattr(m, "host", 0),
            },
            flops=float(report.flops),
            collectives=tuple(
                CollectiveCost(
                    c.kind,
                    tuple(c.axes),
                    float(c.wire_bytes),
                    float(c.count),
                    bool(getattr(c, "across", False)),
                )
                for c in report.collectives
            ),
            idle_flops=float(idle),
            bubble=float(bubble),
            compile_seconds=float(report.compile_seconds),
            bytes_accessed=float(getattr(report, "bytes_accessed", 0.0)),
            roofline=tuple(tuple(map(float, k)) for k in getattr(report, "roofline", ())),
            host_bytes=float(getattr(report, "host_bytes", 0.0)),
            kernel_flops=float(getattr(report, "kernel_flops", 0.0)),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> CompiledStep:
        raw = dict(raw)
        raw["roofline"] = tuple(tuple(k) for k in raw.get("roofline", ()))
        raw["collectives"] = tuple(
            CollectiveCost(
                c["kind"], tuple(c["axes"]), c["wire_bytes"], c["count"], c.get("across", False)
            )
            for c in raw["collectives"]
        )
        return cls(**raw)


@dataclasses.dataclass(frozen=True)
class ModelledTime:
    """One step's modelled time on a hardware profile, in seconds, and its parts.

    Attributes:
      compute: the kernels at the roofline: FLOPs at the hardware's peak, or their bytes at its
        memory bandwidth, whichever takes longer, kernel by kernel.
      bubble: pipeline idle time that is not in the FLOPs.
      ici: collective time over the fast interconnect (with latency).
      dcn: collective time across islands (with latency).
      hidden: collective and host-transfer time that runs behind compute (``overlap``).
      total: ``compute + bubble + ici + dcn + host - hidden``.
      mfu: model FLOPs utilisation: the model's own FLOPs per step over what the devices could
        do at peak in ``total``; None without the model's FLOPs.
      host: the transfers between host and device memory (offloaded activations) at the
        profile's ``host_bandwidth``; asynchronous, so they may hide behind compute as the data
        axes' collectives do.
    """

    compute: float
    bubble: float
    ici: float
    dcn: float
    hidden: float
    total: float
    mfu: float | None = None
    host: float = 0.0

    @property
    def communication(self) -> float:
        return self.ici + self.dcn


def crosses_dcn(axes: tuple[str, ...], mesh: dict[str, int], island_size: int) -> bool:
    """Whether a collective over ``axes`` of ``mesh`` reaches beyond one island.

    The mesh's last axis varies fastest over the devices; an axis's groups span its size times
    the sizes of the axes after it.

    >>> crosses_dcn(("model",), {"data": 4, "model": 8}, island_size=8)
    False
    >>> crosses_dcn(("data",), {"data": 4, "model": 8}, island_size=8)
    True
    """
    names = list(mesh)
    for axis in axes:
        if axis not in mesh:
            continue
        stride = math.prod(mesh[a] for a in names[names.index(axis) + 1 :])
        if mesh[axis] > 1 and stride * mesh[axis] > island_size:
            return True
    return False


def far(step: CompiledStep, island_size: int) -> list[bool]:
    """Whether each collective of ``step`` crosses the DCN: in a TPU program of several
    slices, its parts across them (`CollectiveCost.across`: the rest stay inside a slice,
    whatever axis they are over); else by `crosses_dcn`."""
    if any(c.across for c in step.collectives):
        return [c.across for c in step.collectives]
    return [crosses_dcn(c.axes, step.mesh, island_size) for c in step.collectives]


def hideable(c: CollectiveCost) -> bool:
    """Whether ``c`` is a gradient reduction that `model_time`'s ``overlap`` may hide: any
    collective over the data axes only, or a reduction over data and token axes.

    >>> hideable(CollectiveCost("all-reduce", ("context",), 1.0, 1))
    True
    >>> hideable(CollectiveCost("all-to-all", ("expert",), 1.0, 1))
    False
    """
    axes = set(c.axes)
    if not axes:
        return False
    return axes <= DATA_AXES or (c.kind in REDUCTIONS and axes <= DATA_AXES | TOKEN_AXES)


def kernel_time(step: CompiledStep, hardware: Hardware) -> float:
    """One device's compute time: each group of kernels of like intensity at the roofline,
    ``max(FLOPs / (peak_flops x matmul_efficiency), bytes * seconds_per_byte)``, the Pallas
    kernels' FLOPs at ``kernel_efficiency`` of the peak instead; FLOPs alone without the
    profile's memory bandwidth or the program's kernels.

    A byte costs ``1 / hbm_bandwidth``; with a cache in the profile (``cache_bytes``,
    ``cache_bandwidth``), the share ``hit = min(1, cache_bytes / temporaries)`` of the bytes
    moves at the cache's bandwidth instead: a step whose working set (its temporaries) fits in
    the cache runs at cache speed, one ten times larger mostly at memory speed.

    >>> hw = Hardware("toy", 1e12, 2**30, 1e9, 1e8, 4, hbm_bandwidth=1e11)
    >>> step = CompiledStep({"data": 1}, {}, 3e12, (), roofline=((1e12, 1e12), (2e12, 1e9)))
    >>> kernel_time(step, hw)   # 10 s memory-bound + 2 s compute-bound
    12.0
    >>> fitted = Hardware("toy", 1e12, 2**30, 1e9, 1e8, 4, hbm_bandwidth=1e11,
    ...                   matmul_efficiency=0.5)
    >>> kernel_time(step, fitted)   # the compute-bound kernels at half the peak: 4 s
    14.0
    >>> cached = Hardware("toy", 1e12, 2**30, 1e9, 1e8, 4, hbm_bandwidth=1e11,
    ...                   cache_bytes=2**20, cache_bandwidth=1e12)
    >>> half = CompiledStep({"data": 1}, {"temporaries": 2**21}, 1e12, (), roofline=((1e12, 1e12),))
    >>> kernel_time(half, cached)   # half the bytes at 1e12 B/s, half at 1e11: 5.5 s
    5.5
    """
    rate = hardware.peak_flops * hardware.matmul_efficiency
    # the Pallas kernels' FLOPs at their own share of the peak (compute-bound)
    kernels = step.kernel_flops * (1 / hardware.kernel_efficiency - 1 / hardware.matmul_efficiency)
    kernels /= hardware.peak_flops
    if hardware.hbm_bandwidth is None or not step.roofline:
        return step.flops / rate + kernels
    per_byte = 1 / hardware.hbm_bandwidth
    if hardware.cache_bytes is not None:
        hit = min(1.0, hardware.cache_bytes / max(step.memory.get("temporaries", 0), 1))
        per_byte = hit / hardware.cache_bandwidth + (1 - hit) / hardware.hbm_bandwidth
    return sum(max(f / rate, b * per_byte) for f, b in step.roofline) + kernels


def model_time(
    step: CompiledStep,
    hardware: Hardware,
    *,
    overlap: float = 0.0,
    model_flops: float | None = None,
) -> ModelledTime:
    """The modelled time of one step of ``step`` on ``hardware`` (see the module docstring).

    Args:
      step: the compiled layout's figures.
      hardware: the profile.
      overlap: the share (0 to 1) of the gradient reductions' time (`hideable`: the data-axis
        collectives, and reductions over the token axes) that hides behind compute.
      model_flops: the model's own FLOPs per step over all devices (e.g. ``6 * params *
        tokens``), for the MFU.

    >>> hw = Hardware("toy", peak_flops=1e12, memory_bytes=2**30, ici_bandwidth=1e9,
    ...               dcn_bandwidth=1e8, island_size=4)
    >>> step = CompiledStep(mesh={"data": 8}, memory={}, flops=2e12,
    ...                     collectives=(CollectiveCost("all-reduce", ("data",), 1e8, 1),))
    >>> t = model_time(step, hw, model_flops=8 * 1.5e12)
    >>> t.compute, t.dcn, t.total, round(t.mfu, 3)
    (2.0, 1.0, 3.0, 0.5)
    """
    if not 0 <= overlap <= 1:
        raise ValueError(f"model_time: overlap must be between 0 and 1; got {overlap!r}.")
    devices = math.prod(step.mesh.values())
    scale = devices if hardware.shared else 1  # shared: every device's work on one machine
    compute = scale * kernel_time(step, hardware)
    bubble = 0.0 if hardware.shared else step.idle_flops / hardware.peak_flops
    ici = dcn = data_axes = 0.0
    for c, across in zip(step.collectives, far(step, hardware.island_size), strict=True):
        bandwidth = hardware.dcn_bandwidth if across else hardware.ici_bandwidth
        seconds = scale * c.wire_bytes / bandwidth + c.count * hardware.collective_latency
        if across:
            dcn += seconds
        else:
            ici += seconds
        if hideable(c):
            data_axes += seconds
    host = step.host_bytes / hardware.host_bandwidth if hardware.host_bandwidth else 0.0
    hidden = min(overlap * (data_axes + scale * host), compute)
    total = compute + bubble + ici + dcn + scale * host - hidden
    mfu = None
    if model_flops is not None and total > 0:
        peak = hardware.peak_flops * (1 if hardware.shared else devices)
        mfu = model_flops / (peak * total)
    return ModelledTime(compute, bubble, ici, dcn, hidden, total, mfu, scale * host)
