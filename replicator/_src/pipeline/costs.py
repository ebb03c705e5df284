"""Measured costs of pipeline stages and layers: FLOPs of the compiled program, or wall time.

`stage_costs` measures, for each logical stage, the passes a schedule runs on one micro-batch:
F (the forward), B and W (ZeroBubble's input-gradient and weight-gradient passes) and the fused
backward of GPipe, Circular and 1F1B, each backward with its recompute: the `StageCosts` of the
modelled step time. `layer_costs` measures layers' forward passes, for `balance`.

FLOPs are XLA's count for the compiled program (``cost_analysis``'s ``"flops"``, which leaves
out transcendentals such as ``exp`` and ``tanh``); nothing runs. What XLA removes as dead code
is not counted: the recompute of a stage whose gradients do not need its activations (a linear
stage) costs nothing. XLA counts a loop's body once, whatever its trip count, so a program with
a loop is refused rather than undercounted; a `scan_layers` stage is measured one layer at a
time, as the engine runs it, times its number of layers, and a stage of several runs of layers
(`stages_from_layers`) as the sum of its runs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.core.errors import positive_int
from replicator._src.core.typing import PyTree
from replicator._src.pipeline.layer_stack import _ScanLayers, describe, same_shapes
from replicator._src.pipeline.residuals import Remat, SavedLayer, as_remat
from replicator._src.pipeline.steps import Chain
from replicator._src.pipeline.timing import StageCosts

_UNITS = {"flops": "flops", "time": "seconds"}

_LOOP = (
    "{api}: {what} compiles to a loop (a lax.scan, fori_loop or while_loop that XLA keeps as a "
    "while loop). XLA's cost_analysis counts a loop's body once, whatever its trip count, so "
    "its FLOPs would be undercounted. Build the stage with rp.pipeline.scan_layers (its layers "
    "are then measured one at a time, times their number), unroll the loop "
    "(lax.scan(..., unroll=True)), or use method='time'."
)


def _abstract(tree: PyTree) -> PyTree:
    """Shapes and dtypes only (no sharding, no data) of a tree of arrays or ShapeDtypeStructs."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def _check_method(method: object, repeats: object, api: str) -> None:
    if method not in _UNITS:
        raise ValueError(f"{api}: method must be 'flops' or 'time'; got {method!r}.")
    positive_int(repeats, api=api, name="repeats")


def measure(
    fn: Callable, args: Sequence[PyTree], *, method: str, repeats: int, api: str, what: str
) -> float:
    """``fn(*args)`` compiled: its FLOPs, or the median seconds of ``repeats`` runs.

    Args:
      fn: the function to compile with ``jax.jit``.
      args: its arguments, abstract (``ShapeDtypeStruct`` trees).
      method: ``"flops"``: XLA's ``cost_analysis`` of the compiled program, nothing runs;
        ``"time"``: the median wall time of ``repeats`` runs on ones-filled arrays, after a
        warm-up run.
      repeats: runs to time.
      api, what: name the caller and the measured program in errors.

    Raises:
      ValueError: for ``"flops"``, if the compiled program has a loop (see ``_LOOP``).
    """
    jitted = jax.jit(fn)
    if method == "flops":
        compiled = jitted.lower(*args).compile()
        if re.search(r"\bwhile\(", compiled.as_text() or ""):
            raise ValueError(_LOOP.format(api=api, what=what))
        analysis = compiled.cost_analysis()
        if isinstance(analysis, list | tuple):
            analysis = analysis[0] if analysis else {}
        return float((analysis or {}).get("flops", 0.0))
    concrete = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), tuple(args))
    jax.block_until_ready(jitted(*concrete))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*concrete))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _one_layer(fn: Callable, params: PyTree) -> tuple[Callable, PyTree, int]:
    """A `scan_layers` stage as its layer function, one layer's (abstract) parameters and its
    number of layers; any other function as itself, its parameters and 1."""
    leaves = jax.tree.leaves(params)
    if isinstance(fn, _ScanLayers) and leaves and all(np.ndim(a) for a in leaves):
        rows = {np.shape(a)[0] for a in leaves}
        if len(rows) == 1:
            row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
            return fn.layer_fn, row, rows.pop()
    return fn, params, 1


