"""What a step costs, read from its compiled program: memory, FLOPs, collectives and bubble.

``Replicator.explain(step_fn, state, *args)`` compiles the step for its mesh without running it
and returns a :class:`StepReport`:

* per-device memory, from ``compiled.memory_analysis()``: arguments, outputs, temporaries;
* FLOPs and every collective per step, from the optimized HLO (see ``hlo.py``: loops count as
  many times as they run, which ``cost_analysis()`` does not do);
* for each pipeline in the step, its schedule, bubble fraction and picture, noted by the
  pipeline engine while the step is traced, and its step time modelled on K parallel devices
  from each stage's FLOPs (``timing.step_time``), since emulated devices cannot show a bubble.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections import Counter

import jax.numpy as jnp

from replicator._src.core import targets
from replicator._src.core.tracing import PipelineNote, ZeroNote
from replicator._src.report import hlo
from replicator._src.report.target_report import TargetReport, lines, target_report

Collective = hlo.Collective


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device of a compiled step (``memory_analysis``).

    Attributes:
      arguments: the inputs: this device's shards of the state and of the batch.
      outputs: the results: the new state's shards and this device's row of the outputs.
      temporaries: the scratch the program needs while it runs (activations, gradients).
      aliased: output bytes that reuse donated argument buffers (``Replicator.run`` donates the
        state, so a step's new state takes the old one's place).
      generated_code: the compiled code.
      host: bytes the program keeps in its host's memory (``pinned_host``: offloaded
        activations), which ``peak`` does not count.
      compiler_peak: the HBM a TPU program takes by libtpu's own allocation, its arguments
        with its temporaries as libtpu packs them (`_compiler_peak`); 0 elsewhere (XLA:CPU's
        figures leave the temporaries out).
    """

    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    generated_code: int
    host: int = 0
    compiler_peak: int = 0

    @property
    def bound(self) -> int:
        """An upper bound of the bytes live at once: arguments + outputs - aliased + temps."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def peak(self) -> int:
        """The bytes live at once: the TPU compiler's own figure where it gives one, else `bound`.

        The bound can be far over: libtpu's ``temp_size_in_bytes`` counts apart buffers its
        allocator packs by their lifetimes. Mixtral 8x22B on v6e-256 (libtpu 0.0.50.1): under
        full remat with 2 accumulation steps 40.9 GiB of bound against the 29.5 GiB libtpu
        allocates (of the 31.2 it has); the recipe, with offloaded activations, 25.8 against
        21.3; the recipe over ``data=256``, 36.1 against 27.8."""
        return self.compiler_peak or self.bound


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one step costs on its mesh, read from the compiled program; nothing was run.

    Every figure is per device and per step unless its name says otherwise. Print it for a
    table, or use ``to_json()``.

    Attributes:
      step: the step function's name.
      mesh: the mesh's axes and sizes, e.g. ``{"data": 2, "stage": 4}``.
      lowering: ``"shard_map"`` or ``"pmap"``.
      platform: the devices compiled for (``"cpu"`` when emulating a mesh).
      num_devices: the devices of the mesh.
      compile_seconds: time to trace, lower and compile.
      memory: per-device bytes (`Memory`).
      flops: floating-point operations per device per step (loops counted per trip), as XLA
        counts them: matmuls, and one per element of each element-wise operation.
      matmul_flops: the dot and convolution part of ``flops``: the model's arithmetic.
      transcendentals: exp, log, tanh, ... per device per step.
      xla_flops: ``cost_analysis()["flops"]`` for reference (counts each loop body once).
      collectives: every collective instruction (`hlo.Collective`).
      pipelines: the pipelines traced in the step (`PipelineNote`).
      unknown_trip_counts: loops without a known trip count, counted once (figures are then
        lower bounds).
      bytes_accessed: memory each kernel (a fusion, or an unfused instruction) reads and writes
        per step, loops counted per trip; a slice of an operand counts as the slice, an update
        in place as the update (as XLA's cost analysis counts them, without its loop-once rule).
      roofline: ``(FLOPs, bytes)`` of the kernels, grouped by arithmetic intensity (within a
        factor of sqrt 2): a roofline time ``sum(max(f / peak, b / bandwidth))`` over the groups.
      zero: the ZeRO updates traced in the step (`ZeroNote`): how many parameters are split
        over the replicas, how many (and how many bytes) are kept whole because no axis
        divides by them, and which operations of the optimizer, if any, gather.
      kernel_flops: the share of ``flops`` in kernels XLA's cost analysis does not see (Pallas
        kernels such as splash attention), from the work each names in its scope.
      host_bytes: bytes moved between the host's memory and the device per step, loops per
        trip (offloaded activations written in the forward pass and read back in the backward).
      target: for a step compiled for a TPU target (`replicator.tpu_devices`), what it means
        on that TPU (`TargetReport`: HBM and ``fits``, ``step_seconds``, ``xla_seconds``, MFU);
        None on other devices. In ``to_json()`` its keys stand at the top level.
    """

    step: str
    mesh: dict[str, int]
    lowering: str
    platform: str
    num_devices: int
    compile_seconds: float
    memory: Memory
    flops: float
    matmul_flops: float
    transcendentals: float
    xla_flops: float | None
    collectives: tuple[Collective, ...]
    pipelines: tuple[PipelineNote, ...]
    unknown_trip_counts: int = 0
    bytes_accessed: float = 0.0
    roofline: tuple[tuple[float, float], ...] = ()
    zero: tuple[ZeroNote, ...] = ()
    target: TargetReport | None = None
    kernel_flops: float = 0.0
    host_bytes: float = 0.0

    @property
    def collective_bytes(self) -> float:
        """The payload of every collective per device per step (`Collective.total_bytes`)."""
        return sum(c.total_bytes for c in self.collectives)

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per step with ring algorithms (`Collective.wire_bytes`)."""
        return sum(c.wire_bytes for c in self.collectives)

    def bytes_by(self, *, kind: str | None = None, axes: tuple[str, ...] | None = None) -> float:
        """Payload per device per step of the collectives of this ``kind`` and/or ``axes``."""
        return sum(
            c.total_bytes
            for c in self.collectives
            if (kind is None or c.kind == kind) and (axes is None or c.axes == tuple(axes))
        )

    def collective_summary(self) -> list[dict]:
        """The collectives grouped by kind, axes and dtype: count, payload and wire bytes."""
        groups: dict[tuple, dict] = {}
        for c in self.collectives:
            g = groups.setdefault(
                (c.kind, c.axes, c.dtype),
                {"kind": c.kind, "axes": c.axes, "dtype": c.dtype, "ops": 0, "count": 0.0,
                 "bytes": 0.0, "wire_bytes": 0.0},
            )  # fmt: skip
            g["ops"] += 1
            g["count"] += c.count
            g["bytes"] += c.total_bytes
            g["wire_bytes"] += c.wire_bytes
        return list(groups.values())

    def to_json(self) -> str:
        """The whole report as JSON (every collective listed)."""
        data = dataclasses.asdict(self)
        data.update(data.pop("target") or {"target": None})  # its keys at the top level
        data["memory"]["peak"] = self.memory.peak
        data["memory"]["bound"] = self.memory.bound
        data["collective_bytes"] = self.collective_bytes
        data["wire_bytes"] = self.wire_bytes
        data["collective_summary"] = self.collective_summary()
        return json.dumps(data, indent=2)

    def __rich__(self):
        return _renderable(self)

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=110, color_system=None, soft_wrap=False).print(self)
        return buffer.getvalue().rstrip()

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython / Jupyter
        printer.text(str(self))


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _count(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def _modelled(p: PipelineNote) -> str:
    """The step time modelled on K parallel devices, with the stages' measured FLOPs."""
    head = f"modelled step on {p.num_stages} parallel devices in lock-step ticks: "
    if p.stage_costs is None:
        return (
            f"{head}{p.equal_time:.4g} units with equal costs (F = B = W = 1 unit), bubble "
            f"{p.equal_bubble:.1%}; {p.dataflow_time:.4g} units without tick barriers "
            f"(dataflow). Stage FLOPs not measured: {p.cost_note}"
        )
    c, unit = p.stage_costs, "FLOPs" if p.cost_unit == "flops" else p.cost_unit

    def costs(name: str, values: tuple[float, ...]) -> str:
        return f"{name} " + " ".join(f"{v:.3g}" for v in values)

    passes = [costs("F", c.forward)]
    if any(c.backward) and p.schedule == "zerobubble":
        passes += [costs("B", c.backward_input), costs("W", c.backward_weight)]
    elif any(c.backward):
        passes.append(costs("backward", c.backward))
    return (
        f"{head}{p.modelled_time:.4g} {unit} (each tick as long as its busiest stage), bubble "
        f"{p.modelled_bubble:.1%} with the stages' measured costs ({p.equal_bubble:.1%} with "
        f"equal costs); {p.dataflow_time:.4g} {unit} without tick barriers (dataflow)\n"
        f"{unit} of one micro-batch, stage by stage: " + "; ".join(passes)
    )


