"""Pipelines of any model: stages with their own functions, parameters and activation shapes.

`sequential` describes a model as S logical stages in order (an embedding, blocks, a head, a
CNN's downsampling stages...). The pipeline still runs it as one SPMD program: each device's
stage parameters are packed into one buffer per dtype (padded to the largest stage), the
activation that moves between stages is packed the same way (padded to the largest boundary), and
each device picks its stage's step with a ``lax.switch`` (`steps.StageLayout`: a run of layers
is one step per layer). `stages_from_layers` turns a list of layers and a split such as
`balance` gives into stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.core.errors import positive_int
from replicator._src.core.packed import PackedStages
from replicator._src.core.packing import Packing
from replicator._src.core.typing import PyTree
from replicator._src.pipeline.layer_stack import Program, describe, scan_layers
from replicator._src.pipeline.steps import Chain, StageLayout

_API = "rp.pipeline.sequential"


class SequentialStages:
    """S stages in order, each ``fn(params, x) -> y`` with its own parameters and shapes.

    Build it with `sequential`. ``pack`` lays the stages' parameters out for the mesh, ``unpack``
    turns packed parameters (or their gradients) back into one tree per stage, and ``run`` is the
    model on one device, stage after stage: the meaning every pipeline schedule keeps.
    """

    def __init__(self, fns: Sequence[Callable], params: Sequence[PyTree], repeats: int) -> None:
        self.fns = tuple(fns)
        self.repeats = repeats
        self.num_stages = len(self.fns) // repeats  # K, the size of the 'stage' axis it needs
        self.params_layout = StageLayout(self.fns, params)

    def __len__(self) -> int:
        return len(self.fns)

    def __repr__(self) -> str:
        names = ", ".join(getattr(f, "__name__", repr(f)) for f in self.fns)
        return f"SequentialStages([{names}], num_stages={self.num_stages}, repeats={self.repeats})"

    def pack(self, params: Sequence[PyTree]) -> PackedStages:
        """The stages' parameters as ``{dtype: [K, n]}`` (``[V, K, n]`` with repeats), padded.

        Place the result with ``repl.place(packed, rp.pipeline.stage_spec(repeats))``; each
        device then holds its stage's ``[1, n]``. Row ``[r, s]`` is logical stage ``r*K + s``.
        The result is a dict (a `PackedStages`) that keeps this model through ``jax.tree.map``,
        placement and gradients, so that ``repl.wrap_optimizer`` updates each stage's own tree,
        leaf by leaf, as optax would on one device.
        """
        self._check_params(params, "pack")
        rows = [self.params_layout.pack(j, p) for j, p in enumerate(params)]
        lead = (self.num_stages,) if self.repeats == 1 else (self.repeats, self.num_stages)
        packed = {k: jnp.stack([r[k] for r in rows]).reshape((*lead, -1)) for k in rows[0]}
        return PackedStages(self, packed)

    # -- what the optimizer reads of a stage row (`replicator._src.core.packed.StageRows`) --

    def abstract_stage(self, j: int) -> PyTree:
        """The parameter tree of logical stage ``j``, of ``ShapeDtypeStruct`` leaves."""
        return self.params_layout.abstract(j)

    def unpack_row(self, j: int, row: dict[str, jax.Array]) -> PyTree:
        """The parameter tree (or gradient) of stage ``j``, from its row ``{dtype: [n]}``."""
        return self.params_layout.unpack(j, row)

    def pack_row(self, j: int, tree: PyTree) -> dict[str, jax.Array]:
        """The tree of stage ``j`` (parameters, gradients or updates) as its row ``{dtype: [n]}``."""
        return self.params_layout.pack(j, tree)

    def unpack(self, packed: dict[str, jax.Array]) -> list[PyTree]:
        """Packed parameters (or their gradients) as one tree per stage, in logical order."""
        if not isinstance(packed, dict) or set(packed) != set(self.params_layout.sizes):
            raise ValueError(
                f"{_API}(...).unpack: expected the packed stage parameters, a dict with keys "
                f"{sorted(self.params_layout.sizes)} as SequentialStages.pack returns; got "
                f"{describe(packed) if isinstance(packed, dict) else type(packed).__name__}."
            )
        for k, a in packed.items():
            want = len(self) * self.params_layout.sizes[k]
            if np.size(a) != want or np.shape(a)[-1] != self.params_layout.sizes[k]:
                raise ValueError(
                    f"{_API}(...).unpack: packed[{k!r}] has shape {np.shape(a)}, but this model "
                    f"packs its {len(self)} stages into rows of {self.params_layout.sizes[k]}; "
                    f"unpack with the model that packed them."
                )
        flat = {k: jnp.reshape(a, (len(self), -1)) for k, a in packed.items()}
        return [
            self.params_layout.unpack(j, {k: a[j] for k, a in flat.items()})
            for j in range(len(self))
        ]

    def run(self, params: Sequence[PyTree], x: PyTree) -> PyTree:
        """The model on one device: ``for fn, p in zip(fns, params): x = fn(p, x)``."""
        self._check_params(params, "run")
        for fn, p in zip(self.fns, params, strict=True):
            x = fn(p, x)
        return x

    def _check_params(self, params: Sequence[PyTree], method: str) -> None:
        if not isinstance(params, list | tuple) or len(params) != len(self):
            raise ValueError(
                f"{_API}(...).{method}: params must be a list of {len(self)} trees, one per "
                f"stage; got {type(params).__name__} of length {len(params) if isinstance(params, list | tuple) else '-'}."
            )
        for j, p in enumerate(params):
            got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), p)
            want = self.params_layout.abstract(j)
            if jax.tree.structure(got) != jax.tree.structure(want) or any(
                (a.shape, a.dtype) != (b.shape, b.dtype)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False)
            ):
                raise ValueError(
                    f"{_API}(...).{method}: params[{j}] is {describe(got)}, but the model was "
                    f"built with {describe(want)} for stage {j}; build a new model for new shapes."
                )

    def boundaries(self, x: PyTree) -> list[PyTree]:
        """The activation shapes at every stage boundary, from one micro-batch's input ``x``.

        Entry ``j`` is stage ``j``'s input (entry 0 is ``x``, entry S the model's output).

        Raises:
          ValueError: naming the stage whose function fails on the shapes it receives.
        """
        shapes = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), x)]
        for j, fn in enumerate(self.fns):
            p = self.params_layout.abstract(j)
            try:
                shapes.append(jax.eval_shape(fn, p, shapes[-1]))
            except Exception as e:
                name = getattr(fn, "__name__", repr(fn))
                raise ValueError(
                    f"{_API}: stage {j} ({name}) fails on its input {describe(shapes[-1])}"
                    f"{' (the inputs)' if j == 0 else f' (the output of stage {j - 1})'}: "
                    f"{type(e).__name__}: {str(e).split(chr(10) + '---')[0]}"
                ) from e
        return shapes

    def wire(self, x: PyTree) -> Packing:
        """The layout of the activations at every step boundary, from one micro-batch ``x``."""
        return self.params_layout.wire(x)

    def program(self, rows: PyTree, wire: Packing) -> Program:
        """The engine's view of stage rows ``{dtype: [V, n]}``: the stages' steps as layers.

        See `steps.StageLayout.program`.
        """
        return self.params_layout.program(rows, wire)


def sequential(
    stages: Sequence[Callable], params: Sequence[PyTree], /, *, repeats: int = 1
) -> SequentialStages:
    """A pipelined model of S stages that may all differ, for `value_and_grad` and `apply`.

    Stage ``j`` is ``stages[j](params[j], x) -> y``: its own function, its own parameter tree,
    and its own input and output shapes (``y`` is stage ``j+1``'s input, and the last stage's
    output goes to ``loss_fn``). The embedding and the head may be stages. The inputs may hold
    integer leaves such as token ids (they get no gradient).

    The model runs as one SPMD program on a mesh whose ``stage`` axis has K = S / repeats
    devices: each device's parameters are packed into one buffer per dtype, padded to the largest
    stage (`SequentialStages.pack`), the activation is passed on in buffers padded to the largest stage
    boundary, and each device runs its stage under ``lax.switch``, one layer of a
    `stages_from_layers` run per step. Padding costs
    ``K x (largest stage) - (all stages)`` of parameter memory (and as much for gradients and
    optimizer state), and each micro-batch's activation in flight takes the largest boundary's
    size; ``Replicator.explain`` reports both.

    Args:
      stages: S callables ``fn(params, x) -> y``, in model order.
      params: S parameter trees (floating arrays), ``params[j]`` for ``stages[j]``; only their
        shapes and dtypes are read here: pass them (or new values) to ``pack``.
      repeats: V, virtual stages per device for ``Circular(repeats=V)``; S must be a multiple.

    Returns:
      A `SequentialStages`: pass it as the ``stage_fn`` of `value_and_grad` or `apply`, with
      ``model.pack(params)`` as the stage parameters; ``model.unpack(grads)`` gives one
      gradient tree per stage.

    Raises:
      ValueError: when the lengths differ, S is not a multiple of ``repeats``, or a parameter
        leaf is not floating.

    Example:

    >>> import jax.numpy as jnp, replicator as rp
    >>> embed = lambda p, tokens: p["table"][tokens]                 # [b, T] -> [b, T, 4]
    >>> mlp = lambda p, x: jnp.tanh(x @ p)                            # [b, T, 4] -> [b, T, 8]
    >>> head = lambda p, x: x.mean(axis=1) @ p                        # -> [b, 3]
    >>> params = [{"table": jnp.ones((10, 4))}, jnp.ones((4, 8)), jnp.ones((8, 3))]
    >>> model = rp.pipeline.sequential([embed, mlp, head], params)
    >>> {k: v.shape for k, v in model.pack(params).items()}          # 3 stages, padded to 40
    {'float32': (3, 40)}
    >>> loss = lambda _, y, t: jnp.mean((y - t) ** 2)
    >>> f = rp.pipeline.value_and_grad(model, loss, num_microbatches=2)
    >>> l, (g, _, _) = f(model.pack(params), jnp.zeros((4, 5), jnp.int32), jnp.zeros((4, 3)))
    >>> [jax.tree.map(jnp.shape, gj) for gj in model.unpack(g)][1]
    (4, 8)
    """
    positive_int(repeats, api=_API, name="repeats")
    if not isinstance(stages, list | tuple) or not stages:
        raise ValueError(f"{_API}: stages must be a non-empty list of stage functions.")
    for j, fn in enumerate(stages):
        if not callable(fn):
            raise TypeError(f"{_API}: stages[{j}] must be a callable fn(params, x); got {fn!r}.")
    if not isinstance(params, list | tuple) or len(params) != len(stages):
        n = len(params) if isinstance(params, list | tuple) else type(params).__name__
        raise ValueError(
            f"{_API}: params must be a list with one parameter tree per stage; got {n} for "
            f"{len(stages)} stages."
        )
    if len(stages) % repeats:
        raise ValueError(
            f"{_API}: {len(stages)} stages do not split into repeats={repeats} virtual stages "
            f"per device; use a number of stages that is a multiple of {repeats}."
        )
    for j, p in enumerate(params):
        for path, a in jax.tree_util.tree_flatten_with_path(p)[0]:
            if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
                raise ValueError(
                    f"{_API}: params[{j}]{jax.tree_util.keystr(path)} is "
                    f"{jnp.result_type(a)}; stage parameters are trained, so they must be "
                    f"floating. Keep constants (masks, ids) in the stage function's closure."
                )
    if not any(jax.tree.leaves(p) for p in params):
        raise ValueError(f"{_API}: no stage has parameters; a pipeline needs some to train.")
    return SequentialStages(stages, params, repeats)


def stages_from_layers(
    layers: Sequence[Callable] | Callable, params: Sequence[PyTree], sizes: Any
) -> tuple[list[Callable], list[PyTree]]:
    """Groups L layers into stages of consecutive layers, for `sequential`.

    Stage ``k`` runs layers ``[b_k, b_k+1)`` in order, where the boundaries come from ``sizes``
    (layers per stage, e.g. ``(2, 1, 1, 2)``, or the `Partition` that `balance` returns).
    Two or more consecutive layers of one function (the same Python object) with parameters of
    one structure run as one `scan_layers` run, with their parameters stacked (in the pipeline,
    one layer per iteration of the schedule's scan), so compile time does not grow with their
    number; such layers must keep the activation's shape.

    Args:
      layers: one callable ``fn(params, x) -> y`` per layer, or one callable for every layer.
      params: one parameter tree per layer.
      sizes: layers per stage, or a `Partition`.

    Returns:
      ``(stage_fns, stage_params)``, to pass to `sequential`.

    >>> import jax.numpy as jnp, replicator as rp
    >>> fns, ps = rp.pipeline.stages_from_layers(
    ...     lambda w, x: x @ w, [jnp.eye(2)] * 6, rp.pipeline.balance([1] * 6, 4))
    >>> [jax.tree.map(jnp.shape, p) for p in ps]
    [(2, 2), (2, 2), (2, 2, 2), (2, 2, 2)]
    """
    api = "rp.pipeline.stages_from_layers"
    sizes = tuple(getattr(sizes, "sizes", sizes))
    fns = [layers] * len(params) if callable(layers) else list(layers)
    if len(fns) != len(params):
        raise ValueError(f"{api}: {len(fns)} layer functions for {len(params)} parameter trees.")
    if any(not isinstance(n, int | np.integer) or n < 1 for n in sizes) or sum(sizes) != len(fns):
        raise ValueError(
            f"{api}: sizes must give each stage at least one layer and add up to the "
            f"{len(fns)} layers; got {sizes}."
        )
    stage_fns, stage_params, lo = [], [], 0
    for n in sizes:
        runs = _runs(fns[lo : lo + n], params[lo : lo + n])
        lo += n
        if len(runs) == 1:
            stage_fns.append(runs[0][0])
            stage_params.append(runs[0][1])
        else:
            stage_fns.append(Chain(tuple(fn for fn, _ in runs)))
            stage_params.append(tuple(p for _, p in runs))
    return stage_fns, stage_params


def _runs(fns: list[Callable], params: list[PyTree]) -> list[tuple[Callable, PyTree]]:
    """Consecutive layers of one function and one parameter shape, each as a scanned run."""

    def key(fn, p):
        return (
            fn,
            jax.tree.structure(p),
            [(np.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(p)],
        )

    groups: list[list[int]] = []
    for i in range(len(fns)):
        if groups and key(fns[i], params[i]) == key(fns[groups[-1][0]], params[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for g in groups:
        if len(g) == 1:
            out.append((fns[g[0]], params[g[0]]))
        else:
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *(params[i] for i in g))
            out.append((scan_layers(fns[g[0]]), stacked))
    return out
