"""The bytes each kernel of an optimized HLO module reads and writes (its roofline's memory side).

A kernel is a fusion, or an unfused instruction. It reads its operands and writes its result,
as XLA's cost analysis counts them, except:

* an operand that the kernel only slices counts its slices: directly, through bitcasts and
  copies, or through a nested fusion's parameter (the TPU compiler nests the slice of a loop's
  operand, and relayouts it with a ``copy_fusion``, computed where the slice is read);
* an update in place (a ``dynamic-update-slice`` root or output of a multi-output fusion,
  through bitcasts, on its buffer or on a copy of it that aliases it) counts the update, read
  and written, not the whole buffer.
"""

from __future__ import annotations

import re

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "s2": 0.25, "u2": 0.25, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_CALLS = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (a tuple shape adds its elements)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES and not dtype.startswith("f8"):
            raise ValueError(f"hlo: unknown element type {dtype!r} in {shape!r}")
        total += _DTYPE_BYTES.get(dtype, 1) * _num_elements(dims)
    return int(total)


def _num_elements(dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))


_NO_BYTES = frozenset(
    "parameter constant tuple get-tuple-element bitcast after-all partition-id replica-id "
    "opt-barrier add-dependency domain".split()
)
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})


_HOST_MOVES = frozenset({"dynamic-update-slice", "dynamic-slice", "copy", "slice"})
_ARRAY_LAYOUT = re.compile(r"[a-z][a-z0-9]*\[[\d,]*\](\{[^}]*\})?")  # an array and its layout


def in_host_memory(shape: str) -> bool:
    """Whether the (first) array of an HLO shape lives in host memory (memory space 5: JAX's
    ``pinned_host``), as the TPU compiler lays out offloaded activations.

    >>> in_host_memory("f32[8,1024]{1,0:T(8,128)S(5)}"), in_host_memory("f32[8]{0}")
    (True, False)
    """
    first = _ARRAY_LAYOUT.search(shape)
    return bool(first and first.group(1) and "S(5)" in first.group(1))


def _result(inst: object) -> str:
    """The shape of what an instruction makes: an asynchronous ``-start``'s shape is a tuple,
    ``(result, operand, context)`` for a copy, ``((operands...), result, context)`` else."""
    if not inst.op.endswith("-start"):
        return inst.shape
    arrays = [m.group(0) for m in _ARRAY_LAYOUT.finditer(inst.shape)]
    k = 0 if inst.op == "copy-start" else len(inst.operands)
    return arrays[k] if len(arrays) > k else ""