def _renderable(r: StepReport):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    mesh = " x ".join(f"{k}={v}" for k, v in r.mesh.items())
    head = Text(
        f"{r.step} on mesh {mesh} ({r.num_devices} {r.platform} devices, {r.lowering})\n"
        f"compiled in {r.compile_seconds:.1f} s, nothing run; figures per device and per step"
    )
    mem = Table(title="memory per device", title_justify="left", show_header=False)
    mem.add_column("what")
    mem.add_column("bytes", justify="right")
    m = r.memory
    rows = [("arguments (state + batch)", m.arguments), ("outputs", m.outputs),
            ("aliased (donated state reused)", m.aliased), ("temporaries", m.temporaries),
            ("peak (the HBM libtpu allocates)" if m.compiler_peak else
             "peak (arguments + outputs - aliased + temporaries)", m.peak)]  # fmt: skip
    if m.host:
        rows.append(("in host memory (offloaded; not in the peak)", m.host))
    for what, n in rows + _held_rows(r.pipelines):
        mem.add_row(what, format_bytes(n))
    compute = Table(title="compute per device", title_justify="left", show_header=False)
    compute.add_column("what")
    compute.add_column("value", justify="right")
    compute.add_row("FLOPs per step", f"{r.flops:.4g}")
    compute.add_row("of which matmuls (dot, convolution)", f"{r.matmul_flops:.4g}")
    if r.kernel_flops:
        compute.add_row("of which in Pallas kernels (not seen by XLA)", f"{r.kernel_flops:.4g}")
    compute.add_row("transcendentals", f"{r.transcendentals:.4g}")
    compute.add_row("bytes read and written by the kernels", format_bytes(r.bytes_accessed))
    if r.host_bytes:
        compute.add_row("bytes moved between host and device", format_bytes(r.host_bytes))
    if r.xla_flops is not None:
        compute.add_row("XLA cost_analysis FLOPs (loop bodies once)", f"{r.xla_flops:.4g}")
    coll = Table(title="collectives per device per step", title_justify="left")
    for name, justify in (("kind", "left"), ("axes", "left"), ("dtype", "left"),
                          ("ops", "right"), ("executions", "right"), ("payload", "right"),
                          ("on the wire (ring)", "right")):  # fmt: skip
        coll.add_column(name, justify=justify)
    for g in r.collective_summary():
        coll.add_row(g["kind"], ",".join(g["axes"]) or "-", g["dtype"], str(g["ops"]),
                     _count(g["count"]), format_bytes(g["bytes"]),
                     format_bytes(g["wire_bytes"]))  # fmt: skip
    coll.add_row("total", "", "", str(len(r.collectives)), "", format_bytes(r.collective_bytes),
                 format_bytes(r.wire_bytes), style="bold")  # fmt: skip
    parts = [head, mem, compute, coll]
    if r.target is not None:
        parts.append(Text("\n".join(lines(r.target, format_bytes))))
    for p in r.pipelines:
        parts.append(
            Text(
                f"pipeline: {p.schedule}, K={p.num_stages} stages, M={p.num_microbatches} "
                f"micro-batches, V={p.repeats}, T={p.ticks} ticks, bubble "
                f"{p.bubble_fraction:.1%}; each tick a stage sends "
                f"{format_bytes(p.activation_bytes)} of activations "
                f"({p.sends_per_step} sends per step)"
            )
        )
        if p.padding:
            parts.append(Text(p.padding))
        if p.equal_time > 0:  # modelled when the plan was noted
            parts.append(Text(_modelled(p)))
        parts.append(Text(p.picture))
    for z in r.zero:
        parts.append(Text(_zero_line(z)))
    if r.unknown_trip_counts:
        parts.append(
            Text(
                f"note: {r.unknown_trip_counts} loop(s) without a known trip count were counted "
                "once; FLOPs and collective bytes are lower bounds.",
                style="yellow",
            )
        )
    return Group(*parts)