def layer_costs(
    fns: Sequence[Callable],
    example_input: Any,
    *,
    params: Sequence[PyTree] | None = None,
    method: str = "flops",
    repeats: int = 5,
) -> list[float]:
    """Per-layer costs of layers run one after another, for `balance`.

    Args:
      fns: one callable per layer: ``f(x) -> y``, or ``f(p, x) -> y`` with ``params``.
      example_input: the first layer's input (an array or pytree; only its shapes matter for
        ``"flops"``).
      params: per-layer parameters, ``params[i]`` for ``fns[i]``.
      method: ``"flops"``: the compiled program's FLOPs (``cost_analysis``), nothing runs;
        ``"time"``: the median wall time of ``repeats`` runs after a warm-up.

    Raises:
      ValueError: for a bad ``method`` or ``repeats``, one ``params`` entry per layer missing,
        or (``"flops"``) a layer that compiles to a loop, whose FLOPs XLA undercounts.

    >>> import jax.numpy as jnp, replicator as rp
    >>> fns = [lambda x: x @ jnp.ones((8, 8)), lambda x: x @ jnp.ones((8, 8)) @ jnp.ones((8, 8))]
    >>> rp.pipeline.layer_costs(fns, jnp.ones((4, 8)))
    [512.0, 1024.0]
    """
    api = "rp.pipeline.layer_costs"
    _check_method(method, repeats, api)
    if params is not None and len(params) != len(fns):
        raise ValueError(f"{api}: {len(fns)} fns but {len(params)} params; give one per layer.")
    x = _abstract(example_input)
    out = []
    for i, fn in enumerate(fns):
        if params is None:
            args, f, f_args, n = (x,), fn, (x,), 1
        else:
            args = (_abstract(params[i]), x)
            f, layer, n = _one_layer(fn, args[0])
            f_args = (layer, x)
        what = f"layer {i}"
        out.append(n * measure(f, f_args, method=method, repeats=repeats, api=api, what=what))
        x = jax.eval_shape(fn, *args)
    return out


# -- the passes of one stage ---------------------------------------------------------------------


def _inexact(a: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(a), jnp.inexact))


def _backwards(fn: Callable, p: PyTree, x: PyTree, g: list, remat: Remat) -> dict:
    """The backward passes of ``fn(p, x)`` as the engine runs them under ``remat``
    (`residuals.SavedLayer`), each a function and its abstract arguments: from the forward's
    residuals and the output's cotangents ``g``, ``"both"`` (the fused backward), ``"input"``
    (ZeroBubble's B) and ``"weight"`` (W, from the residuals and what B kept)."""
    saved = SavedLayer(lambda p, _sh, x, _j, _li: fn(p, x), remat, p, {}, x, 0, 0)
    res = saved.residuals
    inter = saved.inter_shapes(p, {}, res, g)
    return {
        "input": (lambda p, r, g: saved.input_grad(p, {}, r, g), (p, res, g)),
        "weight": (lambda p, r, g, i: saved.weight_grad(p, {}, r, g, i), (p, res, g, inter)),
        "both": (lambda p, r, g: saved.backward(p, {}, r, g), (p, res, g)),
    }


def _batch_axis(tree: PyTree) -> int | None:
    """The leading axis size shared by every leaf of ``tree``, or None if there is none."""
    sizes = {(np.shape(a) or (None,))[0] for a in jax.tree.leaves(tree)}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def _passes(
    fn: Callable, p: PyTree, x: PyTree, *, method: str, repeats: int, api: str, what: str,
    remat: Remat,
) -> dict[str, float]:  # fmt: skip
    """The forward, input-, weight- and fused-backward costs of ``fn(p, x)`` (abstract ``p``
    and ``x``) under ``remat``; a `scan_layers` stage one layer at a time, times its number of
    layers."""
    layer_fn, layer_p, n = _one_layer(fn, p)
    g = [a for a in jax.tree.leaves(jax.eval_shape(layer_fn, layer_p, x)) if _inexact(a)]
    passes = {"forward": (layer_fn, (layer_p, x)), **_backwards(layer_fn, layer_p, x, g, remat)}
    out = {}
    for name, (f, args) in passes.items():
        which = f"{what}'s {'forward' if name == 'forward' else 'backward'}"
        out[name] = n * measure(f, args, method=method, repeats=repeats, api=api, what=which)
    return out


