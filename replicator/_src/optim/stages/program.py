"""A one-device optimizer program, with each value placed on the pipeline stage that owns it.

A pipeline of stages that differ keeps stage ``j``'s parameters, gradients and optimizer state
on the devices of stage ``j`` only. The optimizer is written for one device, where every stage's
tree is a subtree of one parameter tree. `StageProgram` takes the program of ``tx.update`` traced
on that one-device tree and says where each of its values can be computed:

* on stage ``j``: a value computed from stage ``j``'s inputs (and from values known everywhere):
  a moment, a leaf's norm, LAMB's trust ratio, a mask's choice, an update;
* everywhere: a value computed from no stage's inputs (a step count, a learning-rate schedule),
  or from the values of several stages (a global norm): the *glue*. Each stage's values that
  glue reads are *exported*: computed on their stage, gathered over ``stage``, then the glue runs
  on every device.

Values are computed in *rounds*: round 0 runs what needs no exported value; round ``p`` the glue
whose exports round ``p - 1`` computed, then what depends on it. `phases` and `exports` say
which. ``optax.clip_by_global_norm`` in a chain takes two rounds: the squares of each stage's
gradients, then the clipped update; an element-wise or per-leaf transformation one.

Calls (``jit``, ``custom_jvp``, ``custom_vjp``, ``checkpoint``) are inlined, so that only their
equations that mix stages are glue.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jex

_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "closed_call": "call_jaxpr"}  # fmt: skip

EVERYWHERE = -1  # the location of a value known on every device
SMALL = 1  # elements: a stage's scalar that meets glue joins it (a running sum)


@dataclasses.dataclass(frozen=True, eq=False)
class Const:
    """A constant of the program (a literal or a closed-over array)."""

    value: Any


@dataclasses.dataclass
class Node:
    """One primitive equation of the inlined program: reads ``ins`` (refs or `Const`), writes
    ``outs`` (refs)."""

    eqn: Any  # the jax equation: its primitive and params
    ins: list
    outs: list
    where: int = EVERYWHERE  # a stage, or EVERYWHERE
    glue: bool = False  # reads values of several stages
    phase: int = 0


def inline(jaxpr: jex.Jaxpr, consts: Sequence, ins: list, nodes: list[Node]) -> list:
    """Appends ``jaxpr``'s equations to ``nodes`` with calls inlined; its outputs' refs."""
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = Const(c)
    for v, x in zip(jaxpr.invars, ins, strict=True):
        env[v] = x

    def read(v):
        return Const(v.val) if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS:
            inner = eqn.params[_CALLS[name]]
            outs = inline(inner.jaxpr, inner.consts, args, nodes)
        elif name in ("remat2", "checkpoint"):
            outs = inline(eqn.params["jaxpr"], [], args, nodes)
        else:
            outs = [object() for _ in eqn.outvars]
            nodes.append(Node(eqn, args, outs))
        for v, ref in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex.DropVar):
                env[v] = ref
    return [read(v) for v in jaxpr.outvars]


class StageProgram:
    """The inlined program of ``closed`` with a location and a round for every value.

    Args:
      closed: the one-device program, inputs flat.
      where_in: each input's stage, or `EVERYWHERE`.
    """

    def __init__(self, closed: jex.ClosedJaxpr, where_in: Sequence[int]) -> None:
        self.ins = [object() for _ in closed.jaxpr.invars]
        self.in_avals = [v.aval for v in closed.jaxpr.invars]
        self.nodes: list[Node] = []
        self.outs = inline(closed.jaxpr, closed.consts, list(self.ins), self.nodes)
        self.where: dict = {}  # ref -> location
        self.phase: dict = {}  # ref -> the round from which it can be computed
        self.producer: dict = {}  # ref -> its node
        self.locate(where_in)

    def locate(self, where_in: Sequence[int]) -> None:
        """Places every value, given the inputs' locations."""
        self.where = {r: w for r, w in zip(self.ins, where_in, strict=True)}
        self.phase = {r: 0 for r in self.ins}
        for node in self.nodes:
            refs = [x for x in node.ins if not isinstance(x, Const)]
            stages = {self.where[r] for r in refs} - {EVERYWHERE}
            # Small values of one stage meeting glue's output (a running sum of the stages'
            # squares) join the glue, so that the stages export in one round, not one each.
            joins = (
                len(stages) == 1
                and all(self._small(r) for r in refs if self.where[r] != EVERYWHERE)
                and any(self.phase[r] > 0 for r in refs if self.where[r] == EVERYWHERE)
            )
            node.glue = len(stages) > 1 or joins
            node.where = next(iter(stages)) if len(stages) == 1 and not joins else EVERYWHERE
            if node.glue:  # its staged inputs arrive in the round after they are computed
                node.phase = max(
                    [self.phase[r] + (self.where[r] != EVERYWHERE) for r in refs], default=0
                )
            else:
                node.phase = max([self.phase[r] for r in refs], default=0)
            for r in node.outs:
                self.where[r], self.phase[r], self.producer[r] = node.where, node.phase, node

    def _small(self, ref) -> bool:
        """A value of at most `SMALL` elements (a norm, a count), cheap to export."""
        return math.prod(self.aval(ref).shape) <= SMALL

    def aval(self, ref):
        """A value's shape and dtype."""
        node = self.producer.get(ref)
        if node is not None:
            return node.eqn.outvars[node.outs.index(ref)].aval
        return self.in_avals[self.ins.index(ref)]

    def where_out(self, i: int) -> int:
        """Output ``i``'s location."""
        x = self.outs[i]
        return EVERYWHERE if isinstance(x, Const) else self.where[x]

    @property
    def rounds(self) -> int:
        """The rounds of exports the program needs (0: each stage alone)."""
        return max([n.phase for n in self.nodes if n.glue], default=0)

    def exports(self, p: int) -> list:
        """The staged values the glue of round ``p`` reads (computed in round ``p - 1``)."""
        out: dict = {}
        for node in self.nodes:
            if node.glue and node.phase == p:
                for r in node.ins:
                    if not isinstance(r, Const) and self.where[r] != EVERYWHERE:
                        out[r] = None
        return list(out)

    def everywhere(self, p: int) -> list[Node]:
        """The nodes every device runs in round ``p`` (glue, and what only depends on glue and
        on values known everywhere), in program order."""
        return [n for n in self.nodes if n.where == EVERYWHERE and n.phase == p]

    def staged(self, targets: Sequence) -> list[Node]:
        """The staged nodes that compute ``targets`` (staged refs, on one stage), in order."""
        need: set = set()
        stack = [t for t in targets if not isinstance(t, Const)]
        while stack:
            r = stack.pop()
            node = self.producer.get(r)
            if node is None or node.where == EVERYWHERE or id(node) in need:
                continue
            need.add(id(node))
            stack.extend(x for x in node.ins if not isinstance(x, Const))
        return [n for n in self.nodes if id(n) in need]


def bind(node: Node, args: list) -> list:
    """Runs one node on its arguments."""
    out = node.eqn.primitive.bind(*args, **node.eqn.params)
    return list(out) if node.eqn.primitive.multiple_results else [out]


def run_nodes(nodes: Sequence[Node], env: dict, fallback: dict | None = None) -> None:
    """Runs ``nodes`` in order, reading and writing ``env`` (and reading ``fallback``)."""

    def read(x):
        if isinstance(x, Const):
            return x.value
        if x in env:
            return env[x]
        return fallback[x]

    for node in nodes:
        for r, v in zip(node.outs, bind(node, [read(x) for x in node.ins]), strict=True):
            env[r] = v


def trace(fn, *avals) -> jex.ClosedJaxpr:
    """``jax.make_jaxpr(fn)(*avals)``."""
    return jax.make_jaxpr(fn)(*avals)
