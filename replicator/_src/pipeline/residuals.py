"""A layer's backward pass from saved residuals: the pipelines' remat policies.

`Remat` (`replicator._src.pipeline.remat`) says what a pipeline keeps of each layer's forward
pass for its backward pass: ``"none"``, ``"full"``, ``"dots"``, a policy by activation name, or
any ``jax.checkpoint`` policy.

`SavedLayer` splits a layer into a forward pass that returns its residuals as arrays, which a
schedule keeps in its scan carry for the micro-batches in flight, and backward passes that read
them: `SavedLayer.backward` (1F1B's fused backward), and `SavedLayer.input_grad` and
`SavedLayer.weight_grad`, ZeroBubble's B and W. B runs exactly the operations that the input's
cotangent needs, and returns, besides it, the intermediate values that W needs (the cotangents
of the products with parameters, and with ``full`` the recomputed activations); W runs only the
rest. So B and W together do the work of one fused backward pass, and nothing is recomputed
twice. The split is made on the backward pass's jaxpr, traced once per layer shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from replicator._src.core.typing import PyTree
from replicator._src.pipeline.layer_stack import _inexact
from replicator._src.pipeline.remat import NAMES as NAMES
from replicator._src.pipeline.remat import Remat as Remat
from replicator._src.pipeline.remat import as_remat as as_remat
from replicator._src.pipeline.remat import never_gathered


class _Meta(NamedTuple):
    """What one trace of `SavedLayer.forward` found, for the backward passes."""

    vjp_tree: Any  # the treedef of jax.vjp's function, whose leaves are the residuals
    kinds: tuple  # per leaf: ("own", k), the k-th differentiated own parameter, or ("res", k)
    tree: Any  # the treedef of (p, shared, x)
    diff: tuple  # per leaf of (p, shared, x): whether it is differentiated (floating)
    n_own: int  # the leaves of (p, shared)
    like: list  # the shapes and dtypes of the leaves of (p, shared, x)


class SavedLayer:
    """``layer_fn(p, shared, x, j, li)`` as a forward pass with residuals and backward passes.

    Only the floating leaves of ``p``, ``shared``, ``x`` and the output are differentiated
    (integer leaves get zero gradients, as with `layers.vjp_inexact`). Residuals that are the
    layer's own parameters are not kept: the backward passes receive the parameters again.

    Args:
      layer_fn: the layer.
      remat: what to keep (`Remat`).
      p, shared, x, j, li: example arguments (shapes and dtypes are what count): one layer's
        parameters, the stage's shared parameters, one micro-batch's activation, and the
        logical stage and layer indices.

    Attributes:
      residuals: the shapes of what `forward` returns besides the output.
    """

    def __init__(self, layer_fn: Callable, remat: Remat, p, shared, x, j, li) -> None:
        self.layer_fn, self.remat = layer_fn, remat
        self._meta: _Meta | None = None
        self._split: tuple | None = None
        self.residuals: list[jax.ShapeDtypeStruct] = jax.eval_shape(
            lambda *a: self.forward(*a)[1], p, shared, x, j, li
        )

    def forward(self, p, shared, x, j, li) -> tuple[PyTree, list[jax.Array]]:
        """The layer's output and its residuals (a list of arrays, the same shapes every call)."""
        flat, tree = jax.tree.flatten((p, shared, x))
        diff = tuple(_inexact(a) for a in flat)
        n_own = len(jax.tree.leaves((p, shared)))

        def float_out(*dl):
            it = iter(dl)
            full = [next(it) if d else a for a, d in zip(flat, diff, strict=True)]
            out = self.layer_fn(*jax.tree.unflatten(tree, full)[:3], j, li)
            return [a for a in jax.tree.leaves(out) if _inexact(a)], out

        dl = [a for a, d in zip(flat, diff, strict=True) if d]
        fn = jax.checkpoint(float_out, prevent_cse=False, policy=never_gathered(self.remat))
        _, vjp, out = jax.vjp(fn, *dl, has_aux=True)
        leaves, vjp_tree = jax.tree.flatten(vjp)
        own = dl[: sum(diff[:n_own])]
        kinds, res = [], []
        for leaf in leaves:
            hit = next((k for k, a in enumerate(own) if leaf is a), None)
            kinds.append(("res", len(res)) if hit is None else ("own", hit))
            if hit is None:
                res.append(leaf)
        like = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in flat]
        meta = _Meta(vjp_tree, tuple(kinds), tree, diff, n_own, like)
        if self._meta is None:
            self._meta = meta
        elif (self._meta.kinds, self._meta.tree, self._meta.diff) != (
            meta.kinds,
            meta.tree,
            meta.diff,
        ):
            raise AssertionError("SavedLayer: the layer's residuals changed between traces")
        return out, res

    def backward(self, p, shared, res: Sequence[jax.Array], cot: PyTree) -> tuple:
        """The gradients ``(g_p, g_shared, g_x)`` from the residuals and the output's cotangent."""
        grads = self._vjp(self._own(p, shared), res)(self._cot(cot))
        return self._fill(grads, 0, None)

    def input_grad(self, p, shared, res, cot) -> tuple[PyTree, list[jax.Array]]:
        """ZeroBubble's B: the cotangent of the layer's input, and what W needs from B."""
        b = self._splits(p, shared, res, cot)[0]
        outs = b(*self._own(p, shared), *res, *self._cot(cot))
        n_own = self._meta.n_own
        n_x = sum(self._meta.diff[n_own:])
        return self._fill(outs[:n_x], n_own, None)[0], list(outs[n_x:])

    def weight_grad(self, p, shared, res, cot, inter) -> tuple[PyTree, PyTree]:
        """ZeroBubble's W: the gradients ``(g_p, g_shared)`` from the residuals, the output's
        cotangent and what B returned."""
        w = self._splits(p, shared, res, cot)[1]
        g_own = w(*self._own(p, shared), *res, *self._cot(cot), *inter)
        return self._fill(g_own, 0, self._meta.n_own)

    def inter_shapes(self, p, shared, res, cot) -> list[jax.ShapeDtypeStruct]:
        """The shapes of what B hands to W."""
        return self._splits(p, shared, res, cot)[2]

    def _own(self, p, shared) -> list[jax.Array]:
        diff, n_own = self._meta.diff, self._meta.n_own
        return [a for a, d in zip(jax.tree.leaves((p, shared)), diff[:n_own], strict=True) if d]

    @staticmethod
    def _cot(cot) -> list[jax.Array]:
        return [a for a in jax.tree.leaves(cot) if _inexact(a)]

    def _vjp(self, own, res) -> Callable:
        vjp_tree, kinds = self._meta.vjp_tree, self._meta.kinds
        leaves = [own[k] if kind == "own" else res[k] for kind, k in kinds]
        vjp = jax.tree.unflatten(vjp_tree, leaves)
        return lambda cots: list(vjp(list(cots)))

    def _fill(self, grads: Sequence[jax.Array], lo: int, hi: int | None) -> tuple:
        """Gradients of the differentiated leaves ``lo:hi`` of ``(p, shared, x)`` as trees, with
        zeros for the integer leaves: ``(g_p, g_shared, g_x)`` for all, ``(g_p, g_shared)`` for
        the own leaves, ``(g_x,)`` for the input's."""
        tree, diff, n_own, like = (
            self._meta.tree, self._meta.diff, self._meta.n_own, self._meta.like
        )  # fmt: skip
        hi = len(like) if hi is None else hi
        it = iter(grads)
        full = [next(it) if d and lo <= k < hi else jnp.zeros(a.shape, a.dtype)
                for k, (a, d) in enumerate(zip(like, diff, strict=True))]  # fmt: skip
        p, shared, x = jax.tree.unflatten(tree, full)
        if (lo, hi) == (0, n_own):
            return p, shared
        if lo == n_own:
            return (x,)
        return p, shared, x

    def _splits(self, p, shared, res, cot):
        """B's and W's functions, cut from the backward pass's jaxpr (traced once)."""
        if self._split is None:
            own, cots = self._own(p, shared), self._cot(cot)
            n_own, n_res = len(own), len(res)
            shapes = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
                      for a in (*own, *res, *cots)]  # fmt: skip

            def flat_backward(*args):
                o, r = args[:n_own], args[n_own : n_own + n_res]
                return self._vjp(o, r)(args[n_own + n_res :])

            self._split = split_backward(jax.make_jaxpr(flat_backward)(*shapes), n_own)
        return self._split


