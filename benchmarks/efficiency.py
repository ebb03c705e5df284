"""Is each composition lean? FLOPs, collective bytes and memory of the compiled step, per device.

The model is the library's GPT (``replicator.models.gpt``: token and position embeddings,
pre-LayerNorm blocks of causal self-attention and a GELU MLP run as a ``lax.scan``, a final
LayerNorm and an output matrix) at two sizes, Adam in fp32, a global batch of 32 sequences on 8
emulated devices. Each layout's training step (``opt.step`` of ``gpt.loss``, parameters placed
by ``gpt.place`` with Megatron's rules and, for ZeRO-3, stored by ``opt.shard_params``) is
compiled by ``repl.explain`` from shapes; nothing runs. For each layout:

* **FLOPs per device** against plain data parallelism's on the same global batch (the same
  arithmetic per device once the model axis splits it): tensor parallelism adds only the
  LayerNorms, biases and embeddings every ``model`` device repeats.
* **Collective bytes per step by kind and axis** (loops counted per trip). The data-axis volume
  (reduce-scatter + all-gather + 2 x all-reduce) against the ZeRO paper's, with Psi_T the
  parameters one ``model`` device holds (``P_split / T + P_rep``): 2 Psi_T words for data
  parallelism and ZeRO-1/2; 3 Psi_T for ZeRO-3, whose ``gpt.loss`` gathers each layer again in
  the backward pass (``rp.regather_policy``, FSDP's reshard-after-forward; also with
  ``remat``), 2 Psi_T when the gathered weights are kept for the backward pass instead ("weights
  kept": the same blocks scanned without the policy). The embedding and head are gathered
  once, so ZeRO-3's volume is a little under 3 Psi_T. ``model``-axis all-gathers against the
  data-axis bytes (none: a ZeRO collective moves each device's own ``model`` part only).
* **Parameters, gradients and Adam state per device**, read from the state's shardings (the
  gradients: the parts the optimizer reduces, ``opt.step``'s), against ``4 Psi_T / N``,
  ``8 Psi_T / N`` (ZeRO-3; ZeRO-1/2 keep the parameters whole: ``4 Psi_T``).
* **Temporaries** (``memory_analysis``).

Then the same step written by hand, in MaxText's FSDP x TP style: ``jax.jit`` of ``gpt.loss``'s
gradient and ``optax.adam``'s update with every parameter and its Adam moments placed by
``NamedSharding`` (the same axes ZeRO splits, over ``data``, on top of Megatron's ``model``
split), the batch over ``data``, the state held to its shardings and donated; XLA (GSPMD) adds
the collectives. Its FLOPs, collective bytes and temporaries are read the same way
(``replicator._src.report.hlo.analyze``, as ``explain`` does) and set beside ``repl.run``'s.

Part ``pipelines`` reads the same figures for the pipeline schedules, on the GPT that
``replicator train configs/lm_pipeline.yaml`` trains (the CLI's job, built from shapes by
``replicator.cli.jobs.abstract_job``) at d_model 256, 8 heads, seq 128, global batch 32,
M = 8 micro-batches on ``{data: 2, stage: 4}``:

* **FLOPs per device** of each schedule under each remat policy against plain data
  parallelism's (``{data: 8}``) on the same batch. 1F1B and its kin (interleaved, ZeroBubble) skip its idle ticks under
  ``lax.cond``, so its count is the work it executes; GPipe and Circular compute through their
  bubbles. With 4 layers for GPipe, 1F1B and ZeroBubble; with 8 layers (K x V = 8) for
  Interleaved1F1B and Circular beside 1F1B and data parallelism at 8 layers.
* **Modelled step time** on 4 parallel devices (``rp.pipeline.step_time`` from each stage's
  compiled passes, in FLOPs, as ``explain`` notes it) and the modelled bubble.
* **Temporaries** (``memory_analysis``), and for 1F1B without remat at M = 8 to 64 with a fixed
  micro-batch of 2 sequences per replica (memory flat in M).
* **bf16 sends**: the bytes of the stage-to-stage ``collective_permute``s in the program the
  library emits (the lowered StableHLO, before XLA's platform passes), fp32 against
  ``model.dtype=bfloat16``, and the same read from the compiled program.

    python benchmarks/efficiency.py
    python benchmarks/efficiency.py --sizes small --json /tmp/efficiency.json
    python benchmarks/efficiency.py --part pipelines
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import dataclasses
import datetime
import json
import math
import re
import shlex
import sys
import time

import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator._src.optim import zero_layout
from replicator._src.report import hlo
from replicator.models import gpt

SIZES = {
    "small": gpt.GPTConfig(vocab_size=256, seq_len=128, d_model=256, num_heads=8, num_layers=4),
    "large": gpt.GPTConfig(vocab_size=256, seq_len=128, d_model=512, num_heads=8, num_layers=4),
}
BATCH = 32
LAYOUTS = [  # (name, mesh, zero_stage, variant: "" | "remat" | "kept")
    ("DP", {"data": 8}, 0, ""),
    ("TP 2", {"data": 4, "model": 2}, 0, ""),
    ("TP 4", {"data": 2, "model": 4}, 0, ""),
    ("FSDP", {"data": 8}, 3, ""),
    ("FSDP x TP 2", {"data": 4, "model": 2}, 3, ""),
    ("FSDP x TP 4", {"data": 2, "model": 4}, 3, ""),
    ("FSDP x TP 2, weights kept", {"data": 4, "model": 2}, 3, "kept"),
    ("FSDP x TP 2, remat", {"data": 4, "model": 2}, 3, "remat"),
    ("ZeRO-1 x TP 2", {"data": 4, "model": 2}, 1, ""),
    ("ZeRO-1 x TP 4", {"data": 2, "model": 4}, 1, ""),
    ("ZeRO-2 x TP 2", {"data": 4, "model": 2}, 2, ""),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["zero", "pipelines", "all"], default="all")
    p.add_argument("--sizes", default="small,large", help="comma-separated: small, large")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def batch_shapes(config: gpt.GPTConfig) -> dict:
    shape = jax.ShapeDtypeStruct((BATCH, config.seq_len), jnp.int32)
    return {"tokens": shape, "targets": shape}


def device_bytes(tree) -> int:
    """Bytes one device holds of ``tree`` (arrays or shapes with shardings)."""
    total = 0
    for x in jax.tree.leaves(tree):
        total += math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


def psi_t(config: gpt.GPTConfig, t: int) -> int:
    """Parameters one ``model`` device holds under Megatron's layout: P_split / T + P_rep."""
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    specs = gpt.partition_specs()
    total = 0
    for x, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs, is_leaf=_is_spec)):
        total += x.size // (t if "model" in tuple(spec) else 1)
    return total


