"""The processes of a ``replicator train`` job: joined (under ``replicator launch``, or a
cluster JAX detects), and the config of a job that an elastic launch runs on fewer processes
than planned (`elastic`)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import replicator as rp
from replicator.cli.config import TrainConfig
from replicator.cli.jobs.devices import emulate
from replicator.cli.jobs.refusals import SetupError


def joined(config: TrainConfig) -> tuple[TrainConfig, int]:
    """Joins the job's other processes, if any, after setting the emulated devices (unless the
    launcher sets them); returns ``config`` as a job shrunk by ``replicator launch
    --min-processes`` runs it, and how many of the job's processes share this machine (all of
    them under ``replicator launch``, whose processes are local; else this one).

    Raises:
      SetupError: if the processes cannot join, or the config cannot shrink.
    """
    if not os.environ.get("REPLICATOR_CPU_DEVICES"):
        emulate(config, cpu_only=False)
    try:
        info = rp.distributed.initialize()
    except RuntimeError as e:
        raise SetupError(str(e)) from e
    here = info.process_count if info.source == "launcher" else 1
    if info.elastic_factor == 1:
        return config, here
    return elastic(config, info.elastic_factor, info.planned_count), here


def elastic(config: TrainConfig, factor: int, planned: int) -> TrainConfig:
    """``config`` on ``1 / factor`` of its processes: the data axes shrink by ``factor``, and
    ``elastic_batch: keep`` keeps the global batch in ``factor`` times more micro-batches
    (accumulation, or a pipeline's micro-batches; a CNN, whose BatchNorm takes statistics over
    the whole batch, takes a larger batch per replica instead), ``shrink`` shrinks it.

    >>> c = elastic(TrainConfig(mesh={"data": 8}, accumulate_steps=2), 2, 4)  # doctest: +ELLIPSIS
    replicator train run: on 1/2 of the 4 processes (elastic_batch: keep): ...
    >>> c.mesh, c.accumulate_steps, c.global_batch
    ({'data': 4}, 4, 32)

    Raises:
      SetupError: if no data axis shrinks by ``factor``, or ``elastic_batch: shrink`` and the
        global batch does not divide by it.
    """
    mesh, left = dict(config.mesh), factor
    for axis in ("data", "dcn_data"):
        if mesh.get(axis, 0) > 0:
            g = math.gcd(mesh[axis], left)
            mesh[axis], left = mesh[axis] // g, left // g
    if left != 1 and -1 not in mesh.values():
        raise SetupError(
            f"{config.name}: the job runs on 1/{factor} of its {planned} processes (a host is "
            f"lost), and mesh {config.mesh} has no data axis that shrinks by {factor}; use "
            f"mesh.data: -1 (the remaining devices)."
        )
    changes: dict[str, Any] = {"mesh": mesh}
    if config.elastic_batch == "shrink":
        if config.global_batch % factor:
            raise SetupError(
                f"{config.name}: elastic_batch: shrink on 1/{factor} of the processes needs "
                f"global_batch={config.global_batch} to divide by {factor}; use elastic_batch: "
                f"keep, or a global_batch that does."
            )
        changes["global_batch"] = config.global_batch // factor
    elif "stage" in mesh:
        pipeline = config.pipeline
        changes["pipeline"] = dataclasses.replace(
            pipeline, microbatches=pipeline.microbatches * factor
        )
    elif config.model.kind != "cnn":
        changes["accumulate_steps"] = config.accumulate_steps * factor
    print(
        f"replicator train {config.name}: on 1/{factor} of the {planned} processes "
        f"(elastic_batch: {config.elastic_batch}): {changes}",
        flush=True,
    )
    return dataclasses.replace(config, **changes)
