"""Hardware profiles for the planner: what one device computes, holds and sends per second.

A profile is data, not code: peak dense bf16 FLOP/s, memory per device, the bandwidth one device
sends with over the fast interconnect inside an island (a TPU slice's ICI, a GPU node's NVLink)
and over the data-centre network between islands (DCN, InfiniBand), and how many devices an
island holds. Each built-in profile names its published source. Users add their own as a YAML
or JSON file with the same keys, or as a `Hardware` in code.

The emulated CPU (``"cpu"``) is measured rather than published: its emulated devices share this
machine's cores and memory, so its FLOP/s and copy bandwidth are the whole machine's, measured
once on one device (`calibrate_cpu`), and a step's time is the work of every device added up
(``shared=True``), with no bubble to wait in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from typing import Any

from replicator._src.core import collectives, targets

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device of an accelerator, and how it talks to the others.

    Attributes:
      name: the profile's name, e.g. ``"tpu-v5e"``.
      peak_flops: dense bf16 FLOP/s per device (for ``shared``: of the whole machine).
      memory_bytes: memory per device (HBM), the default budget of `rp.plan`.
      ici_bandwidth: bytes per second one device sends in a collective inside an island
        (per direction).
      dcn_bandwidth: bytes per second one device sends to another island.
      island_size: devices that share the fast interconnect: a TPU slice, a GPU node. A mesh
        axis whose device groups span more than this crosses the DCN.
      collective_latency: seconds each collective execution costs on top of its bytes.
      hbm_bandwidth: bytes per second a device reads and writes its memory; kernels slower at
        it than at ``peak_flops`` are modelled at it (None: FLOPs at peak only).
      shared: the devices are emulated on one machine and share its cores and memory
        bandwidth: a step takes the work of all devices added up (``peak_flops`` and
        ``ici_bandwidth`` are then the machine's).
      cache_bytes: the last-level cache a step's working set may sit in (None: no cache term).
        A step whose temporaries fit there moves its bytes at ``cache_bandwidth``; see
        `cost_model.kernel_time`.
      cache_bandwidth: bytes per second a device reads and writes data that sits in that cache.
      host_bandwidth: bytes per second one device moves between its host's memory and its own,
        per direction (PCIe): what offloaded activations and state cost (None: not modelled).
      host_memory_bytes: the host's memory per device, what offloaded activations may take
        (None: not checked).
      matmul_efficiency: the share of ``peak_flops`` the compiler's own kernels reach (fitted
        to measured runs, `fitted_on`; 1: the roofline).
      kernel_efficiency: the share of ``peak_flops`` the Pallas kernels reach (splash
        attention, grouped matmuls; fitted; 1: the roofline).
      overlap: the share of the hideable collectives and host transfers that run behind
        compute (fitted; 1: all of them, as the TPU compiler's asynchronous ones may).
      fitted_on: the measured runs the three constants above were fitted on ("": not fitted).
      source: where the figures come from.

    Raises:
      ValueError: for a figure out of range (a bandwidth or FLOP/s not > 0, a size that is not
        one), or ``cache_bytes`` without ``cache_bandwidth``.

    >>> HARDWARE_PROFILES["tpu-v5e"].peak_flops
    197000000000000.0
    >>> Hardware.from_dict({"name": "my-gpu", "peak_flops": 1e15, "memory_bytes": "80GB",
    ...     "ici_bandwidth": 4.5e11, "dcn_bandwidth": 5e10, "island_size": 8}).memory_bytes
    80000000000
    """

    name: str
    peak_flops: float
    memory_bytes: int
    ici_bandwidth: float
    dcn_bandwidth: float
    island_size: int
    collective_latency: float = 0.0
    hbm_bandwidth: float | None = None
    shared: bool = False
    source: str = ""
    cache_bytes: int | None = None
    cache_bandwidth: float | None = None
    host_bandwidth: float | None = None
    host_memory_bytes: int | None = None
    matmul_efficiency: float = 1.0
    kernel_efficiency: float = 1.0
    overlap: float = 1.0
    fitted_on: str = ""

    def __post_init__(self) -> None:
        for key in ("peak_flops", "ici_bandwidth", "dcn_bandwidth"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(
                    f"Hardware {self.name!r}: {key} must be a number > 0 (per second); got "
                    f"{value!r}."
                )
            object.__setattr__(self, key, float(value))
        object.__setattr__(self, "memory_bytes", parse_bytes(self.memory_bytes, "memory_bytes"))
        if self.host_memory_bytes is not None:
            host = parse_bytes(self.host_memory_bytes, "host_memory_bytes")
            object.__setattr__(self, "host_memory_bytes", host)
        size = self.island_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"Hardware {self.name!r}: island_size must be an int >= 1 (devices on the fast "
                f"interconnect, e.g. 8 for a GPU node); got {size!r}."
            )
        for key in ("hbm_bandwidth", "host_bandwidth"):
            bw = getattr(self, key)
            if bw is not None and (
                isinstance(bw, bool) or not isinstance(bw, int | float) or bw <= 0
            ):
                raise ValueError(
                    f"Hardware {self.name!r}: {key} must be bytes per second > 0, or null; "
                    f"got {bw!r}."
                )
        latency = self.collective_latency
        if isinstance(latency, bool) or not isinstance(latency, int | float) or latency < 0:
            raise ValueError(
                f"Hardware {self.name!r}: collective_latency must be seconds >= 0; got {latency!r}."
            )
        object.__setattr__(self, "collective_latency", float(latency))
        for key in ("matmul_efficiency", "kernel_efficiency", "overlap"):
            value = getattr(self, key)
            low = 0 if key == "overlap" else 1e-9
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not low <= value <= 1
            ):
                raise ValueError(
                    f"Hardware {self.name!r}: {key} must be a share from {low:g} to 1; got "
                    f"{value!r}."
                )
            object.__setattr__(self, key, float(value))
        if (self.cache_bytes is None) != (self.cache_bandwidth is None):
            raise ValueError(
                f"Hardware {self.name!r}: give cache_bytes and cache_bandwidth together, or "
                f"neither; got cache_bytes={self.cache_bytes!r}, "
                f"cache_bandwidth={self.cache_bandwidth!r}."
            )
        if self.cache_bytes is not None:
            object.__setattr__(self, "cache_bytes", parse_bytes(self.cache_bytes, "cache_bytes"))
            bw = self.cache_bandwidth
            if isinstance(bw, bool) or not isinstance(bw, int | float) or not bw > 0:
                raise ValueError(
                    f"Hardware {self.name!r}: cache_bandwidth must be bytes per second > 0; got "
                    f"{bw!r}."
                )
            object.__setattr__(self, "cache_bandwidth", float(bw))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Hardware:
        """A profile from a mapping with `Hardware`'s keys (``memory_bytes`` may be ``"16GiB"``).

        Raises:
          ValueError: for an unknown or missing key, or a value out of range.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - fields)
        if unknown:
            raise ValueError(
                f"Hardware: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                f"{', '.join(f.name for f in dataclasses.fields(cls))}."
            )
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(raw))
        if missing:
            raise ValueError(
                f"Hardware {raw.get('name', '?')!r}: missing key(s) {', '.join(missing)}; a "
                f"profile gives name, peak_flops, memory_bytes, ici_bandwidth, dcn_bandwidth "
                f"and island_size (see rp.planner.HARDWARE_PROFILES['tpu-v5e'] for one)."
            )
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        """The profile's keys and values: ``Hardware.from_dict(h.to_dict()) == h``."""
        return dataclasses.asdict(self)