def _held_rows(pipelines) -> list[tuple[str, int]]:
    """The memory table's rows for what a pipeline with ``scatter_grads="step"`` holds for
    the step, as found in the compiled program's loops (`_held_in_loops`), else as traced."""
    rows = []
    for p in pipelines:
        found = p.held_bytes or (0, 0)
        for what, held, n in (
            ("stage gradients, summed whole over the micro-batches", p.held_grads, found[0]),
            ("stage weights, gathered once a step", p.held_weights, found[1]),
        ):
            if held:
                traced = sum(math.prod(s) * jnp.dtype(d).itemsize for d, s in held)
                src = "" if n else ", as traced: not found in the loops"
                rows.append((f"  of which {what} ({p.schedule}{src})", n or traced))
    return rows


_HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


def _held_in_loops(text: str, notes: list[PipelineNote]) -> list[PipelineNote]:
    """``notes`` with ``held_bytes`` read from the compiled program ``text``: for the whole
    gradients and for the weights a note lists, the most bytes of them that the state of one of
    its loops holds (matched by dtype and size; XLA may reshape a buffer)."""
    if not any(p.held_grads for p in notes):
        return list(notes)
    _, comps = hlo.parse_module(text)
    states = [
        Counter((d, hlo._num_elements(dims)) for d, dims in hlo._ARRAY.findall(i.shape))
        for insts in comps.values()
        for i in insts
        if i.op == "while"
    ]

    def found(held) -> int:
        want = Counter((_HLO_DTYPES.get(d, d), math.prod(s)) for d, s in held)
        size = {(_HLO_DTYPES.get(d, d), math.prod(s)): jnp.dtype(d).itemsize for d, s in held}
        return max(
            (sum(min(n, st[k]) * k[1] * size[k] for k, n in want.items()) for st in states),
            default=0,
        )

    return [
        dataclasses.replace(p, held_bytes=(found(p.held_grads), found(p.held_weights)))
        if p.held_grads
        else p
        for p in notes
    ]


