"""``replicator explain CONFIG --resume RUN_DIR --target T``: a run checked against a pod's
layout before the pod is booked.

The run's newest checkpoint is read from its metadata (each array's shape and dtype, the step
and the data position; no array is read, nothing on disk changes) and checked against the
state CONFIG builds on the target (`rp.training.check_restore`): a leaf of another shape,
dtype or structure is refused in one line naming it. The step is compiled for the target as
``explain --target`` does, and the report gives the restore's peak per device (the state read
into its shardings) beside the step's; a restore that does not fit the chip's HBM is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import replicator as rp
from replicator.cli import isolated, jobs, targets


def add_args(parser) -> None:
    parser.add_argument(
        "--resume", metavar="RUN_DIR",
        help="with --target: check that RUN_DIR's newest checkpoint (out_dir/name of the run, or "
        "its checkpoints directory) restores onto the target's layout, from its metadata, and "
        "report the restore's peak memory per device beside the step's",
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Resume:
    """What ``--resume`` found: the checkpoint matches; the restore's and the step's peaks."""

    directory: str
    found: rp.training.RestoreCheck  # its restore_bytes: the restore's peak per device
    hbm_bytes: int

    def lines(self, step_peak: int | None) -> str:
        from replicator._src.report.step_report import format_bytes

        step = "" if step_peak is None else f", the step's {format_bytes(step_peak)}"
        position = self.found.record.get("data_position")
        at = "" if position is None else f", data position {position}"
        return (
            f"resume: checkpoint step {self.found.step} of {self.directory} ({self.found.leaves} "
            f"arrays{at}) restores onto this layout: restore peak "
            f"{format_bytes(self.found.restore_bytes)} per device{step}, of "
            f"{format_bytes(self.hbm_bytes)} HBM"
        )


def checkpoints_of(run_dir: str) -> str:
    """The checkpoint directory of a run: ``RUN_DIR/checkpoints``, or RUN_DIR itself."""
    inner = os.path.join(run_dir, "checkpoints")
    return inner if os.path.isdir(inner) else run_dir


def check(config, target: rp.targets.Target, run_dir: str) -> Resume:
    """Checks ``run_dir``'s newest checkpoint against ``config``'s state on ``target``.

    Raises:
      ValueError: one line naming the leaf that differs, or a restore over the HBM, and the fix.
      FileNotFoundError: no checkpoint there.
    """
    directory = checkpoints_of(run_dir)
    config = targets.mesh_on_target(config, target)
    devices = list(targets.devices(target.name, target.slices))
    _, _, state, _ = jobs.abstract_job(config, devices=devices)
    try:
        found = rp.training.check_restore(directory, state)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--resume {run_dir}: {_without_api(str(e))}") from None
    except rp.training.StateMismatchError as e:
        raise ValueError(_another_state(e, config, target, run_dir)) from None
    hbm = rp.planner.hardware_profile(target).memory_bytes
    resume = Resume(directory, found, hbm)
    if found.restore_bytes > hbm:
        from replicator._src.report.step_report import format_bytes

        raise ValueError(
            f"--resume {run_dir}: restoring checkpoint step {found.step} onto {config.name}'s "
            f"layout on {target.label} holds {format_bytes(found.restore_bytes)} per device, over "
            f"the chip's {format_bytes(hbm)} HBM; nothing was read. Shard the state more: "
            f"{_shard_more(config)}."
        )
    return resume


def explain(config, target, run_dir: str, *, per_layer: bool) -> Resumed:
    """The step's report for ``target`` with the ``--resume`` check's line added; the
    checkpoint is checked first (a mismatch compiles nothing)."""
    resume = check(config, target, run_dir)
    return Resumed(isolated.explain(config, target, per_layer=per_layer), resume)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A `StepReport` (``report``) and the ``--resume`` check (``resume``), printed and
    written as the report with one more line (JSON: a ``resume`` key)."""

    report: object
    resume: Resume

    def __str__(self) -> str:
        return f"{self.report}\n{self.resume.lines(self.report.target.peak_bytes)}"

    def to_json(self) -> str:
        data = json.loads(self.report.to_json())
        found = self.resume.found
        data["resume"] = {
            "directory": self.resume.directory, "step": found.step, "record": found.record,
            "arrays": found.leaves, "restore_peak_bytes": found.restore_bytes,
            "step_peak_bytes": self.report.target.peak_bytes, "fits": True,
        }  # fmt: skip
        return json.dumps(data, indent=2)


def _shard_more(config) -> str:
    if config.zero_stage < 3:
        return "zero_stage=3 (the run saved logical arrays: any stage restores them)"
    return "a model axis (mesh.model=2, with mesh.data=-1), or a target with more chips"


def _without_api(message: str) -> str:
    return re.sub(r"^rp\.[\w.]+: ", "", message)


def _another_state(e, config, target, run_dir: str) -> str:
    text = str(e).splitlines()[0]
    shape = re.search(r"has shape (\(.*?\)), but the state to restore into has (\(.*?\))", text)
    dtype = re.search(r"is (\w+), but the state to restore into has (\w+)", text)
    counts = re.search(r"(\d+ added, \d+ missing leaves)", text)
    if shape:
        what = f"saved {shape.group(1)}, {shape.group(2)} here"
    elif dtype:
        what = f"saved as {dtype.group(1)}, {dtype.group(2)} here"
    else:
        what = counts.group(1) if counts else "another structure"
    return (
        f"--resume {run_dir}: checkpoint step {e.step} holds another state than {config.name} "
        f"builds on {target.label}: leaf {e.leaf} differs ({what}); nothing was read. Explain "
        f"the config with the model and optimizer keys of the run that saved it (the mesh and "
        f"zero_stage may differ), or give another run's directory."
    )
