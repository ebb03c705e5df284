"""TPU targets by the names people use: the devices of a slice to compile for, on any machine.

libtpu describes any TPU topology for ahead-of-time compilation
(``jax.experimental.topologies``): its devices compile programs and never run them, and
``jax.devices()`` stays what this machine has. `tpu_devices` names a target as ``gcloud``'s
accelerator types and MaxText's ``compile_topology`` do:

* ``v4-N`` and ``v5p-N``: N counts TensorCores, two a chip (``v5p-16`` is 8 chips, one device
  each: a megacore chip is one JAX device), in a 3-D torus;
* ``v5e-N`` (gcloud's ``v5litepod-N``) and ``v6e-N``: N counts chips, in a 2-D torus;
* or libtpu's own spelling, ``"v5p:2x2x2"``.

Slices of a multi-slice job (``slices=2``) are joined over the data-centre network; the mesh
puts ``dcn_data`` across them (`mesh.build_mesh`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Sequence

import jax

from replicator._src.core import compat, errors


@dataclasses.dataclass(frozen=True)
class Generation:
    """A TPU generation as libtpu and Cloud TPU name it."""

    name: str  # the accelerator type's prefix: "v5p"
    device_kind: str  # jax's Device.device_kind: "TPU v5"
    counts_cores: bool  # N in "v5p-N" counts TensorCores (two a chip)
    torus: int  # dimensions of the slice's torus
    max_chips: int  # the largest slice


GENERATIONS = {
    g.name: g
    for g in (
        Generation("v4", "TPU v4", True, 3, 4096),
        Generation("v5p", "TPU v5", True, 3, 8960),
        Generation("v5e", "TPU v5 lite", False, 2, 256),
        Generation("v6e", "TPU v6 lite", False, 2, 256),
    )
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}
EXAMPLES = "v4-8, v5e-8, v5e-256, v5p-16, v5p-512, v6e-256"


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice (or slices) to compile for.

    Attributes:
      name: the accelerator type, e.g. ``"v5p-16"``; for a slice shape no accelerator type
        names, its topology, e.g. ``"v5p:2x2x3"``.
      generation: ``"v4"``, ``"v5e"``, ``"v5p"`` or ``"v6e"``.
      chips: chips per slice (one JAX device each).
      slices: slices joined over the data-centre network.
      topology: libtpu's name of one slice, e.g. ``"v5p:2x2x2"``.
    """

    name: str
    generation: str
    chips: int
    slices: int
    topology: str

    @property
    def num_devices(self) -> int:
        """JAX devices of the target: one per chip, over every slice."""
        return self.chips * self.slices

    @property
    def label(self) -> str:
        """``"v5p-16"``, or ``"2 x v5p-16"`` for two slices."""
        return self.name if self.slices == 1 else f"{self.slices} x {self.name}"


def _torus(chips: int, dims: int) -> tuple[int, ...]:
    """Cloud TPU's slice shape: from the smallest, double the smallest side (the last of equals).

    >>> _torus(4, 3), _torus(256, 3), _torus(8, 2), _torus(256, 2)
    ((2, 2, 1), (4, 8, 8), (2, 4), (16, 16))
    """
    shape = [1] * dims
    if dims == 3 and chips >= 4:
        shape = [2, 2, 1]
    while math.prod(shape) < chips:
        i = max(j for j, s in enumerate(shape) if s == min(shape))
        shape[i] *= 2
    return tuple(shape)


