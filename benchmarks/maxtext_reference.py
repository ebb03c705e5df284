"""MaxText's own ahead-of-time figures for a TPU target: memory, model TFLOPs, XLA's estimate.

Compiles MaxText's training step for a TPU topology on this machine (libtpu, compile only,
nothing runs), through MaxText's ``train_compile`` path in-process, and prints one JSON object:

* ``peak_memory_bytes``: per chip, the HBM libtpu allocates for the program
  (``compiled.memory_analysis().total_allocation_bytes``: its arguments and temporaries as
  libtpu packs them), as ``replicator explain`` reads its programs' peaks.
* ``bound_memory_bytes``: ``argument + output - alias + temp`` (generated code not
  included), the formula of MaxText's "Total estimated memory size"
  (``max_utils.print_compiled_memory_stats``), which MaxText prints in GiB (1024**3) under the
  label "GB": ``maxtext_memory_gib``. It can be far over the peak: libtpu's temporaries count
  their buffers apart where its allocator packs them by lifetime.
* ``model_tflops``: per chip per step by MaxText's count
  (``maxtext_utils.calculate_tflops_training_per_device``: 6 x weights x tokens plus causal
  attention, forward and backward), with its weight and attention parts.
* ``xla_flops``, ``xla_optimal_seconds``: ``compiled.cost_analysis()`` of the step, per chip.
  TPU cost analysis counts a while-loop body once: with ``scan_layers=true`` both cover one
  layer of the scan, and on larger meshes SPMD turns FSDP matmuls into windowed-einsum loops
  (collective matmuls) even with the layers unrolled. ``hlo_while_loops`` lists the loops;
  where there is any, ``mfu`` is left out (``--xla_tpu_enable_windowed_einsum_for_all_gather=
  false --xla_tpu_enable_windowed_einsum_for_reduce_scatter=false`` in ``LIBTPU_INIT_ARGS``
  gives a loop-free program of the same FLOPs). A Pallas kernel (MaxText's splash attention) is
  counted only as far as the kernel declares a cost.
* ``mfu``: ``model_tflops * 1e12 / (xla_optimal_seconds * peak)``, with the chip's peak bf16
  FLOP/s (v4 275e12, v5e 197e12, v5p 459e12, v6e 918e12).
* ``compile_seconds``: lowering and compiling the step; ``total_seconds``: the whole run.

Run it with the interpreter of an environment that has MaxText and libtpu installed; extra
``key=value`` arguments are MaxText config overrides, and ``LIBTPU_INIT_ARGS`` in the
environment is passed on, as MaxText's launch scripts set it:

    /work/venv_maxtext/bin/python benchmarks/maxtext_reference.py \\
        --model llama2-7b --topology v5p-8 --scan-layers false --json out.json \\
        per_device_batch_size=1 remat_policy=full

Defaults: ``per_device_batch_size=1 max_target_length=4096 dataset_type=synthetic
enable_checkpointing=false jax_cache_dir=""`` (no persistent compilation cache, so that
``compile_seconds`` is a real compile). ``--hlo FILE`` also writes the compiled step's HLO text.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import sys
import time

# Compile only: no TPU is attached, so skip the metadata server and name this host as the one
# worker; libtpu otherwise logs an error for each. Quiet the C++ logs below warnings.
for _key, _value in {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_STDERR_LOG_LEVEL": "2",
    "TPU_MIN_LOG_LEVEL": "2",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}.items():
    os.environ.setdefault(_key, _value)

PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5litepod": 197e12, "v5p": 459e12, "v6e": 918e12}
DEFAULTS = {
    "per_device_batch_size": "1",
    "max_target_length": "4096",
    "dataset_type": "synthetic",
    "enable_checkpointing": "false",
    "jax_cache_dir": "",  # no persistent cache: every run compiles (and is timed) afresh
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="MaxText model_name, e.g. llama2-7b")
    p.add_argument("--topology", required=True, help="compile_topology, e.g. v5p-8")
    p.add_argument("--num-slices", type=int, default=1, help="compile_topology_num_slices")
    p.add_argument("--scan-layers", choices=("true", "false"), default="true")
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--hlo", help="write the compiled step's HLO text to this file")
    p.add_argument("--verbose", action="store_true", help="keep MaxText's INFO logs")
    p.add_argument("overrides", nargs="*", help="MaxText config overrides, key=value")
    args = p.parse_args()
    for item in args.overrides:
        if "=" not in item:
            p.error(f"override {item!r} is not key=value")
    return args


def while_loops(hlo: str) -> dict[str, int]:
    """The compiled step's while loops, counted by body name (numbering and clone suffixes cut).

    The layer scan is one; SPMD's windowed einsums (``windowed_dot_general_body_ag``/``_rs``,
    an all-gather or reduce-scatter decomposed into a loop of matmuls) are others.
    """
    counts: dict[str, int] = {}
    for body in re.findall(r" while\(.*?body=%([\w.\-]+)", hlo):
        kind = re.sub(r"(\.(\d+|clone|sunk))+$", "", body)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def main() -> None:
    args = parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # MaxText prints as it imports and compiles
        import jax
        import maxtext
        from absl import logging as absl_logging
        from maxtext.trainers.pre_train import train_compile
        from maxtext.utils import maxtext_utils

    settings = dict(DEFAULTS)
    settings.update(
        model_name=args.model,
        compile_topology=args.topology,
        compile_topology_num_slices=str(args.num_slices),
        scan_layers=args.scan_layers,
    )
    settings.update(item.split("=", 1) for item in args.overrides)
    base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    argv = ["train_compile", base_yml, *(f"{k}={v}" for k, v in settings.items())]

    # Run MaxText's own train_compile.main, keeping what it builds: the config and mesh
    # (get_topology_mesh) and the compiled step (jit_and_compile).
    seen = {}
    get_topology_mesh = train_compile.get_topology_mesh
    jit_and_compile = train_compile.jit_and_compile

    def keep_mesh(config):
        seen["config"] = config
        seen["mesh"] = get_topology_mesh(config)
        if not args.verbose:
            absl_logging.set_verbosity(absl_logging.WARNING)
        return seen["mesh"]

    def keep_compiled(*a, **kw):
        start = time.perf_counter()
        seen["compiled"] = jit_and_compile(*a, **kw)
        seen["compile_seconds"] = time.perf_counter() - start
        return seen["compiled"]

    train_compile.get_topology_mesh = keep_mesh
    train_compile.jit_and_compile = keep_compiled
    if not args.verbose:
        absl_logging.set_verbosity(absl_logging.WARNING)
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        train_compile.main(argv)
    total_seconds = time.perf_counter() - start

    compiled, config = seen["compiled"], seen["config"]
    mem = compiled.memory_analysis()
    bound = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    peak = int(getattr(mem, "total_allocation_bytes", 0) or 0) or bound
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(
        config, log=False
    )
    optimal = cost.get("optimal_seconds")
    chip = args.topology.split("-")[0]
    peak_flops = PEAK_FLOPS.get(chip)
    scanned = args.scan_layers == "true"
    hlo = compiled.as_text()
    loops = while_loops(hlo)
    mfu = None
    if optimal and optimal > 0 and peak_flops and not loops:
        mfu = total * 1e12 / (optimal * peak_flops)

    result = {
        "model": args.model,
        "topology": args.topology,
        "num_slices": args.num_slices,
        "scan_layers": scanned,
        "chips": seen["mesh"].devices.size,
        "mesh": {k: v for k, v in seen["mesh"].shape.items() if v > 1},
        "overrides": settings,
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", "").strip(),
        "jax": jax.__version__,
        "libtpu": importlib.metadata.version("libtpu"),
        "maxtext": importlib.metadata.version("maxtext"),
        "peak_memory_bytes": peak,
        "peak_memory_formula": "total_allocation_bytes (memory_analysis, per chip)",
        "bound_memory_bytes": bound,
        "maxtext_memory_gib": round(bound / 1024**3, 1),
        "memory_analysis": {
            name: getattr(mem, name, None)
            for name in (
                "argument_size_in_bytes",
                "output_size_in_bytes",
                "alias_size_in_bytes",
                "temp_size_in_bytes",
                "peak_memory_in_bytes",
                "total_allocation_bytes",
                "generated_code_size_in_bytes",
                "host_temp_size_in_bytes",
            )
        },
        "model_tflops": total,
        "model_tflops_weights": weights,
        "model_tflops_attention": attention,
        "xla_flops": cost.get("flops"),
        "xla_bytes_accessed": cost.get("bytes accessed"),
        "xla_optimal_seconds": optimal,
        "peak_flops_per_chip": peak_flops,
        "mfu": mfu,
        "hlo_while_loops": loops,
        "compile_seconds": round(seen["compile_seconds"], 1),
        "total_seconds": round(total_seconds, 1),
    }
    if loops:
        result["note"] = (
            f"the step has {sum(loops.values())} while loops; XLA's flops and optimal_seconds "
            "count each loop body once, so no MFU from them"
        )
    elif optimal is None or optimal <= 0:
        result["note"] = f"XLA's optimal_seconds is {optimal!r}: no MFU from it"
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(hlo)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
