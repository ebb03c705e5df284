"""What a step compiled for a TPU target means on that TPU: does it fit, how long, what MFU.

`Replicator.explain` on a target's devices (`replicator.tpu_devices`) reads the TPU program.
This module adds the chip's figures (`hardware.HARDWARE_PROFILES`, each with its public source):

* ``fits``: the program's peak bytes per device (``memory.peak``) within the chip's HBM;
* ``step_seconds``: the roofline of the TPU program (`cost_model.model_time`): each group of
  kernels at ``max(FLOPs / peak, bytes / HBM bandwidth)``, loops counted per trip, every
  collective's wire bytes at the ICI bandwidth (DCN across slices), and the pipelines' idle
  ticks; the data axes' collectives (gradient reductions, ZeRO's gathers) overlap compute, as
  the TPU compiler's asynchronous collectives let them, and every other collective is exposed;
  activations offloaded to host memory move at the chip's host link, and overlap compute too;
* ``xla_seconds``: XLA's own estimate, ``cost_analysis()["optimal_seconds"]``. It counts each
  loop body once, as its FLOPs do; a program with loops has it scaled by the FLOPs counted per
  trip over XLA's FLOPs (``xla_seconds_how`` says which). It does not see into Pallas kernels
  (splash attention): their work is left out, as it is of MaxText's figure, and said. XLA's estimate is idealised, and it
  is negative on v6e with some libtpu releases: it is then None, and said so;
* ``model_flops`` and ``mfu``: the model's own FLOPs per device per step (``6 N T`` plus
  attention, as MaxText counts them), over the roofline's step at the chip's peak.
"""

from __future__ import annotations

import dataclasses
import math

from replicator._src.core import targets
from replicator._src.report import cost_model
from replicator._src.report.hardware import hardware_profile


@dataclasses.dataclass(frozen=True)
class TargetReport:
    """A step's figures on the TPU it was compiled for; per chip and per step.

    Attributes:
      target: the accelerator type, e.g. ``"v5p-16"`` (``"2 x v5p-16"`` for two slices).
      device_kind: JAX's name of the chip, e.g. ``"TPU v5"``.
      slices: TPU slices, joined over the data-centre network.
      hbm_bytes: the chip's HBM.
      peak_bytes: the step's peak bytes per chip (``memory.peak``).
      fits: the step's peak bytes per chip are at most ``hbm_bytes``, and what it offloads
        at most the host's memory per chip (``Hardware.host_memory_bytes``, where known).
      over_bytes: how far the peak is over ``hbm_bytes`` (0 when it fits).
      fit_hint: when it does not fit, the smallest change found that fits (``replicator
        explain`` fills it in: ZeRO stage, ``model``, remat, batch); None otherwise.
      peak_flops: the chip's peak dense bf16 FLOP/s.
      step_seconds: the roofline of the TPU program (see the module docstring), with the chip
        profile's fitted constants (`step_seconds_how`).
      compute_seconds: its kernels' part.
      ici_seconds: its collectives over ICI, before overlap.
      dcn_seconds: its collectives across slices, before overlap.
      hidden_seconds: the data axes' collectives that overlap compute.
      xla_seconds: XLA's estimate, loop trips accounted for (None where it cannot be read).
      xla_seconds_how: how ``xla_seconds`` was read.
      model_flops: the model's FLOPs per chip per step (None: not given).
      mfu: ``model_flops / (step_seconds * peak_flops)``.
      xla_mfu: ``model_flops / (xla_seconds * peak_flops)``.
      hardware: the profile's name, e.g. ``"tpu-v5p"``.
      host_memory_bytes: what the step keeps in its host's memory per chip (offloaded
        activations).
      host_transfer_bytes: bytes moved between host and chip per step.
      host_seconds: those bytes at the chip's host link (``Hardware.host_bandwidth``), before
        overlap; the transfers are asynchronous and hide behind compute with the collectives.
      step_seconds_how: what ``step_seconds`` is: the roofline, or the roofline with the chip
        profile's constants fitted to measured runs (``Hardware.matmul_efficiency``,
        ``kernel_efficiency``, ``overlap``; ``fitted_on`` names the runs).
      dcn_bytes: bytes a chip sends across slices a step (the collectives over ``dcn_data``,
        on the wire), by collective kind.
      dcn_bandwidth: the chip's bytes per second across slices (``Hardware.dcn_bandwidth``).
      optimizer_steps: the optimizer's steps in one step: DiLoCo's ``local_steps``, whose
        step crosses the slices once for that many (1: synchronous).
    """

    target: str
    device_kind: str
    slices: int
    hbm_bytes: int
    peak_bytes: int
    fits: bool
    over_bytes: int
    fit_hint: str | None
    peak_flops: float
    step_seconds: float
    compute_seconds: float
    ici_seconds: float
    dcn_seconds: float
    hidden_seconds: float
    xla_seconds: float | None
    xla_seconds_how: str
    model_flops: float | None
    mfu: float | None
    xla_mfu: float | None
    hardware: str
    host_memory_bytes: int = 0
    host_transfer_bytes: float = 0.0
    host_seconds: float = 0.0
    step_seconds_how: str = "the roofline"
    dcn_bytes: dict = dataclasses.field(default_factory=dict)
    dcn_bandwidth: float = 0.0
    optimizer_steps: int = 1


