"""What a layer keeps for its backward pass: `Remat`, the policies by name, and the names.

A policy is ``"none"`` (everything ``jax.vjp`` keeps), ``"full"`` (the layer's input only: the
layer is computed again in the backward pass), ``"dots"`` (the outputs of matrix products
without batch dimensions: Megatron-LM's selective recomputation), any ``jax.checkpoint`` policy,
or a choice **per named activation**. The decoder names its activations with
`jax.ad_checkpoint.checkpoint_name`, under MaxText's names (`ACTIVATIONS`), so that a MaxText
recipe's ``remat_policy`` moves over as it is:

- the presets MaxText users tune (`PRESETS`): ``"minimal"`` (every projection's output),
  ``"save_dot_except_mlpwi"`` (all of them but the MLP's input projections),
  ``"save_dot_except_mlp"``, ``"save_qkv_proj"``, ``"save_out_proj"``, and the two that keep
  on the host what they save: ``"minimal_offloaded"``, ``"qkv_proj_offloaded"``; and
  replicator's ``"save_dot_offload_mlpwi_0"`` (``save_dot_except_mlpwi`` with the MLP's gate
  projection kept on the host);
- or a mapping ``{name: action}``, MaxText's ``remat_policy=custom``, each action ``"save"``
  (kept in device memory; MaxText's ``"device"``), ``"offload"`` (kept in host memory,
  ``pinned_host``: written there in the forward pass and read back in the backward pass) or
  ``"recompute"`` (MaxText's ``"remat"``, the default for a name left out).

Every policy gives the same numbers; it trades memory for FLOPs (recomputing) or for host-link
traffic (offloading).

>>> as_remat("save_dot_except_mlpwi", "f").saved
('key_proj', 'mlpwo', 'out_proj', 'qkv_proj', 'query_proj', 'value_proj')
>>> as_remat({"decoder_layer_input": "offload", "out_proj": "save"}, "f").offloaded
('decoder_layer_input',)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from replicator._src.core.sharded_params import regather_policy

#: The activations the decoder names, and what each is (MaxText's names).
ACTIVATIONS = {
    "decoder_layer_input": "a block's input (the residual stream entering it)",
    "query_proj": "the queries' projection, before rotary positions",
    "key_proj": "the keys' projection, before rotary positions",
    "value_proj": "the values' projection",
    "qkv_proj": "GPT-2's fused query, key and value projection",
    "context": "attention's output, before its output projection",
    "out_proj": "attention's output projection",
    "mlpwi_0": "the SwiGLU MLP's gate projection",
    "mlpwi_1": "the SwiGLU MLP's up projection",
    "mlpwi": "the GELU MLP's input projection",
    "mlpwo": "the MLP's output projection",
}

_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
_DOTS = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")

#: MaxText's presets: ``(saved on device, offloaded to the host)``.
PRESETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "minimal": (_DOTS, ()),
    "save_dot_except_mlpwi": ((*_QKV, "out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": ((*_QKV, "out_proj"), ()),
    "save_qkv_proj": (_QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "minimal_offloaded": ((), _DOTS),
    "qkv_proj_offloaded": ((), ("query_proj", "key_proj", "value_proj")),
    # replicator's own: save_dot_except_mlpwi with the gate's projection kept on the host, so
    # that only the up projection is computed again (what `rp.plan` tries when HBM is short)
    "save_dot_offload_mlpwi_0": ((*_QKV, "out_proj", "mlpwo"), ("mlpwi_0",)),
}

_BUILTIN = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

#: Every policy name `as_remat` takes.
NAMES = (*_BUILTIN, *PRESETS)

#: Each action of a per-name policy, and the words MaxText's recipes use for it.
ACTIONS = {"save": "save", "device": "save", "offload": "offload", "recompute": "recompute",
           "remat": "recompute"}  # fmt: skip

#: Where an offloaded activation is kept (a JAX memory kind).
HOST_MEMORY = "pinned_host"


@dataclasses.dataclass(frozen=True, eq=False)
class Remat:
    """A rematerialisation policy: what each layer keeps for its backward pass.

    Attributes:
      name: ``"none"``, ``"full"``, ``"dots"``, a preset's name (`PRESETS`), ``"names"`` for a
        per-name choice, or ``"custom"`` for a ``jax.checkpoint`` policy.
      policy: the ``jax.checkpoint`` policy (``None`` for ``"none"``: no checkpoint at all).
      saved: the named activations kept in device memory (`ACTIVATIONS`).
      offloaded: the named activations kept in host memory.
    """

    name: str
    policy: Callable | None = None
    saved: tuple[str, ...] = ()
    offloaded: tuple[str, ...] = ()

    @classmethod
    def by_name(cls, saved=(), offloaded=(), name: str = "names") -> Remat:
        """The policy that keeps ``saved`` in device memory, ``offloaded`` in host memory and
        recomputes the rest."""
        saved, offloaded = tuple(sorted(set(saved))), tuple(sorted(set(offloaded)))
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(saved),
            names_which_can_be_offloaded=list(offloaded),
            offload_src="device",
            offload_dst=HOST_MEMORY,
        )
        return cls(name, policy, saved, offloaded)

    @property
    def recomputes(self) -> bool:
        """Whether the backward pass recomputes any part of the forward pass."""
        return self.name != "none"

    @property
    def actions(self) -> dict[str, str]:
        """``{name: "save" | "offload"}`` for a per-name policy (the rest is recomputed)."""
        return {**{n: "save" for n in self.saved}, **{n: "offload" for n in self.offloaded}}

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` under this policy's ``jax.checkpoint`` (``fn`` itself for ``"none"``)."""
        if self.policy is None:
            return fn
        return jax.checkpoint(fn, prevent_cse=False, policy=self.policy)

    def _key(self) -> tuple:
        named = self.saved or self.offloaded or self.name in (*_BUILTIN, *PRESETS, "names")
        return (self.name, self.saved, self.offloaded, None if named else self.policy)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Remat) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        if self.name != "names":
            return self.name
        return ",".join(f"{n}={a}" for n, a in sorted(self.actions.items())) or "full"