def _stage_costs(
    fns: Sequence[Callable],
    params: Sequence[PyTree],
    example_input: Any,
    *,
    method: str,
    repeats: int,
    api: str,
    remat: Any = "full",
) -> StageCosts:
    _check_method(method, repeats, api)
    remat = as_remat(remat, api)
    if callable(fns) or not isinstance(fns, list | tuple):
        raise ValueError(
            f"{api}: fns must be a list with one callable per stage; got "
            f"{type(fns).__name__}. For one stage pass [fn] and [params]; for a stack of "
            f"identical stages see rp.pipeline.stage_costs_stacked."
        )
    if not fns:
        raise ValueError(f"{api}: fns is empty; pass one callable per stage.")
    for j, fn in enumerate(fns):
        if not callable(fn):
            raise ValueError(f"{api}: fns[{j}] is a {type(fn).__name__}, not a callable.")
    if not isinstance(params, list | tuple) or len(params) != len(fns):
        got = f"{len(params)} params" if isinstance(params, list | tuple) else type(params).__name__
        raise ValueError(
            f"{api}: params must be a list with one pytree per stage, params[j] for fns[j]; got "
            f"{len(fns)} fns and {got}. Pass {len(fns)} entries (None or {{}} for a stage "
            f"without parameters)."
        )
    x = _abstract(example_input)
    b = _batch_axis(x)
    if b is None:
        raise ValueError(
            f"{api}: example_input must be one micro-batch for stage 0, every leaf with the same "
            f"leading batch axis; got {describe(x)}. Pass stage 0's input for one micro-batch, "
            f"e.g. an array [micro_batch, ...]."
        )
    costs: dict[str, list[float]] = {k: [] for k in ("forward", "input", "weight", "both")}
    for j, (fn, p) in enumerate(zip(fns, params, strict=True)):
        p = _abstract(p)
        try:
            y = jax.eval_shape(fn, p, x)
        except Exception as e:
            e.add_note(f"{api}: raised by stage {j} (fns[{j}]) on the input {describe(x)}.")
            raise
        if _batch_axis(y) != b:
            raise ValueError(
                f"{api}: stage {j}'s output {describe(y)} has no leading batch axis of {b}, "
                f"the micro-batch size of its input {describe(x)}. A stage maps one micro-batch "
                f"to one micro-batch, batch axis first, in every leaf; keep the batch axis in "
                f"each stage's output and reduce over it in the loss instead."
            )
        if isinstance(fn, Chain):  # runs of layers: each measured as a stage, then summed
            total, h = dict.fromkeys(costs, 0.0), x
            for r, (run, q) in enumerate(zip(fn.fns, p, strict=True)):
                one = _passes(run, q, h, method=method, repeats=repeats, api=api,
                              what=f"stage {j} (run {r} of its layers)", remat=remat)  # fmt: skip
                total = {name: total[name] + one[name] for name in costs}
                h = jax.eval_shape(run, q, h)
        else:
            total = _passes(
                fn, p, x, method=method, repeats=repeats, api=api, what=f"stage {j}", remat=remat
            )
        for name in costs:
            costs[name].append(total[name])
        x = y
    return StageCosts(
        forward=tuple(costs["forward"]),
        backward_input=tuple(costs["input"]),
        backward_weight=tuple(costs["weight"]),
        backward=tuple(costs["both"]),
        unit=_UNITS[method],
    )