def _is_spec(x) -> bool:
    return isinstance(x, P)


@dataclasses.dataclass
class Row:
    size: str
    layout: str
    mesh: dict
    zero_stage: int
    variant: str
    flops: float
    matmul_flops: float
    collectives: dict  # "kind axes" -> bytes per device per step
    params_bytes: int
    grads_bytes: int
    opt_bytes: int
    temp_bytes: int
    compile_seconds: float
    psi_t: int


def replicator_row(size: str, name: str, mesh: dict, zero_stage: int, variant: str) -> Row:
    config = dataclasses.replace(SIZES[size], remat=variant == "remat")
    n_devices = math.prod(mesh.values())
    repl = rp.Replicator(mesh_shape=mesh, devices=jax.devices()[:n_devices])
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=zero_stage)

    def init():
        params = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
        if zero_stage == 3:
            params = opt.shard_params(params, stacked=["blocks"])
        return {"params": params, "opt": opt.init(params)}

    def loss_fn(params, batch):
        if variant != "kept":  # gpt.loss: ZeRO-3 gathers each layer again in the backward pass
            return gpt.loss(params, batch["tokens"], batch["targets"], config=config)
        x = gpt.embed(params["embed"], batch["tokens"])  # gpt.loss without the regather policy
        layer = lambda h, p: (gpt.block(p, h, config=config), None)
        x, _ = jax.lax.scan(layer, x, params["blocks"])
        return gpt.head_loss(params["head"], x, batch["targets"])

    def step(state, batch):
        params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    state = repl.abstract(init)
    start = time.perf_counter()
    report = repl.explain(step, state, batch_shapes(config))
    seconds = time.perf_counter() - start
    params = jax.tree.map(lambda x: x, state["params"])
    n = repl.num_replicas
    t = mesh.get("model", 1)
    grads = device_bytes(params) if zero_stage == 3 else grads_bytes(params, zero_stage, n, mesh)
    return Row(
        size, name, mesh, zero_stage, variant, report.flops, report.matmul_flops,
        by_kind(report.collectives), device_bytes(params), grads, device_bytes(state["opt"]),
        report.memory.temporaries, seconds, psi_t(config, t),
    )  # fmt: skip