def _step_how(hw) -> str:
    """What ``step_seconds`` is: the roofline, or it with the profile's fitted constants."""
    fitted = [f"{label} {v:.2f}" for label, v in (
        ("matmuls at", hw.matmul_efficiency), ("Pallas kernels at", hw.kernel_efficiency),
        ("collectives and host transfers hidden", hw.overlap)) if v != 1]  # fmt: skip
    if not fitted or not hw.fitted_on:
        return "the roofline"
    return f"the roofline fitted to measured runs ({', '.join(fitted)})"


def _xla_seconds(optimal: float | None, flops: float, xla_flops: float | None,
                 unknown_trips: int) -> tuple[float | None, str]:  # fmt: skip
    if optimal is None or not math.isfinite(optimal):
        return None, "XLA gave no optimal_seconds for this program"
    if optimal <= 0:
        return None, f"XLA's optimal_seconds is {optimal:.3g} (not a time) for this program"
    if unknown_trips:
        return None, f"{unknown_trips} loop(s) of unknown trip count: not scaled"
    if not xla_flops or xla_flops >= 0.99 * flops:  # no loop (a loop makes XLA's fewer)
        return optimal, "cost_analysis()['optimal_seconds'] as XLA gives it (no loop runs twice)"
    return optimal * flops / xla_flops, (
        "cost_analysis()['optimal_seconds'], which counts each loop body once, scaled by the "
        f"FLOPs with loops counted per trip over XLA's ({flops:.4g} / {xla_flops:.4g})"
    )


def target_report(report, target: targets.Target, *, optimal_seconds: float | None,
              model_flops: float | None = None) -> TargetReport:  # fmt: skip
    """The `TargetReport` of a `StepReport` compiled for ``target``.

    Args:
      report: the step's `StepReport`.
      target: where it was compiled for (`targets.describe` of its devices).
      optimal_seconds: ``cost_analysis()["optimal_seconds"]`` of the compiled program.
      model_flops: the model's FLOPs per chip per step, for the MFU.
    """
    hw = hardware_profile(target)
    step = cost_model.CompiledStep.from_report(report)
    time = cost_model.model_time(step, hw, overlap=hw.overlap)
    xla, how = _xla_seconds(
        optimal_seconds, report.flops - report.kernel_flops, report.xla_flops,
        report.unknown_trip_counts,
    )  # fmt: skip
    if xla is not None and report.kernel_flops:
        how += (
            f"; it leaves out the Pallas kernels XLA does not see into ({report.kernel_flops:.4g} "
            f"FLOPs, {report.kernel_flops / hw.peak_flops * 1e3:.4g} ms at peak)"
        )
    peak = report.memory.peak
    across: dict[str, float] = {}
    for c, crosses in zip(step.collectives, cost_model.far(step, hw.island_size), strict=True):
        if crosses:
            across[c.kind] = across.get(c.kind, 0.0) + c.wire_bytes
    host_fits = hw.host_memory_bytes is None or report.memory.host <= hw.host_memory_bytes

    def mfu(seconds):
        return (
            None if model_flops is None or not seconds else model_flops / (seconds * hw.peak_flops)
        )

    return TargetReport(
        target=target.label, device_kind=target_kind(target), slices=target.slices,
        hbm_bytes=hw.memory_bytes, peak_bytes=peak, fits=peak <= hw.memory_bytes and host_fits,
        over_bytes=max(0, peak - hw.memory_bytes), fit_hint=None, peak_flops=hw.peak_flops,
        step_seconds=time.total, compute_seconds=time.compute + time.bubble,
        ici_seconds=time.ici, dcn_seconds=time.dcn, hidden_seconds=time.hidden,
        xla_seconds=xla, xla_seconds_how=how, model_flops=model_flops,
        mfu=mfu(time.total), xla_mfu=mfu(xla), hardware=hw.name,
        host_memory_bytes=report.memory.host, host_transfer_bytes=report.host_bytes,
        host_seconds=time.host, step_seconds_how=_step_how(hw), dcn_bytes=across,
        dcn_bandwidth=hw.dcn_bandwidth,
    )  # fmt: skip


