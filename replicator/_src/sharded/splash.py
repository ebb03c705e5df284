"""Attention as the TPU's splash-attention kernel (Pallas): whole sequences, and ring blocks.

``jax.experimental.pallas.ops.tpu.splash_attention`` computes attention tile by tile in the
TPU's on-chip memory: the ``[seq, seq]`` scores never reach HBM (XLA's own attention writes
them there, several times per layer), and tiles the mask covers whole are skipped. MaxText
trains on TPUs with it. Grouped key/value heads run as they are (the kernel's multi-head form
reads key/value head ``j`` for query heads ``j G .. j G + G - 1``).

* `attend`: a whole sequence, causal in natural order, causal by ``positions`` (the zigzag
  layout after `attention`'s all-to-all) or not causal, differentiated by the kernel's own
  backward kernels.
* `block_forward` and `block_backward`: one block of a ring (`attention`'s ``impl="ring"``):
  the forward returns the block's log-sum-exp with its output, which the ring folds in with an
  online softmax; the backward takes the ring's global output and log-sum-exp, so each block's
  gradients are the global attention's. The backward calls the kernel's own backward function
  (``_splash_attention_bwd``, private: the jax releases it is read on are in `compat`).
* `splash_attention` (``attention='splash'`` of `replicator.models.gpt`): `attend`, causal,
  mapped by hand over the mesh's axes left to XLA (`by_hand`): heads over ``model``, batches
  over ``expert``.

Two options of Gemma 2/3 and Mistral, in `attend` and `splash_attention` (not the ring blocks):

* ``window=W``, a sliding window: query ``i`` sees key ``j`` iff ``0 <= i - j < W``
  (transformers' ``sliding_window``), as the kernel's own ``LocalMask`` with ``window_size=(W -
  1, 0)``: computed in the kernel tile by tile (no ``[seq, seq]`` mask enters the program), and
  the tiles wholly outside the window skipped (`live_pairs` counts the others).
* ``soft_cap=c``: the scaled scores ``s = q.k / sqrt(head_dim)`` become ``c tanh(s / c)`` before
  the mask and the softmax (the kernel's ``attn_logits_soft_cap``, on queries already scaled).

Off a TPU the same kernel runs in Pallas's interpreter: the same arithmetic, slowly, which is
what the tests compare against `attention.reference`. The step's platform is its binding's
(`Binding.platform`), else JAX's default backend: a step compiled for a TPU target on a CPU host
gets the TPU kernel.

XLA's cost analysis does not see inside the kernel, so each call carries its work in its
name scope (``replicator_kernel_flops_N``: the multiply-adds of its live tiles, forward), which
`hlo` reads, with the backward kernels' share, to count the step's FLOPs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from replicator._src.core import binding as binding_lib

BLOCK = 512  # MaxText's default tiles: 512 queries x 512 keys
KERNEL_FLOPS = "replicator_kernel_flops_{}"


def platform() -> str:
    """The platform the current step is compiled for: its binding's, else JAX's default."""
    return binding_lib.current_binding().platform or jax.default_backend()


def fits(seq: int) -> bool:
    """Whether the kernel's tiles divide a sequence (or block) of ``seq`` tokens: a multiple of
    128 up to `BLOCK`, and of `BLOCK` beyond."""
    block = min(BLOCK, seq)
    return seq % block == 0 and block % 128 == 0


def _block(seq: int) -> int:
    if not fits(seq):
        raise ValueError(
            f"attention='splash' runs over tiles of {BLOCK} tokens (or the whole sequence, a "
            f"multiple of 128): seq_len={seq} is neither; use a sequence length that is a "
            f"multiple of 128 (and of {BLOCK} when longer), or attention='dot_product'."
        )
    return min(BLOCK, seq)


def mask_key(causal: bool, positions=None, *, window: int | None = None):
    """The kernel's mask: ``"full"``, ``"causal"`` (natural order, or ``positions`` that
    increase), the tuple of ``positions`` (a token attends to those at or before its own), or
    ``("local", window)``: causal within a sliding window of ``window`` tokens (natural order,
    or ``positions`` that step by 1).

    Raises:
      ValueError: for a window that is not a positive int, or not causal, or over ``positions``
        that do not step by 1.
    """
    if window is not None:
        steps = None if positions is None else np.diff(np.asarray(positions))
        if isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 1:
            raise ValueError(f"splash attention: window={window!r}; use a positive int or None.")
        if not causal:
            raise ValueError("splash attention: a sliding window is causal, got causal=False; "
                             "use causal=True, or window=None.")  # fmt: skip
        if steps is not None and np.any(steps != 1):
            raise ValueError("splash attention: a sliding window needs tokens in natural order "
                             "(positions that step by 1); use window=None.")  # fmt: skip
        return ("local", int(window))
    if not causal:
        return "full"
    if positions is None or np.all(np.diff(np.asarray(positions)) > 0):
        return "causal"
    return tuple(int(p) for p in positions)


def _window(key) -> int | None:
    """The sliding window of a `mask_key`, else None."""
    return key[1] if isinstance(key, tuple) and key[0] == "local" else None


def _mask(key, q_len: int, kv_len: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if key == "full":
        return sm.FullMask((q_len, kv_len))
    if key == "causal":
        return sm.CausalMask((q_len, kv_len))
    if (window := _window(key)) is not None:  # j visible iff i - (window - 1) <= j <= i
        return sm.LocalMask((q_len, kv_len), window_size=(window - 1, 0), offset=0)
    positions, pos = key, np.asarray(key)

    class Positions(sm.Mask):  # query i sees key j where pos[i] >= pos[j]; partial tiles stored
        shape = (len(pos), len(pos))
        __getitem__ = lambda self, idx: pos[idx[0]][:, None] >= pos[idx[1]][None, :]
        __eq__ = lambda self, other: getattr(other, "key", None) == key
        __hash__ = lambda self: hash(key)
        key = positions

    return Positions()


@functools.cache
def _kernel(
    heads: int, q_len: int, kv_len: int, key, interpret: bool, residuals: bool, *,
    soft_cap: float | None = None,
):  # fmt: skip
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    bq, bk = _block(q_len), _block(kv_len)
    mask = sm.MultiHeadMask([_mask(key, q_len, kv_len) for _ in range(heads)])
    sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                          block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)  # fmt: skip
    with jax.ensure_compile_time_eval():  # its mask tables: constants, not this trace's values
        return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret, save_residuals=residuals,
                                  attn_logits_soft_cap=soft_cap)  # fmt: skip


def live_pairs(seq: int, kv_len: int | None = None, key="causal") -> int:
    """(query, key) pairs the kernel computes: every tile the mask does not cover whole (a
    `mask_key`; for a window, the tiles with a pair ``0 <= i - j < window``).

    >>> live_pairs(1024)  # 2 x 2 tiles of 512: 3 live
    786432
    >>> live_pairs(2048, key=("local", 512))  # 4 x 4 tiles: the diagonal and the one below
    1835008
    """
    kv_len = seq if kv_len is None else kv_len
    bq, bk = _block(seq), _block(kv_len)
    if key == "full":
        return seq * kv_len
    window = _window(key)
    pos = np.arange(seq) if key == "causal" or window is not None else np.asarray(key)
    tq, tk = pos.reshape(-1, bq), pos[:kv_len].reshape(-1, bk)
    live = tq.max(1)[:, None] >= tk.min(1)[None, :]
    if window is not None:
        live &= tq.min(1)[:, None] - tk.max(1)[None, :] < window
    return int(np.sum(live)) * bq * bk


def _flops(q, kv_len: int, key) -> int:
    batch, heads, seq, dim = q.shape
    return 4 * dim * live_pairs(seq, kv_len, key) * heads * batch  # QK^T and PV


def attend(
    q, k, v, *, causal: bool = True, positions=None, window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # fmt: skip
    """Attention of ``q`` ``[batch, heads, seq, head_dim]`` over ``k``, ``v`` ``[batch,
    kv_heads, seq, head_dim]`` (``kv_heads`` divides ``heads``), whole sequences on this device:
    `attention.reference` (heads first), differentiable. ``window``: query ``i`` sees keys
    ``i - window < j <= i``; ``soft_cap``: scores ``s = q.k / sqrt(head_dim)`` become ``soft_cap
    tanh(s / soft_cap)`` before the mask and softmax (the kernel caps the queries scaled here).

    Raises:
      ValueError: for a sequence the kernel's tiles do not divide (`fits`), or a window
        `mask_key` refuses.
    """
    _, heads, seq, dim = q.shape
    key = mask_key(causal, positions, window=window)
    kernel = _kernel(heads, seq, seq, key, platform() != "tpu", False, soft_cap=soft_cap)
    scaled = (q * (1 / math.sqrt(dim))).astype(q.dtype)
    with jax.named_scope(KERNEL_FLOPS.format(_flops(q, seq, key))):
        return jax.vmap(kernel)(scaled, k, v).astype(q.dtype)


def block_forward(q, k, v, *, causal: bool) -> tuple[jax.Array, jax.Array]:
    """One ring block: `attend` of ``q`` ``[B, H, Sq, D]`` over a block of keys and values
    ``[B, KV, Sk, D]``, causal (a device's own block, ``Sq == Sk``) or not, and its
    log-sum-exp ``[B, H, Sq]`` (fp32; scores scaled by ``1 / sqrt(D)``). Not differentiable:
    `block_backward` is its gradient, given the global output and log-sum-exp."""
    _, heads, sq, dim = q.shape
    key = mask_key(causal)
    kernel = _kernel(heads, sq, k.shape[2], key, platform() != "tpu", True)
    scaled = (q * (1 / math.sqrt(dim))).astype(q.dtype)
    with jax.named_scope(KERNEL_FLOPS.format(_flops(q, k.shape[2], key))):
        out, (lse,) = jax.vmap(kernel)(scaled, k, v)
    return out, lse


def block_backward(q, k, v, out, lse, do, *, causal: bool) -> tuple:
    """The gradients ``(dq, dk, dv)`` of one ring block (`block_forward`'s arguments) where
    ``out`` ``[B, H, Sq, D]`` and ``lse`` ``[B, H, Sq]`` are the global attention's output and
    log-sum-exp and ``do`` its output's gradient: each block's share of the global gradients
    (``delta = sum(do * out)`` is taken from the global output), by the kernel's backward."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    _, heads, sq, dim = q.shape
    key = mask_key(causal)
    kernel = _kernel(heads, sq, k.shape[2], key, platform() != "tpu", True)
    kw, scale = kernel.kwargs, 1 / math.sqrt(dim)
    collapse = lambda info: info._replace(
        partial_mask_blocks=None
        if info.partial_mask_blocks is None
        else info.partial_mask_blocks.reshape(-1, *info.partial_mask_blocks.shape[-2:])
    )
    infos = collapse(kernel.dq_mask_info), collapse(kernel.dkv_mask_info)

    def one(q, k, v, out, lse, do):
        res = (q, k, v, None, None, out, lse, *infos)
        grads = sk._splash_attention_bwd(
            False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None,
            kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"], res, do,
        )  # fmt: skip
        return grads[3:6]

    scaled = (q * scale).astype(q.dtype)
    with jax.named_scope(KERNEL_FLOPS.format(_flops(q, k.shape[2], key))):
        dq, dk, dv = jax.vmap(one)(scaled, k, v, out, lse, do)
    return (dq * scale).astype(q.dtype), dk, dv


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # fmt: skip
    """Causal attention of ``q`` ``[batch, seq, heads, head_dim]`` over ``k``, ``v`` ``[batch,
    seq, kv_heads, head_dim]`` (``kv_heads`` divides ``heads``): the result has ``q``'s shape
    and dtype, as `attention.reference` computes it. `splash_attention_heads_first` on the
    kernel's own layout, with the heads moved before the sequence and back; ``window`` and
    ``soft_cap`` as there.

    Raises:
      ValueError: as `splash_attention_heads_first`.
    """
    heads_first = lambda a: a.transpose(0, 2, 1, 3)
    out = splash_attention_heads_first(
        *map(heads_first, (q, k, v)), window=window, soft_cap=soft_cap
    )
    return heads_first(out)


def splash_attention_heads_first(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # fmt: skip
    """`splash_attention` of ``q`` ``[batch, heads, seq, head_dim]`` over ``k``, ``v``
    ``[batch, kv_heads, seq, head_dim]``, the kernel's layout: a model that projects its queries,
    keys and values straight into it (and its output projection out of it) moves no activation
    between layouts (`replicator.models.gpt` with ``attention='splash'``). On a mesh, the
    kernel runs on each device's heads (``model``) and sequences (``expert``): `by_hand`.

    Args:
      window: a sliding window (Gemma 2/3's local layers, Mistral): query ``i`` sees keys ``i -
        window < j <= i``; None: every key up to ``i``.
      soft_cap: Gemma 2's attention-logit cap: the scores ``s = q.k / sqrt(head_dim)`` become
        ``soft_cap * tanh(s / soft_cap)`` before the mask and the softmax; None: uncapped.

    Raises:
      ValueError: for a sequence the kernel's tiles do not divide; for a window that is not a
        positive int, or a soft cap that is not positive; for a ``context`` axis (the kernel
        needs whole sequences), or heads or a batch the ``model`` or ``expert`` axis does not
        divide.
    """
    _block(q.shape[2])
    mask_key(True, window=window)
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"splash attention: soft_cap={soft_cap!r}; use a positive number or None.")
    if k.shape[1] % _axis_size("model"):  # K/V heads that cannot split: repeated for theirs
        k, v = (jnp.repeat(a, q.shape[1] // k.shape[1], axis=1) for a in (k, v))
    attend_f = functools.partial(attend, causal=True, window=window, soft_cap=soft_cap)
    mapped, why = by_hand(attend_f, batch=q.shape[0], heads=q.shape[1], layout="bhsd")
    if mapped is None:
        raise ValueError(
            f"attention='splash' runs the kernel on whole sequences, on each device's heads "
            f"(model) and sequences (expert), but {why}; use attention='dot_product', or "
            f"'ring'/'all_to_all' with a context axis."
        )
    return mapped(q, k, v)


def _axis_size(name: str) -> int:
    from replicator._src.core.collectives import auto_axis_size

    return auto_axis_size(name)


def by_hand(f, *, batch: int, heads: int, layout: str, seq_axis: str | None = None):
    """``f`` (of ``q``, ``k``, ``v`` in ``layout`` ``"bhsd"`` or ``"bshd"``, to one output
    laid out as ``q``) mapped by hand over every mesh axis left to XLA, as the TPU needs to
    compile a Pallas kernel: ``model`` splits the heads, ``expert`` the batch, ``seq_axis``
    (``"context"`` for `attention`'s ring and all-to-all, whose ``f`` then runs their
    collectives) the sequence, and axes of size 1 stay whole. Returns ``(mapped, None)``, or
    ``(None, reason)`` when an axis cannot split its dimension (XLA would gather the whole batch
    to every device instead; the TPU compiler refuses it)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    auto = {a: n for a, n in sizes.items() if a not in manual}
    dims = {"b": None, "h": None, "s": None}
    for axis, n in auto.items():
        if n == 1:
            continue
        if axis == "model" and heads % n == 0:
            dims["h"] = axis
        elif axis == "expert" and batch % n == 0:
            dims["b"] = axis
        elif axis == seq_axis:
            dims["s"] = axis
        else:
            what = {"model": f"{heads} heads", "expert": f"a batch of {batch}"}.get(axis)
            return None, (
                f"the mesh's {axis!r} axis of {n} devices does not divide {what}"
                if what
                else f"the mesh's {axis!r} axis of {n} devices splits them"
            )
    if not auto:
        return f, None
    spec = P(*(dims.get(c) for c in layout))
    return jax.shard_map(f, in_specs=(spec,) * 3, out_specs=spec, axis_names=set(auto),
                         check_vma=False), None  # fmt: skip
