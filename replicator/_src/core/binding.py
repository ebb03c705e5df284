"""The binding stack: which lowering the placeholder collectives mean at trace time.

A lowering pushes a `Binding` while it traces ``step_fn``; every placeholder collective reads the
innermost one. With nothing pushed, the binding is `LOCAL`: one replica, collectives are identities.
The stack is thread-local, so two threads can trace under different lowerings.

`replica_axis_name` alone also looks one step further out: with nothing pushed, it answers for
the replicator of the innermost ``with repl.context():``, so that a layer built before the step
is traced (a BatchNorm in a model's ``__init__``) still names the replica axes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax

from replicator._src.core import scoped
from replicator._src.core.typing import AxisName


@dataclasses.dataclass(frozen=True)
class Binding:
    """What the placeholder collectives bind to.

    Attributes:
      kind: ``"local"``, ``"pmap"`` or ``"shard_map"``.
      axes: the replica axis names the collectives reduce over; ``()`` for local.
      num_replicas: the product of the sizes of ``axes``; 1 for local.
      axis_sizes: every mapped axis of the program and its size, replica axes included, so
        that a pipeline can find its ``stage`` axis.
      platform: the platform the program is compiled for (``"tpu"`` for a TPU target's
        devices on a CPU host), so that a layer can choose a kernel; ``""`` when unknown.
    """

    kind: str
    axes: tuple[AxisName, ...]
    num_replicas: int
    axis_sizes: tuple[tuple[AxisName, int], ...] = ()
    platform: str = ""
    # While step_fn is traced: id of each state leaf step_fn received -> (the leaf, the
    # non-replica mesh axes its PartitionSpec splits it over, the PartitionSpec), for
    # `split_axes` and `spec_of`.
    state_axes: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    def split_axes(self, leaf) -> tuple[AxisName, ...] | None:
        """The non-replica mesh axes a state leaf of ``step_fn`` is split over (such as
        ``("stage",)`` for pipeline stages), ``()`` if it is whole on every device of a replica,
        or None if ``leaf`` is not a state leaf as ``step_fn`` received it."""
        entry = self.state_axes.get(id(leaf))
        return entry[1] if entry is not None and entry[0] is leaf else None

    def spec_of(self, leaf):
        """The ``PartitionSpec`` (over the whole mesh) of a state leaf as ``step_fn`` received
        it, or None if ``leaf`` is not one."""
        entry = self.state_axes.get(id(leaf))
        return entry[2] if entry is not None and entry[0] is leaf else None

    def model_axes(self) -> tuple[AxisName, ...]:
        """The non-replica axes of size > 1 mapped by hand (``stage``; ``model`` is XLA's)."""
        return tuple(a for a, n in self.axis_sizes if a not in self.axes and n > 1)

    def axis_size(self, name: AxisName) -> int:
        """The size of a mapped axis, or 1 if the program does not map it."""
        return dict(self.axis_sizes).get(name, 1)


LOCAL = Binding("local", (), 1)


_STACK: scoped.Stack[Binding] = scoped.Stack()


def current_binding() -> Binding:
    """The innermost binding of this thread, or `LOCAL`."""
    return _STACK.top(LOCAL)


@contextlib.contextmanager
def bind(binding: Binding) -> Iterator[Binding]:
    """Binds the placeholder collectives to ``binding`` for the duration of the block."""
    with _STACK.push(binding):
        yield binding


def narrowed(binding: Binding, axes: tuple[AxisName, ...]) -> Binding:
    """``binding`` with ``axes`` alone as its replica axes, and the other replica axes not
    mapped at all: what a part of a step that works inside a group of replicas sees (hybrid
    ZeRO's shards inside each slice, a local-SGD worker's steps)."""
    dropped = tuple(a for a in binding.axes if a not in axes)
    sizes = dict(binding.axis_sizes)
    n = binding.num_replicas
    for a in dropped:
        n //= sizes.get(a, 1)
    return dataclasses.replace(
        binding,
        axes=tuple(a for a in binding.axes if a in axes),
        num_replicas=max(1, n),
        axis_sizes=tuple((a, k) for a, k in binding.axis_sizes if a not in dropped),
    )


@contextlib.contextmanager
def only(axes: tuple[AxisName, ...] | None) -> Iterator[None]:
    """Within the block, the placeholder collectives bind to the replica axes ``axes`` only
    (`narrowed`); nothing changes for ``None`` or under the local binding."""
    binding = current_binding()
    if axes is None or binding.is_local or set(binding.axes) <= set(axes):
        yield
        return
    with bind(narrowed(binding, tuple(axes))):
        yield


def replica_axis_name() -> AxisName | tuple[AxisName, ...] | None:
    """The axis name(s) of the replicas, for layers that take one.

    Flax's ``BatchNorm(axis_name=...)`` and similar layers call JAX's ``pmean`` themselves. Pass
    them this value and they reduce over exactly the replicas:

    * while ``step_fn`` is traced: the replica axes of the lowering tracing it, ``None`` under
      the local lowering (one replica, no reduction), ``"data"`` under ``pmap``, the data axis
      (or the tuple of data axes, such as ``("dcn_data", "data")``) under ``shard_map``;
    * outside a trace but inside ``with repl.context():``: the value ``repl.run`` binds while
      it traces, so that a model built there, e.g. with
      ``nnx.BatchNorm(..., axis_name=rp.replica_axis_name())`` in its ``__init__``, takes its
      statistics over every replica when ``repl.run`` runs it. Call such a model in training
      mode only inside ``step_fn``: elsewhere their ``pmean`` finds no replica axis, and JAX
      raises an unbound axis name error;
    * outside both: ``None``. A model built there takes its statistics over each replica's own
      examples; ``repl.run`` then refuses its first step with `ReplicasDivergedError` (the
      default check, see ``Replicator(check_replicas=...)``), naming the statistic.

    Returns:
      A mesh axis name, a tuple of them, or ``None``.

    >>> import jax, replicator as rp
    >>> rp.replica_axis_name() is None      # outside any Replicator: one replica
    True
    >>> with rp.Replicator(devices=jax.devices()[:2]).context():
    ...     rp.replica_axis_name()
    'data'
    """
    axes = _STACK.top().axes if _STACK else _CONTEXT_AXES.top(())
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


_CONTEXT_AXES: scoped.Stack[tuple[AxisName, ...]] = scoped.Stack()


@contextlib.contextmanager
def context_axes(axes: tuple[AxisName, ...]) -> Iterator[None]:
    """Within the block, `replica_axis_name` outside a trace answers ``axes``: what the
    replicator whose ``context()`` is entered binds while it traces a step."""
    with _CONTEXT_AXES.push(tuple(axes)):
        yield


def xla_cpu_with(*axes: str) -> bool:
    """Whether the program being traced is for XLA:CPU (not a TPU target's devices on a CPU
    host) on a mesh where each of ``axes`` has more than one device."""
    platform = current_binding().platform or jax.default_backend()
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    return platform == "cpu" and all(sizes.get(axis, 1) > 1 for axis in axes)