def stage_costs(
    fns: Sequence[Callable],
    params: Sequence[PyTree],
    example_input: Any,
    *,
    method: str = "flops",
    repeats: int = 5,
    remat: Any = "full",
) -> StageCosts:
    """The F, B, W and fused-backward costs of one micro-batch through each pipeline stage.

    Stage ``j`` runs ``y_j = fns[j](params[j], x_j)`` with ``x_0 = example_input`` and
    ``x_{j+1} = y_j`` (shapes found by ``jax.eval_shape``; they may change from stage to stage).
    With ``g`` a cotangent shaped like ``y_j``, it measures the compiled program of each pass as
    the engine runs it under the ``remat`` policy, from the residuals the forward kept:

    - ``forward`` (F): ``fns[j](p, x)``;
    - ``backward`` (GPipe, Circular, 1F1B): both gradients from the residuals and ``g``, with
      what the policy recomputes (``"none"``: nothing; ``"full"``: the whole stage);
    - ``backward_input`` (ZeroBubble's B): the operations the input's gradient needs, keeping
      what W needs besides;
    - ``backward_weight`` (ZeroBubble's W): the rest, from what B kept.

    Only the inexact leaves of ``x`` and ``p`` are differentiated (integer leaves such as token
    ids are held fixed), and only the inexact leaves of ``y_j`` get a cotangent. FLOPs are what
    XLA compiles, so ``backward_input + backward_weight == backward`` up to what XLA fuses, and
    a recompute no gradient needs is dropped (a linear stage recomputes nothing). A
    `scan_layers` stage is measured as the engine runs it, one layer at a time, times its
    number of layers. A stage that
    `stages_from_layers` made of runs of layers (some of them `scan_layers`) costs the sum of
    its runs, each measured as a stage of its own on the input the runs before it produce.

    Args:
      fns: one callable per logical stage, ``fn(p, x) -> y``, in pipeline order.
      params: one pytree per stage, ``params[j]`` for ``fns[j]`` (arrays or
        ``ShapeDtypeStruct`` values; only shapes and dtypes are read).
      example_input: one micro-batch's input to stage 0 (arrays or ``ShapeDtypeStruct`` values),
        every leaf with the same leading batch axis.
      method: ``"flops"``: XLA's ``cost_analysis`` of each compiled pass, nothing runs;
        ``"time"``: the median wall time of ``repeats`` runs on ones-filled arrays after a
        warm-up.
      repeats: runs to time with ``method="time"``.
      remat: the engine's remat policy (``"none"``, ``"full"``, ``"dots"``; see
        `value_and_grad`), whose backward passes are measured.

    Returns:
      `StageCosts` with one entry per stage, in ``"flops"`` or ``"seconds"``.

    Raises:
      ValueError: if ``fns`` is not a non-empty list of callables, ``params`` has not one entry
        per stage, ``method`` or ``repeats`` is bad, a leaf of ``example_input`` or of a
        stage's output has no leading batch axis of the micro-batch size, or (``"flops"``) a
        pass compiles to a loop, whose FLOPs XLA undercounts.

    >>> import jax, jax.numpy as jnp, replicator as rp
    >>> fns = [lambda w, x: x @ w, lambda w, x: jnp.tanh(x @ w)]  # [4, 8] -> [4, 16] -> [4, 2]
    >>> params = [jnp.ones((8, 16)), jnp.ones((16, 2))]
    >>> c = rp.pipeline.stage_costs(fns, params, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    >>> c.forward, c.backward_input, c.backward_weight, c.backward  # 2*4*8*16 = 1024
    ((1024.0, 256.0), (1024.0, 544.0), (1024.0, 256.0), (2048.0, 800.0))
    >>> kept = rp.pipeline.stage_costs(fns, params, jnp.ones((4, 8)), remat="none")
    >>> kept.backward[0], kept.backward[1] < c.backward[1]  # stage 1's tanh is kept
    (2048.0, True)
    """
    api = "rp.pipeline.stage_costs"
    return _stage_costs(
        fns, params, example_input, method=method, repeats=repeats, api=api, remat=remat
    )