_UNITS = {
    "": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
# a sign is read, so that "-5GiB" is refused as a size <= 0 rather than as no size at all
_SIZE = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(value: Any, name: str = "memory") -> int:
    """``16GiB``, ``"80 GB"``, ``1.5e9`` or ``2**34`` as a number of bytes.

    >>> parse_bytes("16GiB"), parse_bytes("80GB"), parse_bytes(1024)
    (17179869184, 80000000000, 1024)

    Raises:
      ValueError: naming ``name``, for anything else or a size <= 0.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        size = float(value)
    else:
        match = _SIZE.fullmatch(str(value)) if isinstance(value, str) else None
        unit = match and _UNITS.get(match.group(2).lower())
        if not unit:
            raise ValueError(
                f"{name}={value!r} is not a size; write bytes as a number or with a unit: "
                f"16GiB, 80GB, 512MiB (units: {', '.join(u for u in _UNITS if u)})."
            )
        size = float(match.group(1)) * unit
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"{name}={value!r} must be a size > 0 bytes, e.g. 16GiB.")
    return int(size)


_PCIE4, _PCIE5 = 32e9, 64e9  # bytes per second per direction of 16 lanes
_ASSUMED_PCIE = (" No host-link figure is published: PCIe Gen4 x16 (32 GB/s per direction) is "
                 "assumed for offloading.")  # fmt: skip


def _tpu(name, flops, memory, hbm, ici, dcn, island, source, host=_PCIE4, dram=None) -> Hardware:
    source += _ASSUMED_PCIE if host == _PCIE4 else ""
    return Hardware(name, flops, memory, ici, dcn, island, collective_latency=5e-6,
                    hbm_bandwidth=hbm, source=source, host_bandwidth=host,
                    host_memory_bytes=dram)  # fmt: skip


def _gpu(name, flops, memory, hbm, nvlink, ib, source, host) -> Hardware:
    return Hardware(name, flops, memory, nvlink, ib, 8, collective_latency=1e-5,
                    hbm_bandwidth=hbm, source=source, host_bandwidth=host)  # fmt: skip


HARDWARE_PROFILES: dict[str, Hardware] = {
    "tpu-v4": _tpu(
        "tpu-v4", 275e12, 32 * GiB, 1200e9, 1.1e15 / 4096, 50e9 / 8, 4096,
        "cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s, all-reduce "
        "bandwidth 1.1 PB/s per 4096-chip pod (268.6 GB/s per chip). The page gives no DCN "
        "figure: v5p's 50 Gbps per chip is assumed.",
    ),
    "tpu-v5e": _tpu(
        "tpu-v5e", 197e12, 16 * GiB, 819e9, 1600e9 / 8, 2 * 100e9 / 8 / 8, 256,
        "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 1600 "
        "Gbps per chip (400 GB/s bidirectional; 51.2 TB/s all-reduce per 256-chip pod), "
        "2 x 100 Gbps NICs per 8-chip host (25 Gbps DCN per chip); a slice is at most 256 chips; "
        "512 GiB of DRAM per 8-chip host.", dram=64 * GiB,
    ),
    "tpu-v5p": _tpu(
        "tpu-v5p", 459e12, 95 * GiB, 2765e9, 4800e9 / 8, 50e9 / 8, 6144,
        "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GB/s, ICI 4800 "
        "Gbps per chip (1200 GB/s bidirectional), DCN 50 Gbps per chip; a slice is at most "
        "6144 chips; 448 GB of RAM per 4-chip VM.", dram=112 * 10**9,
    ),
    "tpu-v6e": _tpu(
        "tpu-v6e", 918e12, 32 * GiB, 1638e9, 800e9 / 2, 4 * 200e9 / 8 / 8, 256,
        "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, ICI 800 GB/s "
        "bidirectional per chip, 8 chips per host, a slice is at most 256 chips. The page gives "
        "no per-chip DCN figure: 4 x 200 Gbps NICs per 8-chip host (12.5 GB/s per "
        "chip) is assumed. Each chip connects to its host through PCIe Gen5 (x16 assumed: 64 "
        "GB/s per direction); 1536 GiB of DRAM per 8-chip host.", _PCIE5, 192 * GiB,
    ),
    "h100": _gpu(
        "h100", 989e12, 80 * 10**9, 3.35e12, 900e9 / 2, 400e9 / 8,
        "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink "
        "900 GB/s (bidirectional) within an 8-GPU node; one 400 Gb/s InfiniBand NDR adapter "
        "per GPU (DGX H100) between nodes; PCIe Gen5 x16 to the host.", _PCIE5,
    ),
    "a100": _gpu(
        "a100", 312e12, 80 * 10**9, 2.039e12, 600e9 / 2, 200e9 / 8,
        "NVIDIA A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16, 80 GB HBM2e at 2039 GB/s, "
        "NVLink 600 GB/s (bidirectional) within an 8-GPU node; one 200 Gb/s InfiniBand HDR "
        "adapter per GPU (DGX A100, Selene) between nodes; PCIe Gen4 x16 to the host.", _PCIE4,
    ),
}  # fmt: skip
"""The built-in profiles by name: TPU v4, v5e, v5p and v6e, H100 and A100 (SXM, 8 per node). The
emulated CPU is ``hardware_profile("cpu")``, measured on this machine."""

# The step-time constants fitted to MaxText's measured runs (`benchmarks/calibrate.py`: each
# constant minimises the largest MFU error over its generation's rows; BENCHMARKS.md lists each
# row's error, fitted and left out); the other generations keep the roofline's 1.
_FITTED = {
    "tpu-v5p": dict(
        matmul_efficiency=0.81, kernel_efficiency=0.78,
        fitted_on="MaxText's measured MFU of Llama 2 70B on v5p-512 (65.4%) and Mixtral 8x7B on "
        "v5p-256 (52.56%), configs/published/, compiled by libtpu 0.0.50.1",
    ),
    "tpu-v6e": dict(
        matmul_efficiency=0.635, kernel_efficiency=0.6, overlap=0.8,
        fitted_on="MaxText's measured MFU of Llama 2 70B (43.8%), Llama 3.1 8B (45.46%), "
        "Llama 3.1 70B (50.33%), Mixtral 8x7B (35.23%) and Mixtral 8x22B (36.2%) on v6e-256 "
        "and Llama 3.1 405B on two (38.55%), configs/published/, compiled by libtpu 0.0.50.1",
    ),
}  # fmt: skip
for _name, _fit in _FITTED.items():
    HARDWARE_PROFILES[_name] = dataclasses.replace(HARDWARE_PROFILES[_name], **_fit)


def hardware_profile(spec: str | os.PathLike | dict | Hardware | targets.Target, /) -> Hardware:
    """The `Hardware` profile that ``spec`` names, gives or describes.

    Args:
      spec: a built-in profile's name (a key of `HARDWARE_PROFILES`, or ``"cpu"``: this
        machine, measured once by `calibrate_cpu`), the path of a YAML or JSON file of
        `Hardware`'s keys, a mapping of them, a `Hardware` (returned as it is), or a TPU
        `Target` (its chip's profile, with the target's slice as the island: collectives
        across slices cross the DCN).

    Returns:
      The profile.

    Raises:
      ValueError: for an unknown name (listing the known ones), or a file or mapping that is
        not a profile.

    >>> hardware_profile("tpu-v5e").memory_bytes == 16 * 2**30
    True
    >>> hardware_profile(targets.tpu_target("v5p-16")).island_size
    8
    """
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, targets.Target):
        return dataclasses.replace(
            HARDWARE_PROFILES[f"tpu-{spec.generation}"], island_size=spec.chips
        )
    if isinstance(spec, dict):
        return Hardware.from_dict(spec)
    text = os.fspath(spec)
    if text in HARDWARE_PROFILES:
        return HARDWARE_PROFILES[text]
    if text == "cpu":
        return calibrate_cpu()
    if os.path.isfile(text):
        with open(text) as f:
            if text.endswith(".json"):
                raw = json.load(f)
            else:
                import yaml

                raw = yaml.safe_load(f)
        if not isinstance(raw, dict):
            raise ValueError(f"hardware file {text}: expected a mapping of Hardware's keys.")
        try:
            return Hardware.from_dict(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"hardware file {text}: {e}") from None
    raise ValueError(
        f"hardware={text!r} is neither a known profile nor a file; use one of "
        f"{', '.join(map(repr, [*HARDWARE_PROFILES, 'cpu']))}, or the path of a YAML file with "
        f"the keys name, peak_flops, memory_bytes, ici_bandwidth, dcn_bandwidth, island_size."
    )


_CALIBRATED: dict[int, Hardware] = {}


def calibrate_cpu(*, memory_bytes: int | str = 16 * GiB, size: int = 1024) -> Hardware:
    """This machine as its emulated devices see it, measured once.

    On one CPU device: an fp32 ``size x size`` matmul (the FLOP/s the devices share) and a large
    copy (the memory bandwidth, which also moves an emulated collective's bytes). With more than
    one CPU device in the process: the time of one small all-reduce over all of them (the
    latency every collective pays: the devices' threads meet). Best of a few runs each; cached
    for the process.

    Args:
      memory_bytes: the budget to report as each device's memory.
      size: the matmul's side.

    Returns:
      A `Hardware` named ``"cpu"`` with ``shared=True``.
    """
    key = parse_bytes(memory_bytes, "memory_bytes")
    if key in _CALIBRATED:
        return _CALIBRATED[key]
    import jax
    import jax.numpy as jnp

    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: (x @ x) @ x)
    big = jax.device_put(jnp.ones((32 * 2**20,), jnp.float32), device)  # 128 MiB
    copy = jax.jit(lambda x: x * 1.0000001)  # reads and writes every byte once
    rate_flops = _best_rate(matmul, a, work=2 * 2 * size**3)
    rate_bytes = _best_rate(copy, big, work=2 * big.nbytes)
    cache, rate_cached = _effective_cache(device, rate_bytes)
    latency, devices = _collective_latency(jax.devices("cpu"))
    profile = Hardware(
        "cpu", rate_flops, key, rate_bytes, rate_bytes, 2**31, collective_latency=latency,
        hbm_bandwidth=rate_bytes, shared=True, cache_bytes=int(CACHE_REACH * cache),
        cache_bandwidth=max(rate_cached, rate_bytes),
        source=f"measured on this machine: a {size}x{size} fp32 matmul, a 128 MiB copy and a "
        f"copy of a quarter of the {cache / 2**20:.0f} MiB cache it runs in on one CPU device, "
        f"and an all-reduce over {devices} emulated devices; best of 5. cache_bytes is "
        f"{CACHE_REACH} x the cache: fitted (benchmarks/plan.py --part rank)",
    )  # fmt: skip
    _CALIBRATED[key] = profile
    return profile


# How many times the last-level cache a step's temporaries may span and still run at cache
# speed (a step's temporaries are not all live in any one kernel). Fitted by
# ``python benchmarks/plan.py --part rank`` on its fit layouts alone, which it keeps apart from
# the layouts it checks the ranking on (BENCHMARKS.md, "Layout planning").
CACHE_REACH = 2.83


def _effective_cache(device, rate_memory: float) -> tuple[int, float]:
    """``(bytes, copy rate)`` of the cache a copy runs in on this machine: four times the
    largest copy (from 2 MiB, doubling, up to a quarter of the last-level cache sysfs reports)
    at least twice as fast as memory, and that copy's rate. A virtual machine may be shown its
    host's whole last-level cache and get a slice of it: the copies say how much it gets. With
    no copy that fast: the reported cache, at memory speed (no cache term in effect)."""
    import jax
    import jax.numpy as jnp

    reported = _last_level_cache()
    best = None
    size = 2 * 2**20  # smaller copies time the dispatch more than the cache
    while size <= reported // 4:
        x = jax.device_put(jnp.ones((size // 4,), jnp.float32), device)
        rate = _best_rate(jax.jit(lambda x: x * 1.0000001), x, work=2 * x.nbytes)
        if rate >= 2 * rate_memory:
            best = (4 * size, rate)
        size *= 2
    return best or (reported, rate_memory)


def _last_level_cache() -> int:
    """This machine's last-level cache in bytes (Linux's sysfs; 32 MiB if it cannot be read)."""
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                sizes.append(parse_bytes(f.read().strip().replace("K", "KiB").replace("M", "MiB")))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 * 2**20)


def _collective_latency(devices: list, repeats: int = 100) -> tuple[float, int]:
    """Seconds per small all-reduce over ``devices`` (0 for one device), and their count."""
    if len(devices) < 2:
        return 0.0, len(devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("d",))

    def body(x):
        step = lambda _, y: collectives.sum_over_axes(y, ("d",)) * 0.5
        return jax.lax.fori_loop(0, repeats, step, x)

    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d"),
            check_vma=False,
        )
    )  # fmt: skip
    x = jax.device_put(jnp.ones((len(devices), 16)), NamedSharding(mesh, PartitionSpec("d")))
    return _best_rate(fn, x, work=1.0) ** -1 / repeats, len(devices)


def _best_rate(fn, x, *, work: float, repeats: int = 5) -> float:
    fn(x).block_until_ready()  # compile
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return work / best