def grads_bytes(params, zero_stage: int, n: int, mesh: dict) -> int:
    """The gradient the optimizer keeps per device: whole for ZeRO 0-1, split along each
    leaf's ZeRO axis for ZeRO-2 (the parts it reduce-scatters and accumulates)."""
    total = 0
    for x in jax.tree.leaves(params):
        shape = list(x.sharding.shard_shape(x.shape))
        if zero_stage == 2:
            d = zero_layout.split_dim(x.shape, x.sharding.spec, n)
            if d is not None:
                shape[d] //= n
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def by_kind(collectives) -> dict:
    out: dict[str, float] = {}
    for c in collectives:
        key = f"{c.kind} {'+'.join(c.axes) or '-'}"
        out[key] = out.get(key, 0.0) + c.total_bytes
    return out


def reference_row(size: str, name: str, mesh: dict, zero_stage: int, variant: str) -> Row:
    """The step by hand in MaxText's style: jax.jit with NamedShardings, GSPMD's collectives."""
    config = dataclasses.replace(SIZES[size], remat=variant == "remat")
    n_devices = math.prod(mesh.values())
    mesh_obj = rp.Replicator(mesh_shape=mesh, devices=jax.devices()[:n_devices]).mesh
    n = mesh["data"]
    tx = optax.adam(1e-3)
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    model_specs = jax.tree.map(
        lambda s: P(*(e if e in mesh_obj.shape else None for e in tuple(s))),
        gpt.partition_specs(),
        is_leaf=_is_spec,
    )

    def fsdp(x, spec, lead):
        d = zero_layout.split_dim(x.shape, spec, n, lead=lead)
        return zero_layout.with_data(spec, d, x.ndim, mesh_obj)

    leads = {k: int(k == "blocks") for k in shapes}
    data_specs = {
        k: jax.tree.map(
            lambda x, s, lead=leads[k]: fsdp(x, s, lead), shapes[k], model_specs[k],
            is_leaf=lambda v: isinstance(v, jax.ShapeDtypeStruct),
        )
        for k in shapes
    }  # fmt: skip
    param_specs = data_specs if zero_stage == 3 else model_specs
    named = lambda specs: jax.tree.map(
        lambda s: NamedSharding(mesh_obj, s), specs, is_leaf=_is_spec
    )
    p_shardings = named(param_specs)
    opt_shapes = jax.eval_shape(tx.init, shapes)
    moment_specs = data_specs if zero_stage else model_specs
    adam = optax.ScaleByAdamState(
        count=NamedSharding(mesh_obj, P()), mu=named(moment_specs), nu=named(moment_specs)
    )
    o_shardings = (adam, optax.EmptyState())  # optax.adam: scale_by_adam, then the rate
    batch_sharding = NamedSharding(mesh_obj, P("data"))

    def batch_split(x):  # MaxText constrains activations: the batch over the data axis
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh_obj, P("data")))

    def model_loss(p, tokens, targets):  # gpt.loss, its activations held to the batch split
        x = batch_split(gpt.embed(p["embed"], tokens).astype(config.dtype))

        def layer(h, layer_params):
            return batch_split(gpt.block(layer_params, h, config=config).astype(h.dtype)), None

        if config.remat:
            layer = jax.checkpoint(layer, prevent_cse=False)
        x, _ = jax.lax.scan(layer, x, p["blocks"])
        return gpt.head_loss(p["head"], x, targets)

    def step(params, opt_state, batch):
        def loss(p):
            return model_loss(p, batch["tokens"], batch["targets"])

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jitted = jax.jit(
        step,
        in_shardings=(p_shardings, o_shardings, batch_sharding),
        out_shardings=(p_shardings, o_shardings, NamedSharding(mesh_obj, P())),
        donate_argnums=(0, 1),
    )
    start = time.perf_counter()
    compiled = jitted.lower(shapes, opt_shapes, batch_shapes(config)).compile()
    seconds = time.perf_counter() - start
    costs = hlo.analyze(compiled.as_text(), dict(mesh_obj.shape))
    placed = lambda tree, shard: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shard
    )
    return Row(
        size, name + " (jit by hand)", mesh, zero_stage, variant, costs.flops, costs.matmul_flops,
        by_kind(costs.collectives), device_bytes(placed(shapes, p_shardings)),
        device_bytes(placed(shapes, p_shardings)), device_bytes(placed(opt_shapes, o_shardings)),
        compiled.memory_analysis().temp_size_in_bytes, seconds, psi_t(config, mesh.get("model", 1)),
    )  # fmt: skip