def stage_costs_stacked(
    stage_fn: Callable,
    stacked_params: PyTree,
    example_input: Any,
    *,
    virtual_stages: int = 1,
    method: str = "flops",
    repeats: int = 5,
    remat: Any = "full",
) -> StageCosts:
    """`stage_costs` of a stack of identical stages: stage 0 measured once, for every stage.

    Args:
      stage_fn: ``f(stage_params, x) -> x``, the same for every stage (e.g. a `scan_layers`).
      stacked_params: the stages' parameters as `stack_stages` builds them: every leaf
        ``[K, ...]``, or ``[V, K, ...]`` with ``virtual_stages=V``.
      example_input: one micro-batch's input to a stage (arrays or ``ShapeDtypeStruct`` values).
      virtual_stages: V, as in ``stack_stages(..., repeats=V)``; 1 unless the stack is for
        ``Circular(repeats=V)``.
      method, repeats, remat: as in `stage_costs`.

    Returns:
      `StageCosts` with ``V * K`` equal entries, one per logical stage.

    Raises:
      ValueError: as `stage_costs`; also if the leaves do not share the leading stage axes, or
        ``stage_fn`` changes its input's shapes or dtypes, which stacked stages cannot.

    >>> import jax, jax.numpy as jnp, replicator as rp
    >>> stacked = rp.pipeline.stack_stages([jnp.ones((8, 8))] * 4, num_stages=2)  # [2, 2, 8, 8]
    >>> stage = rp.pipeline.scan_layers(lambda w, x: x @ w)
    >>> c = rp.pipeline.stage_costs_stacked(stage, stacked, jnp.ones((4, 8)))
    >>> c.forward, c.backward  # per stage: 2 layers of 2*4*8*8 = 512
    ((1024.0, 1024.0), (2048.0, 2048.0))
    """
    api = "rp.pipeline.stage_costs_stacked"
    _check_method(method, repeats, api)
    v = positive_int(virtual_stages, api=api, name="virtual_stages")
    lead = 1 if v == 1 else 2
    shape = "[K, ...]" if v == 1 else f"[V={v}, K, ...]"
    p = _abstract(stacked_params)
    stacks = {tuple(a.shape[:lead]) for a in jax.tree.leaves(p) if a.ndim >= lead}
    if len(stacks) != 1 or any(a.ndim < lead for a in jax.tree.leaves(p)):
        raise ValueError(
            f"{api}: stacked_params must have the same leading stage axes {shape} on every leaf "
            f"(virtual_stages={v}); got {describe(p)}. Build it with "
            f"rp.pipeline.stack_stages(layers, num_stages=K, repeats={v})."
        )
    (axes,) = stacks
    if v != 1 and axes[0] != v:
        raise ValueError(
            f"{api}: virtual_stages={v} but the leaves' leading axis is {axes[0]}; pass "
            f"virtual_stages={axes[0]} (the repeats given to stack_stages), or 1 for a [K, ...] "
            f"stack."
        )
    row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[lead:], a.dtype), p)
    x = _abstract(example_input)
    try:
        y = jax.eval_shape(stage_fn, row, x)
    except Exception as e:
        e.add_note(f"{api}: raised by stage_fn on one stage's parameters and {describe(x)}.")
        raise
    if not same_shapes(y, x):
        raise ValueError(
            f"{api}: stage_fn maps {describe(x)} to {describe(y)}; stacked stages pass their "
            f"activation from stage to stage, so it must keep its shapes and dtypes. For stages "
            f"that change shapes, use rp.pipeline.stage_costs with one fn and params per stage."
        )
    one = _stage_costs([stage_fn], [row], x, method=method, repeats=repeats, api=api, remat=remat)
    n = int(np.prod(axes))
    return StageCosts(
        forward=one.forward * n,
        backward_input=one.backward_input * n,
        backward_weight=one.backward_weight * n,
        backward=one.backward * n,
        unit=one.unit,
    )
