"""Whether a job fits in this machine's memory, decided from shapes before anything is allocated
(`check_memory`), and the memory this machine has available (`available_memory`).

The rule, for a built-in job on CPU devices (whose memory is this machine's): the job needs at
least

    1.25 x (state + gradients + one global batch)

where the state is the parameters, the optimizer's state and the rest of the state (a step
counter, an EMA, BatchNorm statistics), the gradients are the parameters' bytes again, and the
quarter more (`HEADROOM`) is the step's activations and XLA's temporaries. Each leaf counts
once on every device of this process that holds a copy or a shard of it: emulated CPU devices
all live in this process, so a replicated leaf on 8 of them is 8 copies, and ZeRO, which splits
a leaf over them, leaves one copy in all (fewer ``cpu_devices`` then change nothing). The need
must be at most `available_memory`. On an accelerator the state lives in its own memory, which
``replicator explain`` reads; nothing is checked here.

It is a floor, so that no job that fits is refused: XLA:CPU's execution took more than it, and
more than its own ``memory_analysis`` says, in every job measured (see the guide's figures), so
a job that passes may still run out of memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple

import jax

from replicator.cli.config import TrainConfig
from replicator.cli.jobs.building import abstract_job, builtin_job
from replicator.cli.jobs.refusals import USER_ERRORS

HEADROOM = 1.25  # x (state + gradients + batch): the step's activations and XLA's temporaries
_LAYER_TRIES = 8  # layer counts tried below the estimate, for a config that refuses some


class Need(NamedTuple):
    """What a job holds in this process's memory, in bytes (see the module's rule)."""

    total: int  # HEADROOM x (state + params + batch): what must be available
    state: int  # the whole state: parameters, optimizer state and the rest
    params: int  # the parameters (and so their gradients)
    devices: int  # this process's devices that hold the state


def available_memory() -> tuple[int, str] | None:
    """The bytes this machine can give a new allocation, and where that was read: Linux's
    ``MemAvailable`` (or free physical pages, from ``os.sysconf``), lowered to a cgroup v2
    limit's headroom if the process has one; None where neither can be read."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
        found = pages, "free physical pages"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
    except (OSError, ValueError):
        return found
    if limit != "max" and int(limit) - used < found[0]:
        return int(limit) - used, "the cgroup's memory.max less memory.current"
    return found


def check_memory(config: TrainConfig, *, processes: int = 1) -> None:
    """Refuses, before anything is allocated, a built-in job whose state does not fit in this
    machine's memory on CPU devices (the module's rule), naming the bytes it needs, the bytes
    available and the smallest change of the config that fits. Does nothing for your own job,
    on accelerators, or for a job the library refuses (its build says why).

    Args:
      config: the job, as this process runs it.
      processes: the job's processes on this machine (``replicator launch``'s are all local),
        each of which gets an equal share of the available memory.

    Raises:
      ValueError: in one line, if the job needs more memory than is available.
    """
    if builtin_job(config) is None or jax.devices()[0].platform != "cpu":
        return
    have = available_memory()
    share = None if have is None else have[0] // processes
    need = None if have is None else needed(config)
    if need is None or need.total <= share:
        return
    available = f"{_size(have[0])} is available ({have[1]})"
    if processes > 1:
        available += f", {_size(share)} for each of the {processes} processes of this machine"
    fix = _change_that_fits(config, share)
    notes = []
    if config.zero_stage == 3:
        notes.append(
            f"zero_stage and cpu_devices do not cut it: ZeRO-3 keeps one copy, split over the "
            f"{need.devices} CPU devices this process emulates in its own memory"
        )
    if config.model.kind == "gpt":
        notes.append("model.dtype does not: it is the compute dtype, the parameters stay float32")
    said = f" ({'; '.join(notes)})" if notes else ""
    raise ValueError(
        f"{config.name} needs at least {_size(need.total)} of memory on this machine's CPU "
        f"devices and {available}: its state is {_size(need.state)} "
        f"(parameters {_size(need.params)}) on {need.devices} device{'s' * (need.devices > 1)}, "
        f"plus its gradients and a batch, x {HEADROOM} for activations and XLA's temporaries; "
        f"{fix}{said}. Nothing was allocated; replicator explain reads the step of a model of "
        f"any size without allocating it."
    )