def _zero_line(z: ZeroNote) -> str:
    line = (
        f"ZeRO-{z.zero_stage}: {z.split_leaves} parameters split over the {z.num_replicas} "
        f"replicas, each along one axis of its own shape"
    )
    if z.whole_leaves:
        line += (
            f"; {z.whole_leaves} kept whole on every replica (no axis divides by "
            f"{z.num_replicas}: {format_bytes(z.whole_bytes)} of parameters per device, their "
            f"gradients all-reduced and their state whole)"
        )
    if z.gathered:
        line += f"; the optimizer gathers for {len(z.gathered)} operation(s): " + "; ".join(
            z.gathered
        )
    else:
        line += "; the optimizer's update runs on shards"
    return line


def _compiler_peak(stats) -> int:
    """The HBM a TPU program takes, by libtpu: ``total_allocation_bytes`` (its buffers as it
    packs them, the arguments with them: what libtpu's log calls the program's HBM usage, to
    0.5% on Mixtral 8x22B / v6e-256 with and without offloaded activations); 0 from a jax
    without it (0.10: its ``peak_memory_in_bytes`` was twice libtpu 0.0.42's own figure on a
    small MLP, and counts host buffers too)."""
    return int(getattr(stats, "total_allocation_bytes", 0) or 0)


def report(
    compiled, *, step: str, mesh_shape: dict[str, int], lowering: str, platform: str,
    compile_seconds: float, pipelines: list[PipelineNote], zero: list[ZeroNote] = (),
    target: targets.Target | None = None, model_flops: float | None = None,
) -> StepReport:  # fmt: skip
    """A `StepReport` from a compiled program (``jax.stages.Compiled``); with ``target``, its
    `TargetReport` too (``model_flops`` per device per step for the MFU)."""
    stats = compiled.memory_analysis()
    memory = Memory(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
        generated_code=int(stats.generated_code_size_in_bytes),
        host=sum(int(getattr(stats, f"host_{k}_size_in_bytes", 0) or 0) for k in
                 ("argument", "output", "temp")) - int(getattr(stats, "host_alias_size_in_bytes", 0) or 0),
        compiler_peak=_compiler_peak(stats) if platform == "tpu" else 0,
    )  # fmt: skip
    text = compiled.as_text()
    costs = hlo.analyze(text, mesh_shape, slices=1 if target is None else target.slices)
    try:
        analysis = compiled.cost_analysis() or {}
    except Exception:  # not every backend implements it
        analysis = {}
    xla_flops = float(analysis["flops"]) if "flops" in analysis else None
    result = StepReport(
        step=step,
        mesh=dict(mesh_shape),
        lowering=lowering,
        platform=platform,
        num_devices=math.prod(mesh_shape.values()),
        compile_seconds=compile_seconds,
        memory=memory,
        flops=costs.flops,
        matmul_flops=costs.matmul_flops,
        transcendentals=costs.transcendentals,
        xla_flops=xla_flops,
        collectives=costs.collectives,
        pipelines=tuple(_held_in_loops(text, pipelines)),
        unknown_trip_counts=costs.unknown_trip_counts,
        bytes_accessed=costs.bytes_accessed,
        roofline=costs.roofline,
        zero=tuple(zero),
        kernel_flops=costs.kernel_flops,
        host_bytes=costs.host_bytes,
    )
    if target is None:
        return result
    optimal = analysis.get("optimal_seconds")
    return dataclasses.replace(result, target=target_report(
        result, target, optimal_seconds=None if optimal is None else float(optimal),
        model_flops=model_flops,
    ))  # fmt: skip
