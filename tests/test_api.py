"""The public surface: a snapshot, so that every change to it is deliberate; one meaning per
name (no two names that differ only by case), a one-line summary on every docstring, and the
old names of what moved, kept for one release with a warning."""

import importlib
import inspect
import re
import subprocess
import sys
import types

import pytest

import replicator as rp

PUBLIC = [
    "Batches",
    "CheckpointWriteError",  # a checkpoint save that found its disk full; partial step removed
    "Checkpoints",
    "DistributedIterator",
    "DistributedOptimizer",
    "InputContext",
    "NonFiniteError",  # rp.fit stops with it on a nan/inf output or state, before saving it
    "Policy",
    "ReplicasDivergedError",
    "Replicator",
    "ShardedParam",
    "StateMismatchError",
    "StepReport",
    "ZeroPlan",  # opt.plan(params): each leaf's ZeRO split axis and bytes, what gathers
    "all_gather",
    "all_reduce",
    "broadcast",
    "current",
    "fit",
    "gather_params",
    "local_row",
    "num_replicas",
    "plan",
    "reduce_scatter",
    "regather_policy",  # jax.checkpoint policy: ZeRO-3 gathers each layer again backward
    "replica_axis_name",
    "replica_id",
    "to_device",  # inside step_fn: a leaf kept in host memory, copied to the device
    "to_host",  # parameters or optimizer state kept in host memory between steps
    "tpu_devices",  # a TPU target's devices, to compile for on any machine (libtpu)
]
NAMESPACES = ["attention", "distributed", "moe", "pipeline", "planner", "targets", "training"]


def _public(module) -> list[str]:
    return sorted(n for n in dir(module) if not n.startswith("_"))


def test_public_names():
    names = [n for n in _public(rp) if not isinstance(getattr(rp, n), types.ModuleType)]
    assert names == PUBLIC
    # the namespaces, and the packages another test may have imported (models, cli, launch)
    modules = [n for n in _public(rp) if n not in PUBLIC]
    assert set(NAMESPACES) <= set(modules) <= {*NAMESPACES, "models", "cli", "launch"}, modules
    assert rp.__version__