def named(x: Any, name: str) -> Any:
    """``x`` named ``name`` for the per-name policies (`jax.ad_checkpoint.checkpoint_name`)."""
    assert name in ACTIVATIONS, name
    return checkpoint_name(x, name)


def never_gathered(remat: Remat) -> Callable:
    """``remat``'s ``jax.checkpoint`` policy, except that ZeRO-3's gathered parameters are never
    kept (`rp.regather_policy`): a pipeline keeps residuals for several micro-batches, and a
    copy of each layer's whole weights with each would undo ZeRO-3. ``"none"`` keeps all else.
    A per-name policy's answer (kept, offloaded or recomputed) passes through unchanged."""
    if remat.policy is None:
        return regather_policy()
    keep, gathered = remat.policy, regather_policy()
    return lambda prim, *args, **params: (
        keep(prim, *args, **params) if gathered(prim, *args, **params) else False
    )


def as_remat(value: Any, api: str = "remat") -> Remat:
    """The `Remat` for a ``remat=`` argument.

    ``True`` means ``"full"`` and ``False`` means ``"none"`` (the meaning they always had); a
    mapping is a per-name policy (`ACTIVATIONS`, `ACTIONS`); a callable is taken as a
    ``jax.checkpoint`` policy.

    Raises:
      ValueError: for an unknown policy, activation name or action, naming the valid ones.

    >>> as_remat("dots", "f").name, as_remat(True, "f").name, as_remat(False, "f").name
    ('dots', 'full', 'none')
    >>> str(as_remat({"out_proj": "device", "query_proj": "remat"}, "f"))
    'out_proj=save'
    """
    if isinstance(value, Remat):
        return value
    if isinstance(value, bool):
        value = "full" if value else "none"
    if isinstance(value, str):
        key = value.lower()
        if key in PRESETS:
            return Remat.by_name(*PRESETS[key], name=key)
        if key not in _BUILTIN:
            raise ValueError(
                f"{api}: remat must be one of {', '.join(map(repr, NAMES))}, True (= 'full'), "
                f"False (= 'none'), a mapping {{activation: 'save' | 'offload' | 'recompute'}} "
                f"or a jax.checkpoint policy; got {value!r}."
            )
        return Remat(key, _BUILTIN[key])
    if isinstance(value, Mapping):
        return _per_name(value, api)
    if callable(value):
        return Remat("custom", value)
    raise TypeError(
        f"{api}: remat must be one of {', '.join(map(repr, NAMES))}, True, False, a mapping "
        f"{{activation: action}} or a jax.checkpoint policy; got {value!r}."
    )


def _per_name(value: Mapping, api: str) -> Remat:
    saved, offloaded = [], []
    for name, action in value.items():
        if name not in ACTIVATIONS:
            raise ValueError(
                f"{api}: remat names an activation {name!r} the decoder does not name; use "
                f"one of {', '.join(ACTIVATIONS)}."
            )
        what = ACTIONS.get(str(action).lower()) if isinstance(action, str) else None
        if what is None:
            raise ValueError(
                f"{api}: remat[{name!r}]={action!r}; use 'save' (kept on the device), "
                f"'offload' (kept in host memory) or 'recompute'."
            )
        if what == "save":
            saved.append(name)
        elif what == "offload":
            offloaded.append(name)
    return Remat.by_name(saved, offloaded)