def split_backward(closed: jcore.ClosedJaxpr, n_own: int) -> tuple:
    """B and W cut from a backward jaxpr whose outputs are ``(own grads..., input grads...)``.

    B's equations are those the input gradients need; W's are those the own gradients need that
    B does not run. B returns the input gradients and then every value W reads from B's
    equations (`inter`); W takes the backward's arguments followed by those values.

    Returns:
      ``(b, w, inter_shapes, num_w_equations)``: ``b(*args) -> [*g_x, *inter]`` and
      ``w(*args, *inter) -> [*g_own]``.
    """
    jaxpr = _inline(closed.jaxpr)
    outs_own, outs_x = jaxpr.outvars[:n_own], jaxpr.outvars[n_own:]
    in_b = _needed(jaxpr.eqns, outs_x)
    in_w = _needed(jaxpr.eqns, outs_own)
    b_eqns = [e for e, k in zip(jaxpr.eqns, in_b, strict=True) if k]
    w_eqns = [e for e, kb, kw in zip(jaxpr.eqns, in_b, in_w, strict=True) if kw and not kb]
    made_by_b = {o for e in b_eqns for o in e.outvars}
    inter: list = []
    for v in [a for e in w_eqns for a in e.invars] + list(outs_own):
        if isinstance(v, jcore.Var) and v in made_by_b and v not in inter:
            inter.append(v)
    b_out = [*outs_x, *inter]
    b_jaxpr = jaxpr.replace(eqns=b_eqns, outvars=b_out, debug_info=_info("B", jaxpr.invars, b_out))
    w_in = [*jaxpr.invars, *inter]
    w_jaxpr = jaxpr.replace(
        invars=w_in, eqns=w_eqns, outvars=list(outs_own), debug_info=_info("W", w_in, outs_own)
    )
    b = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(b_jaxpr, closed.consts))
    w = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(w_jaxpr, closed.consts))
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inter]
    return b, w, shapes, len(w_eqns)