def test_the_top_level_holds_at_most_40_names_with_every_part_imported():
    """What a training script needs, and the namespaces: with the models and the CLI imported
    too (their packages then show in ``dir(rp)``), at most 40 names."""
    code = (
        "import replicator as rp, replicator.models.gpt, replicator.models.llama, "
        "replicator.models.hf, replicator.cli, replicator.launch; "
        "print(len([n for n in dir(rp) if not n.startswith('_')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) <= 40, out.stdout


FACES = [
    "replicator",
    "replicator.attention",
    "replicator.distributed",
    "replicator.moe",
    "replicator.pipeline",
    "replicator.planner",
    "replicator.targets",
    "replicator.training",
    "replicator.models",
    "replicator.models.gpt",
    "replicator.models.llama",
    "replicator.models.hf",
    "replicator.models.families",
]


def summary_problems(objects: dict) -> list[str]:
    """The objects (name -> object) whose docstring does not open with a one-line summary: a
    first line that is not empty, followed by a blank line or nothing."""
    bad = []
    for name, obj in objects.items():
        lines = (inspect.getdoc(obj) or "").splitlines()
        if not lines or not lines[0].strip() or (len(lines) > 1 and lines[1].strip()):
            bad.append(f"{name}: {lines[:2]}")
    return bad


def test_public_callables_open_with_a_one_line_summary():
    objects = {}
    for face in FACES:
        module = importlib.import_module(face)
        for name in _public(module):
            obj = getattr(module, name)
            if callable(obj) and not isinstance(obj, types.ModuleType):
                objects[f"{face}.{name}"] = obj
        objects[face] = module
    bad = summary_problems(objects)
    assert not bad, "docstrings without a one-line summary:\n" + "\n".join(bad)


def test_the_summary_check_can_fail():
    def wraps():
        """A summary that runs
        onto a second line."""

    def fine():
        """One line.

        Then the rest."""

    assert summary_problems({"wraps": wraps, "fine": fine, "none": lambda: 0}) == [
        "wraps: ['A summary that runs', 'onto a second line.']",
        "none: []",
    ]


def case_collisions(faces: list[str]) -> list[list[str]]:
    """Public names of ``faces`` (modules' names) that differ only by case, e.g. ``Plan`` and
    ``plan``: each group of two or more."""
    groups: dict[str, set[str]] = {}
    for face in faces:
        module = importlib.import_module(face)
        for name in _public(module):
            if not isinstance(getattr(module, name), types.ModuleType):
                groups.setdefault(name.lower(), set()).add(f"{face}.{name}")
    return [
        sorted(group)
        for group in groups.values()
        if len({path.rsplit(".", 1)[1] for path in group}) > 1
    ]


def test_no_two_public_names_differ_only_by_case():
    assert case_collisions(FACES) == []


def test_the_case_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "case_face.py").write_text("Plan = 1\nplan = 2\nother = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert case_collisions(["case_face"]) == [["case_face.Plan", "case_face.plan"]]


DEPRECATED = [  # (module, old name, its replacement): kept for one release, listed in CHANGELOG
    ("replicator", "Candidate", "replicator.planner.Candidate"),
    ("replicator", "DoesNotFitError", "replicator.targets.DoesNotFitError"),
    ("replicator", "Family", "replicator.planner.Ladder"),
    ("replicator", "FitResult", "replicator.training.FitResult"),
    ("replicator", "HARDWARE", "replicator.planner.HARDWARE_PROFILES"),
    ("replicator", "Hardware", "replicator.planner.Hardware"),
    ("replicator", "Layout", "replicator.planner.Layout"),
    ("replicator", "MetricWriter", "replicator.training.MetricWriter"),
    ("replicator", "ModelShape", "replicator.planner.ModelShape"),
    ("replicator", "OnTarget", "replicator.targets.TargetReport"),
    ("replicator", "PlanReport", "replicator.planner.PlanReport"),
    ("replicator", "Price", "replicator.planner.Price"),
    ("replicator", "Profile", "replicator.training.Profile"),
    ("replicator", "RunDirLockedError", "replicator.training.RunDirLockedError"),
    ("replicator", "Target", "replicator.targets.Target"),
    ("replicator", "TensorBoardWriter", "replicator.training.TensorBoardWriter"),
    ("replicator", "WandbWriter", "replicator.training.WandbWriter"),
    ("replicator", "enumerate_layouts", "replicator.planner.enumerate_layouts"),
    ("replicator", "hardware", "replicator.planner.hardware_profile"),
    ("replicator", "target", "replicator.targets.tpu_target"),
    ("replicator.pipeline", "Plan", "replicator.pipeline.Timetable"),
    ("replicator.pipeline", "Sequential", "replicator.pipeline.SequentialStages"),
    ("replicator.moe", "logical_axes", "replicator.moe.logical_axes_for"),
    ("replicator.models", "SHAPES", "replicator.models.CLASS_NAMES"),
    ("replicator.models.gpt", "logical_axes", "replicator.models.gpt.logical_axes_for"),
    ("replicator.models.llama", "from_hf_config", "replicator.models.hf.decoder_config"),
]


@pytest.mark.parametrize("module, old, new", DEPRECATED, ids=[f"{m}.{o}" for m, o, _ in DEPRECATED])
def test_an_old_name_still_works_with_a_warning_that_names_the_new_one(module, old, new):
    new_module, _, new_name = new.rpartition(".")
    with pytest.warns(DeprecationWarning, match=re.escape(f"{module}.{old} is deprecated")) as w:
        value = getattr(importlib.import_module(module), old)
    assert new in str(w[0].message)
    assert value is getattr(importlib.import_module(new_module), new_name)
    assert old not in dir(importlib.import_module(module))


def test_a_schedule_plan_still_works_with_a_warning():
    with pytest.warns(DeprecationWarning, match="GPipe.plan is deprecated.*GPipe.timetable"):
        old = rp.pipeline.GPipe().plan(2, 3)
    assert old.fwd.tolist() == rp.pipeline.GPipe().timetable(2, 3).fwd.tolist()


def test_a_name_that_never_was_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'replicator' has no attribute 'nothing'"):
        rp.nothing  # noqa: B018


PIPELINE = [
    "Circular",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Partition",
    "REMAT_ACTIVATIONS",
    "REMAT_PRESETS",
    "Remat",
    "SequentialStages",
    "StageCosts",
    "StepTime",
    "Timetable",
    "ZeroBubble",
    "apply",
    "balance",
    "layer_costs",
    "remat_policy",
    "render",
    "scan_layers",
    "sequential",
    "stack_stages",
    "stage_costs",
    "stage_costs_stacked",
    "stage_spec",
    "stages_from_layers",
    "step_time",
    "unstack_stages",
    "value_and_grad",
]


def test_pipeline_public_names():
    from replicator import pipeline

    names = sorted(n for n in dir(pipeline) if not n.startswith("_"))
    assert names == PIPELINE
    for name in PIPELINE:
        assert getattr(pipeline, name).__doc__, name


ATTENTION = [
    "IMPLS",
    "LAYOUTS",
    "attention",
    "constrain_tokens",
    "context_size",
    "reference",
    "zigzag_order",
]
MOE = ["LOGICAL_AXES", "Routing", "Stats", "apply", "init", "logical_axes_for", "partition_specs"]


def test_attention_and_moe_public_names():
    from replicator import attention, moe

    for module, want in ((attention, ATTENTION), (moe, MOE)):
        names = sorted(n for n in dir(module) if not n.startswith("_"))
        assert names == sorted(want), module.__name__
        for name in want:
            if callable(getattr(module, name)):
                assert getattr(module, name).__doc__, name