def target_kind(target: targets.Target) -> str:
    gen = targets.GENERATIONS.get(target.generation)
    return gen.device_kind if gen else target.generation


def lines(t: TargetReport, format_bytes) -> list[str]:
    """The report's lines for a target."""
    room = (
        f"fits: peak {format_bytes(t.peak_bytes)} of {format_bytes(t.hbm_bytes)} "
        f"HBM" if t.fits else
        f"does NOT fit: over the {format_bytes(t.hbm_bytes)} HBM by {format_bytes(t.over_bytes)}"
        if t.over_bytes else f"does NOT fit: {format_bytes(t.host_memory_bytes)} offloaded per chip "
        f"is over the host's memory"
    )  # fmt: skip
    out = [f"on {t.target} ({t.device_kind}, {t.hardware}): {room}"]
    if t.fit_hint:
        out.append(f"  {t.fit_hint}")
    mfu = "" if t.mfu is None else f", MFU {t.mfu:.1%}"
    out.append(
        f"step {t.step_seconds * 1e3:.4g} ms by {t.step_seconds_how} (compute "
        f"{t.compute_seconds * 1e3:.4g}"
        f" ms, ICI {t.ici_seconds * 1e3:.3g} ms, DCN {t.dcn_seconds * 1e3:.3g} ms, of which "
        f"{t.hidden_seconds * 1e3:.3g} ms overlaps compute){mfu}"
    )
    if t.dcn_bytes:
        kinds = ", ".join(f"{kind} {format_bytes(b)}" for kind, b in sorted(t.dcn_bytes.items()))
        sends = "; a stage send (one-to-one) crosses whole" if "one-to-one" in t.dcn_bytes else ""
        out.append(
            f"across slices: {format_bytes(sum(t.dcn_bytes.values()))} a chip a step ({kinds}), "
            f"{t.dcn_seconds * 1e3:.4g} ms at {t.dcn_bandwidth / 1e9:.4g} GB/s a chip: the part "
            f"across slices of each collective over the replicas, which XLA splits in two "
            f"(inside each slice on the whole buffer, then across on a chip's 1 / data of it)"
            f"{sends}; the replicas' reductions and gathers overlap compute with the ICI's"
        )
        if t.optimizer_steps > 1:
            per = sum(t.dcn_bytes.values()) / t.optimizer_steps
            out.append(
                f"  local SGD: a step is {t.optimizer_steps} optimizer steps (local_steps), "
                f"each reduced inside its slice, then one exchange across of a synchronous "
                f"step's size: {format_bytes(per)} across slices an optimizer step"
            )
    if t.host_memory_bytes or t.host_transfer_bytes:
        out.append(
            f"host memory {format_bytes(t.host_memory_bytes)} per chip (offloaded, not in the peak); "
            f"{format_bytes(t.host_transfer_bytes)} between host and chip per step, "
            f"{t.host_seconds * 1e3:.4g} ms at the host link (overlapping compute)"
        )
    if t.xla_seconds is None:
        out.append(f"XLA's estimate: none ({t.xla_seconds_how})")
    else:
        xmfu = "" if t.xla_mfu is None else f", MFU {t.xla_mfu:.1%}"
        out.append(f"XLA's estimate {t.xla_seconds * 1e3:.4g} ms{xmfu}: {t.xla_seconds_how}")
    if t.model_flops is not None:
        out.append(f"model FLOPs per chip per step: {t.model_flops:.4g} (6 N T + attention)")
    return out