def needed(config: TrainConfig) -> Need | None:
    """What the built-in job of ``config`` needs in this process's memory (the module's rule),
    from its shapes (`abstract_job`); None if the library refuses the job (its build says why).
    """
    try:
        _, _, state, batch = abstract_job(config)
    except USER_ERRORS:
        return None
    params = state["job"].get("params") if isinstance(state.get("job"), dict) else None
    held = sum(map(_held, jax.tree.leaves(state)))
    grads = sum(map(_held, jax.tree.leaves(params)))
    batch_bytes = sum(map(_held, jax.tree.leaves(batch)))
    total = math.ceil(HEADROOM * (held + grads + batch_bytes))
    devices = max((len(_devices(x)) for x in jax.tree.leaves(state)), default=1)
    return Need(total, held, grads, devices)


def _held(leaf) -> int:
    """The bytes of ``leaf`` on this process's devices: a shard (or a copy) on each."""
    sharding = getattr(leaf, "sharding", None)
    itemsize = leaf.dtype.itemsize
    if sharding is None:  # a batch's leaf: split over the devices, once in all
        return math.prod(leaf.shape) * itemsize
    return math.prod(sharding.shard_shape(leaf.shape)) * itemsize * len(_devices(leaf))


def _devices(leaf) -> set:
    sharding = getattr(leaf, "sharding", None)
    return set() if sharding is None else set(sharding.addressable_devices)


def _change_that_fits(config: TrainConfig, have: int) -> str:
    """The first that fits of: ``zero_stage=3`` (the same numbers), ``optimizer.name=sgd`` (no
    optimizer state), fewer ``model.layers``, and fewer layers with both of the others; or a
    smaller model's sizes, when none does."""
    changes = []  # (what the command line says, the keys it changes, a section's as a dict)
    if config.zero_stage != 3:
        changes.append(("zero_stage=3 ", {"zero_stage": 3}))
    if config.optimizer.name != "sgd":
        changes.append(("optimizer.name=sgd ", {"optimizer": {"name": "sgd"}}))
    for said, keys in changes:
        changed = _replaced(config, **keys)
        need = None if changed is None else needed(changed)
        if need is not None and need.total <= have:
            at_least = _size(need.total)
            return f"it would need less than is available with {said}(at least {at_least})"
    bases = [("", config)]
    if changes:
        all_keys = {key: value for _, keys in changes for key, value in keys.items()}
        bases.append(("".join(said for said, _ in changes), _replaced(config, **all_keys)))
    for said, base in bases:
        found = None if base is None else _layers_that_fit(base, have)
        if found is not None:
            return (
                f"it would need less than is available with {said}model.layers={found[0]} "
                f"(at least {_size(found[1].total)})"
            )
    return (
        "neither zero_stage=3, optimizer.name=sgd nor fewer model.layers brings it under that: "
        "use a smaller model (model.d_model, model.d_ff, model.vocab)"
    )


def _layers_that_fit(config: TrainConfig, have: int) -> tuple[int, Need] | None:
    """The most ``model.layers`` below the config's that fit, and their need; None if none do.

    A model's bytes are affine in its layers (each layer's parameters and their optimizer
    state): the need of 1 and of 2 layers gives the count, which is then checked by its own
    build (stepping down past counts the config refuses, e.g. not a multiple of the stages)."""
    if config.init_from is not None or config.model.kind not in ("gpt", "mlp"):
        return None
    one, two = (_replaced(config, model=dict(layers=n)) for n in (1, 2))
    need_one, need_two = (None if c is None else needed(c) for c in (one, two))
    if need_one is None or need_two is None or need_one.total > have:
        return None
    per_layer = max(need_two.total - need_one.total, 1)
    top = min(config.model.layers - 1, 1 + (have - need_one.total) // per_layer)
    for layers in range(top, max(top - _LAYER_TRIES, 0), -1):
        changed = _replaced(config, model=dict(layers=layers))
        need = None if changed is None else needed(changed)
        if need is not None and need.total <= have:
            return layers, need
    return None


def _replaced(config: TrainConfig, **changes) -> TrainConfig | None:
    """``config`` with these keys changed, a section's as a dict of its keys, as ``key=value``
    and ``section.key=value`` on the command line would (checked again); None if the config
    refuses the change."""
    try:
        changes = {
            name: dataclasses.replace(getattr(config, name), **keys)
            if isinstance(keys, dict)
            else keys
            for name, keys in changes.items()
        }
        return dataclasses.replace(config, **changes)
    except USER_ERRORS:
        return None


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
