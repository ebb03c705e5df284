"""Reading an optimized HLO module: its collectives and FLOPs, loops counted by their trips.

XLA's ``cost_analysis()`` counts a while loop's body once, whatever its trip count, so a scanned
step (pipeline ticks, accumulation, layer scans) looks many times cheaper than it is. This module
walks the HLO text instead: a loop's body counts ``known_trip_count`` times (nested loops
multiply), a conditional counts its costliest branch (its FLOPs, kernels and collectives: a device
runs one branch, so a per-stage ``lax.switch`` counts one stage's, not the sum over stages), and
fusions and calls count their instructions. Collectives are listed one by one, with the device groups they span.

A conditional that runs on a known share of a loop's iterations can say so with
:func:`runs`: a named scope ``replicator_runs_N_of_D`` that this reader scales by ``N / D``. The
pipeline engine marks the stage shifts (one tick in ``Lv`` layer iterations) and 1F1B's halves
(``M`` busy ticks in ``T``) this way, so their counts are exact rather than upper bounds.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

import numpy as np

from replicator._src.core import tracing
from replicator._src.core.mesh import DCN_AXIS, STAGE_AXIS
from replicator._src.report import convolution, hlo_bytes, loops, pallas_kernels
from replicator._src.report.device_groups import axes_spanned, replica_groups
from replicator._src.report.hlo_bytes import _ARRAY, _CALLS, _num_elements, shape_bytes

_STARTS = re.compile(r"^\s+(ROOT )?%?[\w.\-]+ = ")
_ENDS = re.compile(r"^\}(\s*$|, \w+=)")
KERNEL_FLOPS = re.compile(r"replicator_kernel_flops_(\d+)")
# A Pallas kernel's call (TPU; Triton and Mosaic on GPUs): the custom calls read as kernels. A
# sharding annotation in a kernel's scope (shard_map's around megablox) is none.
PALLAS_TARGETS = re.compile(
    r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|mosaic_gpu\w*)"'
)
MEGASCALE = "_xla_megascale_transfer_type"  # a send across TPU slices (the DCN runtime's)
COLLECTIVES = (
    "all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
    "ragged-all-to-all",  # its payload: the rows it may send (the sizes are run-time values)
)  # fmt: skip

# Element-wise operations XLA counts as one FLOP per output element, and the transcendental
# ones it counts apart (as in XLA's HloCostAnalysis).
_ELEMENTWISE = frozenset(
    "add subtract multiply divide remainder maximum minimum negate abs sign compare select "
    "and or xor not clamp floor ceil round-nearest-afz round-nearest-even atan2 power "
    "shift-left shift-right-logical shift-right-arithmetic".split()
)
_TRANSCENDENTAL = frozenset(
    "exponential exponential-minus-one log log-plus-one tanh logistic sqrt rsqrt cbrt sine "
    "cosine tan erf".split()
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program, per device and per step.

    Attributes:
      kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"collective-permute"``
        or ``"all-to-all"``.
      axes: the mesh axes its device groups span, e.g. ``("data",)``; ``()`` if no device
        talks to another.
      dtype: the element type on the wire, as the compiled program has it (``"f32"``).
      group_size: the devices in each group (2 for a collective-permute).
      bytes: the payload per execution on one device: the buffer reduced (all-reduce), the
        gathered result (all-gather), the input scattered (reduce-scatter), the buffer sent
        (collective-permute, all-to-all).
      count: executions per step (loop trips included; scaled by ``runs`` marks).
      wire_bytes: bytes one device sends per step with ring algorithms:
        ``2 (g-1)/g bytes`` per all-reduce, ``(g-1)/g bytes`` per all-gather, reduce-scatter
        and all-to-all, ``bytes`` per collective-permute; times ``count``.
      conditional: it sits in a branch of a conditional (``count`` assumes that branch runs).
      op_name: the JAX operation it came from (the HLO metadata), e.g. ``".../psum"``.
      across: its part across TPU slices (a send to the DCN runtime); in a program of several
        slices, the others stay inside a slice.
    """

    kind: str
    axes: tuple[str, ...]
    dtype: str
    group_size: int
    bytes: int
    count: float
    wire_bytes: float
    conditional: bool
    op_name: str
    across: bool = False

    @property
    def total_bytes(self) -> float:
        """``bytes * count``: the payload per device per step."""
        return self.bytes * self.count


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one device executes per step: FLOPs, transcendentals and collectives."""

    flops: float  # every floating-point operation XLA would count, loops per trip
    matmul_flops: float  # the dot and convolution share of ``flops``
    transcendentals: float
    collectives: tuple[Collective, ...]
    unknown_trip_counts: int  # while loops without a known trip count (counted once)
    bytes_accessed: float = 0.0  # memory read and written by each kernel, loops per trip
    roofline: tuple[tuple[float, float], ...] = ()  # (FLOPs, bytes) of kernels of like intensity
    kernel_flops: float = 0.0  # the share of ``flops`` in kernels XLA does not see (Pallas)
    host_bytes: float = 0.0  # moved between host memory and the device (offloaded activations)


@dataclasses.dataclass
class _Inst:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    root: bool = False


def _split_instruction(line: str) -> _Inst | None:
    body = line.strip()
    root = body.startswith("ROOT ")
    if root:
        body = body[5:]
    name, sep, rest = body.partition(" = ")
    if not sep or " " in name:
        return None
    if rest.startswith("("):  # a tuple shape: up to the matching parenthesis
        end = _closing(rest, 1)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _closing(rest, 0, depth=1)
    operands = re.findall(r"%([\w.\-]+)", rest[:end])
    if op in ("parameter", "constant"):  # its number, or its value (a loop's bound)
        operands = [rest[:end].strip()]
    return _Inst(name.lstrip("%"), shape, op, operands, rest[end + 1 :], root)


def _closing(text: str, start: int, depth: int = 1) -> int:
    """The index of the parenthesis that closes ``depth`` open ones, scanning from ``start``."""
    for i in range(start, len(text)):
        depth += (text[i] == "(") - (text[i] == ")")
        if depth == 0:
            return i
    return len(text)


def parse_module(text: str) -> tuple[str, dict[str, list[_Inst]]]:
    """The entry computation's name and every computation's instructions. An instruction may
    span lines (the TPU compiler writes its kernels' metadata with newlines in it): a line
    that starts no instruction continues the one before."""
    comps: dict[str, list[_Inst]] = {}
    entry, current, pending = None, None, []

    def flush():
        inst = _split_instruction(" ".join(pending)) if pending else None
        if inst is not None:
            comps[current].append(inst)
        pending.clear()

    for line in text.splitlines():
        if current is None:
            head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
            if head:
                current = head.group(2)
                comps[current] = []
                entry = current if head.group(1) else entry
            continue
        if _ENDS.match(line):  # "}", or "}, execution_thread=..." (the TPU's SparseCore)
            flush()
            current = None
        elif _STARTS.match(line):
            flush()
            pending.append(line)
        elif pending:
            pending.append(line.strip())
    if entry is None:
        raise ValueError("hlo: no ENTRY computation in the module text.")
    return entry, comps


def _dims(shape: str) -> list[int]:
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _elements(shape: str) -> int:
    return sum(_num_elements(dims) for _, dims in _ARRAY.findall(shape))


_ZERO = (Fraction(0),) * 3


def _bin(flops: Fraction, nbytes: Fraction) -> int:
    """Kernels of like arithmetic intensity (FLOPs per byte, within a factor of sqrt 2) share a
    bin: a roofline over the bins is within that factor of one over every kernel."""
    if nbytes <= 0:
        return 10**6
    if flops <= 0:
        return -(10**6)
    return int(np.floor(2 * np.log2(float(flops) / float(nbytes))))


def _note(kernels: dict | None, flops: Fraction, nbytes: Fraction) -> None:
    if kernels is None or (flops <= 0 and nbytes <= 0):
        return
    f, b = kernels.get(_bin(flops, nbytes), (Fraction(0), Fraction(0)))
    kernels[_bin(flops, nbytes)] = (f + flops, b + nbytes)


def _merge(into: dict | None, other: dict) -> None:
    if into is None:
        return
    for k, (f, b) in other.items():
        g, c = into.get(k, (Fraction(0), Fraction(0)))
        into[k] = (g + f, c + b)


def _add(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b))


def _wire(kind: str, payload: int, g: int) -> float:
    if kind in ("collective-permute", "one-to-one"):  # one-to-one: a permute's DCN part
        return float(payload)
    share = (g - 1) / g if g else 0.0
    return (2 if kind == "all-reduce" else 1) * share * payload


class _Walker(hlo_bytes.KernelBytes):
    def __init__(self, comps: dict[str, list[_Inst]], mesh_shape: dict[str, int], slices=1):
        self.comps = comps
        # A program for S slices names the devices of one slice (its part inside a slice; the
        # part across is a send to the DCN runtime): the mesh of one slice, the axis across
        # the slices (`mesh.build_mesh`'s: dcn_data, else stage) S times shorter.
        self.across = (
            DCN_AXIS if DCN_AXIS in mesh_shape or STAGE_AXIS not in mesh_shape else STAGE_AXIS
        )
        self.slices = slices
        self.mesh_shape = {
            a: (n // slices if a == self.across and slices > 1 else n)
            for a, n in mesh_shape.items()
        }
        self.num_devices = int(np.prod(list(self.mesh_shape.values()), dtype=np.int64))
        self.shapes = {i.name: i.shape for insts in comps.values() for i in insts}
        self.unknown_trips = 0
        self.kernel_flops, self.host_moved = Fraction(0), Fraction(0)
        self.caller = {i.name: c for c, insts in comps.items() for i in insts}

    def visit(self, comp, mult, cond, applied, out, kernels=None, fused=False):
        """(FLOPs, matmul FLOPs, transcendentals) of ``comp`` run ``mult`` times; its
        collectives are appended to ``out``, and unless ``fused`` (inside a fusion, where
        nothing is stored between instructions) each kernel's FLOPs and bytes to ``kernels``."""
        total = (Fraction(0),) * 3
        for inst in self.comps[comp]:
            op_name = re.search(r'op_name="([^"]*)"', inst.attrs)
            op_name = op_name.group(1) if op_name else ""
            m, marks = mult, applied
            for found in tracing.RUNS_MARK.finditer(op_name):
                key = op_name[: found.end()]
                if key not in marks:
                    m, marks = m * Fraction(int(found.group(1)), int(found.group(2))), marks | {key}
            cost = self.instruction(inst, m, cond, marks, op_name, out, kernels, fused)
            total = _add(total, cost)
        return total

    def instruction(self, inst, mult, cond, marks, op_name, out, kernels, fused):
        op = inst.op.removesuffix("-start")
        if inst.op.endswith("-done"):
            return _ZERO
        self.host_moved += mult * self.host_bytes(inst)
        if op in COLLECTIVES:
            out.append(self.collective(inst, op, mult, cond, op_name))
            return _ZERO
        if inst.op == "send" and MEGASCALE in inst.attrs:  # across slices, over the DCN
            out.append(self.across_slices(inst, mult, cond, op_name))
            return _ZERO
        called = dict(_CALLS.findall(inst.attrs))
        if inst.op == "while":
            n = self.trips(inst)
            body = self.visit(called["body"], mult * n, cond, marks, out, kernels, fused)
            cond_cost = self.visit(
                called["condition"], mult * (n + 1), cond, marks, out, kernels, fused
            )
            return _add(body, cond_cost)
        if inst.op == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
            names = (
                re.findall(r"%?([\w.\-]+)", branches.group(1))
                if branches
                else [called["true_computation"], called["false_computation"]]
            )
            runs, before = [], self.kernel_flops
            for name in names:  # a device runs one branch: the costliest counts, whole
                own: dict = {}
                sent: list = []
                self.kernel_flops = before
                cost = self.visit(name, mult, True, marks, sent, own, fused)
                runs.append((cost, own, self.kernel_flops, sent))
            cost, own, self.kernel_flops, sent = max(runs, key=_branch_cost)
            _merge(kernels, own)
            out.extend(sent)
            return cost
        if inst.op == "fusion" and "calls" in called:
            first = len(out)
            cost = self.visit(called["calls"], mult, cond, marks, out, None, True)
            if "AllReduceScatter" in inst.attrs:  # the TPU's reduce-scatter: an all-reduce
                out[first:] = [_as_reduce_scatter(c) for c in out[first:]]  # sliced per device
            if not fused:
                _note(kernels, cost[0], mult * self.fusion_bytes(inst, called["calls"]))
            return cost
        if inst.op in ("call", "async-start") and "calls" in called:
            return self.visit(called["calls"], mult, cond, marks, out, kernels, fused)
        if inst.op == "custom-call" and PALLAS_TARGETS.search(inst.attrs):
            cost = self.kernel_cost(inst, mult, op_name)
        else:
            cost = self.leaf_cost(inst, mult)
        if not fused:
            _note(kernels, cost[0], mult * self.leaf_bytes(inst))
        return cost

    def trips(self, inst: _Inst) -> int:
        """A loop's trip count: XLA:CPU's ``known_trip_count``, else read from its code (the
        TPU compiler's loops, `loops.trip_count`), else 1 and counted as unknown."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
        if known:
            return int(known.group(1))
        n = loops.trip_count(inst, self.comps[self.caller[inst.name]], self.comps)
        if n is None:
            self.unknown_trips += 1
        return 1 if n is None else n

    def kernel_cost(self, inst: _Inst, mult: Fraction, op_name: str) -> tuple:
        """A kernel XLA does not see inside (a Pallas call): the FLOPs its caller named in its
        scope (``replicator_kernel_flops_N``, the forward's), times the backward kernels'
        share (splash attention's ``dq`` recomputes the scores: 1.5, ``dkv``: 2); without a
        name, JAX's own splash and grouped-matmul kernels from their shapes
        (`pallas_kernels.untagged_flops`: another library's program, such as MaxText's)."""
        found = KERNEL_FLOPS.search(op_name)
        if found is None:
            forward = pallas_kernels.untagged_flops(inst.name, inst.shape, inst.attrs)
            if not forward:
                return _ZERO
            flops = mult * forward
        else:
            share = Fraction(3, 2) if "_dq" in inst.name else 2 if "_dkv" in inst.name else 1
            flops = mult * int(found.group(1)) * share
        self.kernel_flops += flops
        return flops, flops, Fraction(0)

    def leaf_cost(self, inst: _Inst, mult: Fraction) -> tuple[Fraction, Fraction, Fraction]:
        op = inst.op
        if op == "dot":
            lhs = _dims(self.shapes.get(inst.operands[0], ""))
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
            k = (
                int(np.prod([lhs[int(d)] for d in contracting.group(1).split(",") if d]))
                if contracting
                else 1
            )
            flops = mult * 2 * _elements(inst.shape) * k
            return flops, flops, Fraction(0)
        if op == "convolution":
            lhs, rhs = (_dims(self.shapes.get(o, "")) for o in inst.operands[:2])
            flops = mult * convolution.flops(lhs, rhs, _dims(inst.shape), inst.attrs)
            return flops, flops, Fraction(0)
        if op in _ELEMENTWISE:
            return mult * _elements(inst.shape), Fraction(0), Fraction(0)
        if op in _TRANSCENDENTAL:
            return Fraction(0), Fraction(0), mult * _elements(inst.shape)
        if op in ("reduce", "reduce-window"):
            return mult * _elements(self.shapes.get(inst.operands[0], "")), Fraction(0), Fraction(0)
        return _ZERO

    def collective(self, inst: _Inst, kind: str, mult: Fraction, cond: bool, op_name: str):
        if kind == "collective-permute":
            pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", inst.attrs)
            groups = [
                [int(a), int(b)]
                for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1) if pairs else "")
            ]
            g = 2
        else:
            groups = replica_groups(inst.attrs, self.num_devices)
            g = max(len(x) for x in groups)
        result = inst.shape
        if inst.op.endswith("-start") and result.startswith("("):
            # async forms return (operands..., results...): keep the results half
            arrays = _ARRAY.findall(result)
            if kind == "collective-permute":  # the TPU's adds u32[] contexts: not payload
                arrays = [a for a in arrays if a[1] != "" or a[0] not in ("u32", "s32")]
            result = " ".join(f"{d}[{s}]" for d, s in arrays[len(arrays) // 2 :])
        if kind == "ragged-all-to-all":  # sends at most its input; the output is a buffer
            result = self.shapes.get(inst.operands[0], result)
        payload = shape_bytes(result) * (g if kind == "reduce-scatter" else 1)
        dtypes = sorted({d for d, _ in _ARRAY.findall(result)})
        return Collective(
            kind=kind,
            axes=axes_spanned(groups, self.mesh_shape),
            dtype="+".join(dtypes),
            group_size=g,
            bytes=payload,
            count=float(mult),
            wire_bytes=_wire(kind, payload, g) * float(mult),
            conditional=cond,
            op_name=op_name,
        )

    def across_slices(self, inst: _Inst, mult: Fraction, cond: bool, op_name: str):
        """A collective's part across TPU slices: the TPU compiler writes it as a ``send`` to
        the DCN runtime (``_xla_megascale_transfer_type``), after the part inside each slice
        (a hierarchical collective). Its group is the slices (the mesh's ``dcn_data`` axis). The
        buffer sent is this device's input: the payload, but for an all-gather, whose payload
        is the gathered result (``g`` of them; Llama 3.1 405B on two v6e-256 slices sends each
        chip's bf16 shard of the weights, 1.47 GiB, twice a step)."""
        kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', inst.attrs).group(1)
        kind = kind.lower().replace("_", "-")
        arrays = [a for a in _ARRAY.findall(inst.shape) if a[0] not in ("u32", "token")]
        g = self.slices if self.slices > 1 else 2  # the slices are the group
        payload = shape_bytes(" ".join(f"{d}[{s}]" for d, s in arrays[:1]))
        payload *= g if kind == "all-gather" else 1
        return Collective(
            kind=kind, axes=(self.across,), dtype=arrays[0][0] if arrays else "", group_size=g,
            bytes=payload, count=float(mult), wire_bytes=_wire(kind, payload, g) * float(mult),
            conditional=cond, op_name=op_name, across=True,
        )  # fmt: skip


def _branch_cost(run: tuple) -> tuple:
    """A conditional's branch, by what a device running it does: its FLOPs (transcendentals
    with them), then the bytes its collectives put on the wire."""
    (flops, _, trans), _, _, sent = run
    return flops + trans, sum(c.wire_bytes for c in sent)


def _as_reduce_scatter(c: Collective) -> Collective:
    """An all-reduce inside the TPU compiler's all-reduce-scatter fusion (each device keeps
    its slice of the result): on the wire, a reduce-scatter of the same payload."""
    if c.kind != "all-reduce":
        return c
    wire = _wire("reduce-scatter", c.bytes, c.group_size) * c.count
    return dataclasses.replace(c, kind="reduce-scatter", wire_bytes=wire)


def analyze(text: str, mesh_shape: dict[str, int], slices: int = 1) -> Costs:
    """FLOPs, transcendentals and collectives per device per step of an optimized HLO module.

    ``mesh_shape`` gives the mesh the program was partitioned over, in the order of its devices
    (collective device ids are positions in that order); ``slices``, the TPU slices it spans
    (its device ids are then one slice's, and its sends across slices are collectives over the
    axis laid across them: ``dcn_data``, else ``stage``).

    >>> hlo = '''
    ... ENTRY %main (p: f32[4,8], q: f32[8,2]) -> f32[4,2] {
    ...   %p = f32[4,8]{1,0} parameter(0)
    ...   %q = f32[8,2]{1,0} parameter(1)
    ...   %d = f32[4,2]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ...   ROOT %s = f32[4,2]{1,0} all-reduce(%d), replica_groups={{0,2},{1,3}}, to_apply=%add
    ... }
    ... '''
    >>> costs = analyze(hlo, {"data": 2, "model": 2})
    >>> costs.flops, costs.collectives[0].axes, costs.collectives[0].bytes
    (128.0, ('data',), 32)
    """
    entry, comps = parse_module(text)
    walker = _Walker(comps, mesh_shape, slices)
    out: list[Collective] = []
    kernels: dict = {}
    flops, matmul, trans = walker.visit(entry, Fraction(1), False, frozenset(), out, kernels)
    roofline = tuple((float(f), float(b)) for _, (f, b) in sorted(kernels.items()))
    return Costs(
        float(flops), float(matmul), float(trans), tuple(out), walker.unknown_trips,
        bytes_accessed=float(sum(b for _, b in roofline)), roofline=roofline,
        kernel_flops=float(walker.kernel_flops), host_bytes=float(walker.host_moved),
    )  # fmt: skip
