"""The public surface: a snapshot, so that every change to it is deliberate."""

import types

import replicator as rp

PUBLIC = [
    "Batches",
    "Candidate",  # rp.plan: one layout's outcome and modelled time
    "CheckpointWriteError",  # a checkpoint save that found its disk full; partial step removed
    "Checkpoints",
    "DistributedIterator",
    "DistributedOptimizer",
    "DoesNotFitError",  # explain on a TPU target: the TPU compiler refused it for want of HBM
    "Family",  # rp.enumerate_layouts: layouts that trade memory for time, tried in order
    "FitResult",
    "HARDWARE",  # the built-in hardware profiles (TPU v4/v5e/v5p/v6e, H100, A100)
    "Hardware",
    "InputContext",
    "Layout",
    "MetricWriter",  # rp.fit(writers=[...]): any object with write(step, metrics) and close()
    "ModelShape",  # rp.plan(model=...): the sizes a layout is priced from, without compiling
    "NonFiniteError",  # rp.fit stops with it on a nan/inf output or state, before saving it
    "OnTarget",  # StepReport.target: a step compiled for a TPU target, on that TPU
    "PlanReport",
    "Policy",
    "Price",  # rp.plan(model=...): a layout's figures from formulas (Candidate.priced)
    "Profile",
    "ReplicasDivergedError",
    "Replicator",
    "RunDirLockedError",  # rp.fit refuses a run directory another live run holds; catchable
    "ShardedParam",
    "StateMismatchError",
    "StepReport",
    "Target",  # rp.target("v5p-16"): a TPU slice by its accelerator type
    "TensorBoardWriter",
    "WandbWriter",
    "ZeroPlan",  # opt.plan(params): each leaf's ZeRO split axis and bytes, what gathers
    "all_gather",
    "all_reduce",
    "broadcast",
    "current",
    "enumerate_layouts",
    "fit",
    "gather_params",
    "hardware",
    "local_row",
    "num_replicas",
    "plan",
    "reduce_scatter",
    "regather_policy",  # jax.checkpoint policy: ZeRO-3 gathers each layer again backward
    "replica_axis_name",
    "replica_id",
    "target",
    "tpu_devices",  # a TPU target's devices, to compile for on any machine (libtpu)
]


def test_public_names():
    names = sorted(
        n
        for n in dir(rp)
        if not n.startswith("_") and not isinstance(getattr(rp, n), types.ModuleType)
    )
    assert names == PUBLIC
    assert rp.__version__


def test_public_functions_have_docstrings():
    for name in PUBLIC:
        assert getattr(rp, name).__doc__, name


PIPELINE = [
    "Circular",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Partition",
    "Plan",
    "Sequential",
    "StageCosts",
    "StepTime",
    "ZeroBubble",
    "apply",
    "balance",
    "layer_costs",
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
MOE = ["LOGICAL_AXES", "Routing", "Stats", "apply", "init", "logical_axes", "partition_specs"]


def test_attention_and_moe_public_names():
    from replicator import attention, moe

    for module, want in ((attention, ATTENTION), (moe, MOE)):
        names = sorted(n for n in dir(module) if not n.startswith("_"))
        assert names == sorted(want), module.__name__
        for name in want:
            if callable(getattr(module, name)):
                assert getattr(module, name).__doc__, name
