"""How many times a compiled while loop runs, from its HLO.

XLA:CPU writes a loop's trip count into its ``backend_config`` (``"known_trip_count"``). The TPU
compiler does not: its loops (a ``lax.scan`` over layers, a pipeline's ticks) carry the count
in their code only, as XLA's own ``ComputeWhileLoopTripCount`` reads it. This module reads the
same pattern, and nothing looser:

* the condition's root is ``compare(get-tuple-element(param, i), constant(N)), direction=LT``
  (or the operands swapped with ``direction=GT``);
* element ``i`` of the loop's initial tuple is a constant ``c`` (or a copy of one);
* the body's root tuple gives element ``i`` as ``add(get-tuple-element(param, i), constant(k))``
  with ``k > 0``.

The loop then runs ``ceil((N - c) / k)`` times (0 if ``c >= N``). A loop of any other shape is
unknown (None), and the report says it was counted once.
"""

from __future__ import annotations

import re

_CONSTANT = re.compile(r"^\s*(-?\d+)\s*$")


def _by_name(insts: list) -> dict:
    return {i.name: i for i in insts}


def _constant(inst, names: dict | None = None) -> int | None:
    """The integer value of a ``constant``, or of a ``copy`` of one (the TPU's loop inits)."""
    while inst is not None and inst.op == "copy" and names is not None and inst.operands:
        inst = names.get(inst.operands[0])
    if inst is None or inst.op != "constant" or not inst.operands:
        return None
    found = _CONSTANT.match(inst.operands[0])
    return int(found.group(1)) if found else None


def _tuple_index(inst) -> int | None:
    found = re.search(r"\bindex=(\d+)", inst.attrs) if inst is not None else None
    return int(found.group(1)) if found else None


def _element(inst, names: dict, param: str):
    """The tuple index ``i`` when ``inst`` is ``get-tuple-element(param), index=i`` (or a
    copy of it)."""
    while inst is not None and inst.op == "copy" and inst.operands:
        inst = names.get(inst.operands[0])
    if inst is None or inst.op != "get-tuple-element" or inst.operands != [param]:
        return None
    return _tuple_index(inst)


def _param(insts: list) -> str | None:
    params = [i.name for i in insts if i.op == "parameter"]
    return params[0] if len(params) == 1 else None


def _bound(cond: list) -> tuple[int, int] | None:
    """``(i, N)`` of a condition ``element i < N``."""
    names, param = _by_name(cond), _param(cond)
    root = next((i for i in cond if i.root), None)
    if param is None or root is None or root.op != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.attrs)
    a, b = (names.get(o) for o in root.operands)
    if direction and direction.group(1) == "GT":
        a, b = b, a
    elif not direction or direction.group(1) != "LT":
        return None
    index, limit = _element(a, names, param), _constant(b)
    return None if index is None or limit is None else (index, limit)


def _step(body: list, index: int) -> int | None:
    """``k`` of a body that returns element ``index`` plus the constant ``k``."""
    names, param = _by_name(body), _param(body)
    root = next((i for i in body if i.root), None)
    if param is None or root is None or root.op != "tuple" or index >= len(root.operands):
        return None
    add = names.get(root.operands[index])
    if add is None or add.op != "add" or len(add.operands) != 2:
        return None
    x, y = (names.get(o) for o in add.operands)
    for var, step in ((x, y), (y, x)):
        k = _constant(step)
        if _element(var, names, param) == index and k is not None and k > 0:
            return k
    return None


def trip_count(loop, caller: list, comps: dict) -> int | None:
    """The trips of the while instruction ``loop`` (in the computation ``caller``), or None.

    >>> from replicator._src.report import hlo
    >>> _, comps = hlo.parse_module('''
    ... %cond (p: (s32[], f32[4])) -> pred[] {
    ...   %p = (s32[], f32[4]) parameter(0)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   %n = s32[] constant(7)
    ...   ROOT %lt = pred[] compare(%i, %n), direction=LT
    ... }
    ... %body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
    ...   %p = (s32[], f32[4]) parameter(0)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   %x = f32[4] get-tuple-element(%p), index=1
    ...   %one = s32[] constant(1)
    ...   %next = s32[] add(%i, %one)
    ...   ROOT %t = (s32[], f32[4]) tuple(%next, %x)
    ... }
    ... ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
    ...   %x = f32[4] parameter(0)
    ...   %zero = s32[] constant(2)
    ...   %init = (s32[], f32[4]) tuple(%zero, %x)
    ...   ROOT %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
    ... }
    ... ''')
    >>> main = comps["main"]
    >>> trip_count(main[-1], main, comps)  # 2, 3, ..., 6
    5
    """
    called = dict(re.findall(r"\b(condition|body)=%?([\w.\-]+)", loop.attrs))
    if set(called) != {"condition", "body"} or len(loop.operands) != 1:
        return None
    bound = _bound(comps.get(called["condition"], []))
    if bound is None:
        return None
    index, limit = bound
    init = _by_name(caller).get(loop.operands[0])
    if init is None or init.op != "tuple" or index >= len(init.operands):
        return None
    names = _by_name(caller)
    start = _constant(names.get(init.operands[index]), names)
    step = _step(comps.get(called["body"], []), index)
    if start is None or step is None:
        return None
    return max(0, -(-(limit - start) // step))