def tpu_target(name: str, *, slices: int = 1) -> Target:
    """The `Target` named ``name`` (``"v5p-16"``, ``"v5litepod-8"``, ``"v5p:2x2x2"``).

    Args:
      name: an accelerator type (``"v5p-16"``, ``"v5litepod-8"``) or libtpu's topology name
        of one slice (``"v5p:2x2x2"``).
      slices: slices joined over the data-centre network.

    Returns:
      The `Target`.

    Raises:
      ValueError: for a name or size Cloud TPU does not have, naming the ones it does.

    >>> tpu_target("v5p-16")
    Target(name='v5p-16', generation='v5p', chips=8, slices=1, topology='v5p:2x2x2')
    >>> tpu_target("v5e-256", slices=2).num_devices
    512
    """
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        raise ValueError(f"tpu_target: slices must be an int >= 1; got {slices!r}.")
    text = str(name).strip().lower()
    given = re.fullmatch(r"(v\d+\w*):(\d+(?:x\d+)*)", text)
    sized = re.fullmatch(r"(v\d+\w*)-(\d+)", text)
    prefix = (given or sized).group(1) if (given or sized) else None
    gen = GENERATIONS.get(_ALIASES.get(prefix, prefix)) if prefix else None
    if gen is None:
        raise ValueError(
            f"target {name!r} is not a TPU accelerator type; use one of {EXAMPLES} (v4-N and "
            f"v5p-N count TensorCores, two a chip; v5e-N and v6e-N count chips), or libtpu's "
            f"'v5p:2x2x2'."
        )
    if given:
        shape = tuple(int(s) for s in given.group(2).split("x"))
        chips = math.prod(shape)
        if len(shape) != gen.torus or chips < 1:
            raise ValueError(
                f"target {name!r}: a {gen.name} slice is a {gen.torus}-D torus; write "
                f"{gen.name}:{'x'.join(['2'] * gen.torus)} or {gen.name}-N."
            )
    else:
        n = int(sized.group(2))
        chips = n // 2 if gen.counts_cores else n
        least = 8 if gen.counts_cores else 1
        if (
            n < least
            or chips & (chips - 1)
            or chips > gen.max_chips
            or n != chips * (2 if gen.counts_cores else 1)
        ):
            unit = "TensorCores, two a chip" if gen.counts_cores else "chips"
            most = 1 << (gen.max_chips.bit_length() - 1)  # the largest power of two of chips
            per = 2 if gen.counts_cores else 1
            raise ValueError(
                f"target {name!r}: {gen.name}-N counts {unit}; N must be {least}, "
                f"{2 * least}, {4 * least}, ... (a power of two) up to {most * per} ({most} "
                f"chips), e.g. {gen.name}-{least * 2}; another slice shape by its topology, "
                f"e.g. {gen.name}:{'x'.join(['2'] * (gen.torus - 1) + ['3'])}."
            )
        shape = _torus(chips, gen.torus)
    per_name = chips * (2 if gen.counts_cores else 1)
    topology = f"{gen.name}:{'x'.join(map(str, shape))}"
    if given and shape != _torus(chips, gen.torus):  # no accelerator type has this shape
        return Target(topology, gen.name, chips, slices, topology)
    return Target(f"{gen.name}-{per_name}", gen.name, chips, slices, topology)


def tpu_devices(name: str, *, slices: int = 1) -> list[jax.Device]:
    """The devices of a TPU target, to compile for on any machine: ``Replicator(devices=...)``.

    Needs libtpu (``pip install "replicator[tpu]"``); no TPU is needed and none is used. A
    `Replicator` on these devices explains and plans its steps (``repl.explain``) for that
    target; it cannot run them.

    Args:
      name: an accelerator type: ``"v4-8"``, ``"v5e-8"``, ``"v5p-16"`` (8 chips), ``"v5p-512"``,
        ``"v6e-256"``, ...; see `tpu_target`.
      slices: slices joined over the data-centre network (``mesh_shape`` then has a
        ``dcn_data`` axis of this size).

    Returns:
      One device per chip, slice by slice.

    Raises:
      ValueError: for a name that is not a TPU target.
      ImportError: without libtpu, naming the extra to install.
    """
    t = tpu_target(name, slices=slices)
    if importlib.util.find_spec("libtpu") is None:
        raise ImportError(
            f"tpu_devices({name!r}) compiles for TPUs with libtpu, which is not installed; "
            f'pip install "replicator[tpu]" (or "jax[tpu]" of your jax version).'
        )
    from jax.experimental import topologies

    compat.skip_persistent_cache_for_compile_only()  # JAX cannot read those programs back
    kwargs = {"num_slices": slices} if slices > 1 else {}
    if t.generation == "v4":  # one device a chip (megacore), as on a v4 VM; else one a core
        kwargs["chip_config_name"] = "megacore"
    return list(
        topologies.get_topology_desc(topology_name=t.topology, platform="tpu", **kwargs).devices
    )


_HBM_OOM = re.compile(r"Ran out of memory (?:on|in) (?:HBM|memory space hbm)[^.]*\.?", re.I)