class KernelBytes:
    """The byte counting of `hlo._Walker`: ``self.comps`` (computations' instructions) and
    ``self.shapes`` (each instruction's shape)."""

    comps: dict
    shapes: dict

    def leaf_bytes(self, inst: object) -> int:
        """Bytes an unfused instruction reads and writes (none for bookkeeping ones)."""
        if inst.op in _NO_BYTES:
            return 0
        op = inst.op.removesuffix("-start")  # an asynchronous one counts as its synchronous one
        if op == "dynamic-update-slice":  # in place: the update read and written
            return 2 * shape_bytes(self.shapes.get(inst.operands[1], ""))
        if op in ("dynamic-slice", "slice") or inst.op == "copy-start":
            return 2 * shape_bytes(_result(inst))
        operands = sum(shape_bytes(self.shapes.get(o, "")) for o in inst.operands)
        return shape_bytes(inst.shape) + operands

    def host_bytes(self, inst: object) -> int:
        """Bytes an instruction moves between host and device memory: an update written into a
        buffer in host memory, a slice or copy read out of one, a copy into one (and their
        asynchronous ``-start`` forms)."""
        op = inst.op.removesuffix("-start")
        if op not in _HOST_MOVES or not inst.operands:
            return 0
        source = in_host_memory(self.shapes.get(inst.operands[0], ""))
        if op == "dynamic-update-slice":
            update = self.shapes.get(inst.operands[1], "") if len(inst.operands) > 1 else ""
            return shape_bytes(update) if source and not in_host_memory(update) else 0
        result = _result(inst)
        return shape_bytes(result) if source != in_host_memory(result) else 0

    def fusion_bytes(self, inst: object, comp: str) -> int:
        """Bytes a fusion reads and writes: its output and operands, where an operand only
        sliced inside counts its slices, and an in-place update its update."""
        body = self.comps[comp]
        params = {i.operands[0]: i for i in body if i.op == "parameter" and i.operands}
        users: dict[str, list[object]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        root = next((i for i in body if i.root), body[-1] if body else None)
        written, in_place = self.written(comp, root, inst.shape)
        total = written
        for k, operand in enumerate(inst.operands):
            param = params.get(str(k))
            if param is not None and param.name in in_place:
                continue
            sliced = None if param is None else self.sliced_bytes(comp, param.name, users)
            total += shape_bytes(self.shapes.get(operand, "")) if sliced is None else sliced
        return total

    def written(self, comp: str, root: object, shape: str) -> tuple[int, set[str]]:
        """``(bytes written, buffers updated in place)`` by a fusion's ``root`` (of ``shape``):
        each output (a multi-output fusion's tuple has several) that is a
        ``dynamic-update-slice``, through bitcasts, writes its update into its buffer, in place,
        and the others their shapes. (The TPU compiler fuses a scanned layer's matmul with the
        update that stores its output in the residuals' stack, ``[layers, ...]``.)"""
        if root is None:
            return shape_bytes(shape), set()
        insts = {i.name: i for i in self.comps[comp]}
        outputs = [insts.get(o) for o in root.operands] if root.op == "tuple" else [root]
        written, in_place = 0, set()
        for out in outputs:
            inst = out
            while inst is not None and inst.op == "bitcast":
                inst = insts.get(inst.operands[0])
            if inst is not None and inst.op == "dynamic-update-slice" and len(inst.operands) > 1:
                in_place.add(self.passed_through(comp, inst.operands[0]))
                written += shape_bytes(self.shapes.get(inst.operands[1], ""))
            elif out is not None:
                written += shape_bytes(out.shape)
        return (written, in_place) if None not in outputs else (shape_bytes(shape), set())

    def is_copy(self, inst: object) -> bool:
        """A nested fusion that only copies (relayouts) its one operand: the TPU compiler's
        ``copy_fusion``, computed element by element where its result is read."""
        called = dict(_CALLS.findall(inst.attrs))
        nested = self.comps.get(called.get("calls", ""), []) if inst.op == "fusion" else []
        return (
            bool(nested)
            and len(inst.operands) == 1
            and all(i.op in ("parameter", "copy", "bitcast") for i in nested)
        )

    def passed_through(self, comp: str, name: str) -> str:
        """``name``, or the parameter it copies or bitcasts (an in-place update's buffer)."""
        insts = {i.name: i for i in self.comps[comp]}
        inst = insts.get(name)
        while inst is not None and (inst.op in ("bitcast", "copy") or self.is_copy(inst)):
            inst = insts.get(inst.operands[0])
        return inst.name if inst is not None else name

    def sliced_bytes(self, comp: str, name: str, users: dict | None = None) -> int | None:
        """The bytes of the slices read of ``name`` inside the fusion ``comp``, when slicing is
        all that reads it: directly, through bitcasts, or through a nested fusion's parameter
        (the TPU compiler nests the slice of a loop's operand); else None."""
        if users is None:
            users = {}
            for i in self.comps[comp]:
                for o in i.operands:
                    users.setdefault(o, []).append(i)
        total = 0
        for u in users.get(name, []):
            if u.op in _SLICES and u.operands[0] == name:
                total += shape_bytes(u.shape)
                continue
            called = dict(_CALLS.findall(u.attrs))
            if u.op in ("bitcast", "copy") or self.is_copy(u):
                inner = self.sliced_bytes(comp, u.name, users)
            elif u.op == "fusion" and "calls" in called and u.operands.count(name) == 1:
                number = str(u.operands.index(name))
                nested = self.comps.get(called["calls"], [])
                param = next((i for i in nested if i.op == "parameter" and i.operands == [number]),
                             None)  # fmt: skip
                inner = None if param is None else self.sliced_bytes(called["calls"], param.name)
            else:
                return None
            if inner is None:
                return None
            total += inner
        return total if users.get(name) else None