def _info(name: str, invars: Sequence, outvars: Sequence) -> jcore.DebugInfo:
    return jcore.DebugInfo(
        f"ZeroBubble {name}", None, tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )  # fmt: skip


_CALLS = ("checkpoint", "remat2", "remat", "pjit", "jit", "closed_call", "core_call")


def _inline(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """The jaxpr with call-like equations (checkpoints, nested jits) replaced by their bodies,
    so that B and W can be cut through them; an inner jaxpr with constants stays a call."""
    eqns: list = []
    sub: dict = {}

    def read(a):
        return sub.get(a, a) if isinstance(a, jcore.Var) else a

    for e in jaxpr.eqns:
        inner = e.params.get("jaxpr") if e.primitive.name in _CALLS else None
        if isinstance(inner, jcore.ClosedJaxpr):
            inner = inner.jaxpr if not inner.consts else None
        if inner is None or inner.constvars:
            eqns.append(e.replace(invars=[read(a) for a in e.invars]))
            continue
        inner = _inline(inner)
        env = {v: read(a) for v, a in zip(inner.invars, e.invars, strict=True)}

        def rd(a, env=env):
            return env.get(a, a) if isinstance(a, jcore.Var) else a

        for ie in inner.eqns:
            outs = [o if isinstance(o, jcore.DropVar) else jcore.Var(o.aval) for o in ie.outvars]
            env.update(zip(ie.outvars, outs, strict=True))
            eqns.append(ie.replace(invars=[rd(a) for a in ie.invars], outvars=outs))
        for o, io in zip(e.outvars, inner.outvars, strict=True):
            sub[o] = rd(io)
    return jaxpr.replace(eqns=eqns, outvars=[read(a) for a in jaxpr.outvars])


def _needed(eqns: Sequence, outs: Sequence) -> list[bool]:
    """Which equations the values ``outs`` depend on (and every equation with an effect)."""
    live = {v for v in outs if isinstance(v, jcore.Var)}
    keep = [False] * len(eqns)
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        if e.effects or any(o in live for o in e.outvars if not isinstance(o, jcore.DropVar)):
            keep[i] = True
            live.update(a for a in e.invars if isinstance(a, jcore.Var))
    return keep