def hbm_shortfall(error: BaseException) -> str | None:
    """The TPU compiler's own words when it refused a program for want of HBM (a step that
    does not fit the chip), else None.

    >>> hbm_shortfall(RuntimeError("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of "
    ...     "memory on HBM, the total memory required for HLO temporaries (100.16G) exceeds "
    ...     "available HBM (95.73G). HLO module: jit_body."))
    'the total memory required for HLO temporaries (100.16G) exceeds available HBM (95.73G)'
    >>> hbm_shortfall(ValueError("shapes differ")) is None
    True
    """
    text = str(error)
    if "CompileTimeHbmOom" not in text and not _HBM_OOM.search(text):
        return None
    found = re.search(r"HBM, (.*?\))\.", text)
    return found.group(1) if found else text.splitlines()[0][:300]


def compile_only(devices: Sequence[jax.Device]) -> bool:
    """Whether ``devices`` compile programs without running them (a target's devices)."""
    return any(type(getattr(d, "client", None)).__name__.startswith("CompileOnly") for d in devices)


def describe(devices: Sequence[jax.Device]) -> Target | None:
    """The `Target` whose devices these are; None for devices that are not TPUs."""
    if not devices or devices[0].platform != "tpu":
        return None
    kind = devices[0].device_kind
    gen = next((g for g in GENERATIONS.values() if g.device_kind == kind), None)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    chips = len(devices) // slices
    if gen is None:
        return Target(kind, kind, chips, slices, "")
    per_name = chips * (2 if gen.counts_cores else 1)
    coords = [getattr(d, "coords", None) for d in devices[:chips]]
    if all(c is not None for c in coords):
        shape = tuple(max(c[i] for c in coords) + 1 for i in range(gen.torus))
        if math.prod(shape) == chips and shape != _torus(chips, gen.torus):
            topology = f"{gen.name}:{'x'.join(map(str, shape))}"  # no accelerator type's
            return Target(topology, gen.name, chips, slices, topology)
    return Target(f"{gen.name}-{per_name}", gen.name, chips, slices, "")


def quiet_libtpu() -> None:
    """Keeps libtpu's start-up warnings (``TPU_WORKER_HOSTNAMES``, ``TPU_ACCELERATOR_TYPE``)
    from a machine without TPUs, where they say nothing: libtpu compiles for targets there.

    On a TPU VM nothing is set (its runtime reads them from the VM's metadata), nor where the
    user set either variable. Without a TPU, several processes may load libtpu at once
    (``ALLOW_MULTIPLE_LIBTPU_LOAD``)."""
    if importlib.util.find_spec("libtpu") is None:
        return
    try:
        from jax._src import hardware_utils

        chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    except Exception:  # a jax without it: say nothing, set nothing
        return
    if chips:
        return
    # no TPU here: libtpu only compiles, so several processes (pytest's workers, plan's) may
    # load it at once, which it refuses by default to guard a TPU's exclusive use
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if "TPU_ACCELERATOR_TYPE" in os.environ or "TPU_WORKER_HOSTNAMES" in os.environ:
        return
    os.environ["TPU_ACCELERATOR_TYPE"] = "v5p-8"  # any valid type: only compile-only devices
    os.environ["TPU_WORKER_HOSTNAMES"] = "localhost"


def refuse_compile_only(target: Target | None, api: str) -> None:
    """Raises: ``Replicator.<api>`` has nothing to run on a target's devices."""
    where = f"{target.label}'s" if target else "compile-only devices"
    raise ValueError(
        f"Replicator.{api}: this Replicator's devices are {where}, described by libtpu to "
        f"compile for (rp.tpu_devices): nothing runs or is placed on them. Use "
        f"repl.explain(step_fn, repl.abstract(init), batch_shapes) to read the step's program "
        f"for that target, and a Replicator on jax.devices() to run it."
    )


def compile_for(target: Target | None, lowered) -> jax.stages.Compiled:
    """``lowered.compile()``; a TPU target's refusal for want of HBM as `DoesNotFitError`."""
    if target is not None:
        compat.skip_persistent_cache_for_compile_only()
    try:
        return lowered.compile()
    except Exception as e:
        short = hbm_shortfall(e) if target is not None else None
        if short is None:
            raise
        raise errors.DoesNotFitError(
            f"Replicator.explain: the step does not fit {target.label}: the TPU compiler "
            f"refused it: {short}. Shard more (a higher zero_stage, a model axis), "
            f"rematerialise, or split the batch (gradient accumulation).",
            target=target.label, shortfall=short,
        ) from None  # fmt: skip