def data_volume(row: Row) -> float:
    """Data-axis bytes a ring moves per device, up to (N-1)/N: an all-reduce counts twice."""
    c = row.collectives
    return (
        c.get("reduce-scatter data", 0)
        + c.get("all-gather data", 0)
        + 2 * c.get("all-reduce data", 0)
    )


def mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def main() -> None:
    args = parse_args()
    out = []
    if args.part in ("zero", "all"):
        out += part_zero(args)
    if args.part in ("pipelines", "all"):
        out += part_pipelines()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def part_zero(args) -> list:
    start = time.perf_counter()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    rows: list[Row] = []
    refs: list[Row] = []
    for size in sizes:
        for name, mesh, zero_stage, variant in LAYOUTS:
            rows.append(replicator_row(size, name, mesh, zero_stage, variant))
            if zero_stage in (1, 3) and "model" in mesh and not variant:
                refs.append(reference_row(size, name, mesh, zero_stage, variant))
            print(f"# {size} {name}: compiled in {rows[-1].compile_seconds:.1f} s", file=sys.stderr)
    command = "python " + " ".join(map(shlex.quote, sys.argv))
    print(f"Command: `{command}` ({datetime.date.today()}, jax {jax.__version__}, "
          f"{time.perf_counter() - start:.0f} seconds)\n")  # fmt: skip
    for size in sizes:
        c = SIZES[size]
        base = next(r for r in rows if r.size == size and r.layout == "DP")
        print(f"### GPT {size}: d_model {c.d_model}, {c.num_layers} layers, {c.num_heads} heads, "
              f"seq {c.seq_len}, vocab {c.vocab_size}, batch {BATCH}\n")  # fmt: skip
        print("| layout | mesh | FLOPs / DP | matmul / DP | data volume MiB | formula MiB | "
              "/ formula | model all-gather / data | params MiB | / 4 Psi_T/N | grads MiB | "
              "Adam MiB | / 8 Psi_T/N | temp MiB |")  # fmt: skip
        print("|" + "---|" * 14)
        for r in rows:
            if r.size != size:
                continue
            n = r.mesh["data"]
            words = (3 if r.zero_stage == 3 and r.variant != "kept" else 2) * r.psi_t
            vol = data_volume(r)
            model_gather = r.collectives.get("all-gather model", 0) / max(vol, 1)
            p_formula = 4 * r.psi_t / (n if r.zero_stage == 3 else 1)
            o_formula = 8 * r.psi_t / (n if r.zero_stage else 1)
            print(
                f"| {r.layout} | {r.mesh} | **{r.flops / base.flops:.3f}** | "
                f"{r.matmul_flops / base.matmul_flops:.3f} | {mib(vol)} | {mib(4 * words)} | "
                f"**{vol / (4 * words):.3f}** | **{model_gather:.3f}** | {mib(r.params_bytes)} | "
                f"{r.params_bytes / p_formula:.3f} | {mib(r.grads_bytes)} | {mib(r.opt_bytes)} | "
                f"{(r.opt_bytes - 4) / o_formula:.3f} | {mib(r.temp_bytes)} |"
            )
        print()
        print("Against the same step by hand (`jax.jit` + `NamedSharding`, MaxText's style), "
              "ratios repl.run / by hand:\n")  # fmt: skip
        print("| layout | FLOPs | collective bytes | data volume | temp | repl.run collectives | "
              "by hand collectives |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for ref in refs:
            if ref.size != size:
                continue
            mine = next(
                r for r in rows if r.size == size and r.layout + " (jit by hand)" == ref.layout
            )
            total = lambda r: sum(r.collectives.values())
            fmt = lambda r: ", ".join(f"{k} {mib(v)}" for k, v in sorted(r.collectives.items()))
            print(
                f"| {mine.layout} | **{mine.flops / ref.flops:.3f}** | "
                f"**{total(mine) / total(ref):.3f}** | {data_volume(mine) / data_volume(ref):.3f} | "
                f"**{mine.temp_bytes / ref.temp_bytes:.3f}** | {fmt(mine)} | {fmt(ref)} |"
            )
        print()
    return [dataclasses.asdict(r) for r in rows + refs]


PIPELINE_MODEL = ["model.d_model=256", "model.heads=8", "model.seq_len=128", "global_batch=32"]


def pipeline_case(overrides: list) -> dict:
    """The CLI's lm_pipeline job with ``overrides``, compiled from shapes: its figures."""
    from replicator.cli import config as cfg_lib
    from replicator.cli import jobs

    cfg = cfg_lib.load("configs/lm_pipeline.yaml", [*PIPELINE_MODEL, *overrides])
    repl, step_fn, state, batch = jobs.abstract_job(cfg)
    t0 = time.perf_counter()
    report = repl.explain(step_fn, state, batch)
    seconds = time.perf_counter() - t0
    lowered = repl.lower(step_fn, state, batch).as_text()
    sends = 0  # bytes of the stage sends in the emitted program, each op once
    for shape in re.findall(r"collective_permute.*: \((tensor<[^>]*>)", lowered):
        dims = shape[len("tensor<") : -1].split("x")
        itemsize = int(re.sub(r"\D", "", dims[-1])) // 8  # f32, bf16, i32, ...
        sends += math.prod(int(d) for d in dims[:-1]) * itemsize
    compiled = report.bytes_by(kind="collective-permute")  # per step, loops per trip
    note = report.pipelines[0] if report.pipelines else None
    per_replica = cfg.global_batch // cfg.mesh["data"]
    return {
        "overrides": overrides,
        # the embedded batch entering the stages and its gradient, fp32: what grows with M at a
        # fixed micro-batch size whatever the schedule (data parallelism holds them too)
        "batch_bytes": 2 * per_replica * cfg.model.seq_len * cfg.model.d_model * 4,
        "flops": report.flops,
        "temp_bytes": report.memory.temporaries,
        "modelled_time": note.modelled_time if note else None,
        "modelled_bubble": note.modelled_bubble if note else None,
        "dataflow_time": note.dataflow_time if note else None,
        "lowered_send_bytes": sends,
        "compiled_permute_bytes": compiled,
        "compile_seconds": seconds,
    }


def part_pipelines() -> list:
    start = time.perf_counter()
    dp = ["mesh.data=8", "mesh.stage=1"]
    cases = {}

    def case(name, overrides):
        cases[name] = pipeline_case(overrides)
        print(f"# {name}: {cases[name]['compile_seconds']:.1f} s", file=sys.stderr)

    m8 = ["pipeline.microbatches=8"]
    case("DP", dp)
    case("DP, 8 layers", [*dp, "model.layers=8"])
    for sched in ("gpipe", "1f1b", "zerobubble"):
        for remat in ("none", "dots", "full"):
            case(f"{sched} {remat}", [*m8, f"pipeline.schedule={sched}", f"model.remat={remat}"])
    for sched in ("1f1b", "interleaved", "circular"):
        for remat in ("none", "full"):
            case(f"{sched} {remat}, 8 layers", [
                *m8, f"pipeline.schedule={sched}", f"model.remat={remat}", "model.layers=8",
                "pipeline.repeats=2",
            ])  # fmt: skip
    for remat in ("none", "full"):
        case(f"1f1b {remat} bf16", [*m8, f"model.remat={remat}", "model.dtype=bfloat16"])
    for sched in ("1f1b", "zerobubble", "interleaved"):
        for m in (8, 16, 32, 64):
            if sched == "1f1b" and m == 8:
                continue  # the "1f1b none" row
            layers = ["model.layers=8", "pipeline.repeats=2"] if sched == "interleaved" else []
            case(f"{sched} none M={m}", [
                f"pipeline.microbatches={m}", "model.remat=none", f"global_batch={4 * m}",
                f"pipeline.schedule={sched}", *layers,
            ])  # fmt: skip
    command = "python " + " ".join(map(shlex.quote, sys.argv))
    print(f"Command: `{command}` ({datetime.date.today()}, jax {jax.__version__}, "
          f"{time.perf_counter() - start:.0f} seconds)\n")  # fmt: skip
    print("### Pipeline schedules: GPT d_model 256, 8 heads, seq 128, batch 32, M = 8, "
          "{data: 2, stage: 4}\n")  # fmt: skip
    print("| schedule, remat | FLOPs / DP's | modelled time (GFLOP) | / 1F1B's | modelled "
          "bubble | temp MiB |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, c in cases.items():
        if "bf16" in name or "M=" in name or name.startswith("DP"):
            continue
        base = cases["DP, 8 layers" if "8 layers" in name else "DP"]
        one = cases["1f1b none, 8 layers" if "8 layers" in name else "1f1b none"]
        print(f"| {name} | **{c['flops'] / base['flops']:.3f}** | {c['modelled_time'] / 1e9:.3f} "
              f"| {c['modelled_time'] / one['modelled_time']:.3f} | {c['modelled_bubble']:.4f} | "
              f"{mib(c['temp_bytes'])} |")  # fmt: skip
    print("\nbf16 between stages (1F1B, M = 8): the stage sends as the library emits them "
          "(lowered) and as XLA:CPU compiled them, and the temporaries:\n")  # fmt: skip
    print("| remat | lowered send bytes fp32 | bf16 | bf16 / fp32 | compiled permute bytes "
          "fp32 | bf16 | temp MiB fp32 | bf16 | bf16 / fp32 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for remat in ("none", "full"):
        a, b = cases[f"1f1b {remat}"], cases[f"1f1b {remat} bf16"]
        print(f"| {remat} | {a['lowered_send_bytes']} | {b['lowered_send_bytes']} | "
              f"**{b['lowered_send_bytes'] / a['lowered_send_bytes']:.3f}** | "
              f"{a['compiled_permute_bytes']:.0f} | {b['compiled_permute_bytes']:.0f} | "
              f"{mib(a['temp_bytes'])} | {mib(b['temp_bytes'])} | "
              f"**{b['temp_bytes'] / a['temp_bytes']:.3f}** |")  # fmt: skip
    print(
        "\nWithout remat, 2 sequences per micro-batch per replica (the global batch grows with "
        "M; interleaved with 8 layers, V = 2); `batch` is the embedded batch entering the "
        "stages and its gradient (2 x B x S x D x 4 bytes), which every layout holds:\n"
    )
    print("| schedule | M | temp MiB | / M = 8 | batch MiB | temp - batch MiB | / M = 8 |")
    print("|---|---|---|---|---|---|---|")
    for sched in ("1f1b", "zerobubble", "interleaved"):
        rows = {m: cases["1f1b none" if (sched, m) == ("1f1b", 8) else f"{sched} none M={m}"]
                for m in (8, 16, 32, 64)}  # fmt: skip
        base = rows[8]
        for m, c in rows.items():
            rest, rest0 = (
                c["temp_bytes"] - c["batch_bytes"],
                base["temp_bytes"] - base["batch_bytes"],
            )
            print(f"| {sched} | {m} | {mib(c['temp_bytes'])} | "
                  f"{c['temp_bytes'] / base['temp_bytes']:.3f} | {mib(c['batch_bytes'])} | "
                  f"{mib(rest)} | **{rest / rest0:.3f}** |")  # fmt: skip
    print()
    return [{"name": k, **v} for k, v in cases.items()]


if __name__ == "__main__":
    main()
