"""Causal attention as the TPU's splash-attention kernel (Pallas), for whole sequences.

``jax.experimental.pallas.ops.tpu.splash_attention`` computes attention tile by tile in the
TPU's on-chip memory: the ``[seq, seq]`` scores never reach HBM (XLA's own attention writes
them there, several times per layer), and tiles the causal mask covers whole are skipped.
MaxText trains on TPUs with it. Grouped key/value heads run as the kernel's multi-query form,
one group at a time.

Off a TPU the same kernel runs in Pallas's interpreter: the same arithmetic, slowly, which is
what the tests compare against `attention.reference`. The step's platform is its binding's
(`Binding.platform`): a step compiled for a TPU target on a CPU host gets the TPU kernel.

XLA's cost analysis does not see inside the kernel, so each call carries its work in its
name scope (``replicator_kernel_flops_N``: the multiply-adds of its live tiles, forward), which
`hlo` reads, with the backward kernels' share, to count the step's FLOPs.
"""

from __future__ import annotations

import functools
import math

import jax

from replicator._src.core import binding as binding_lib

BLOCK = 512  # MaxText's default tiles: 512 queries x 512 keys
KERNEL_FLOPS = "replicator_kernel_flops_{}"


def _block(seq: int) -> int:
    block = min(BLOCK, seq)
    if seq % block or block % 128:
        raise ValueError(
            f"attention='splash' runs over tiles of {BLOCK} tokens (or the whole sequence, a "
            f"multiple of 128): seq_len={seq} is neither; use a sequence length that is a "
            f"multiple of 128 (and of {BLOCK} when longer), or attention='dot_product'."
        )
    return block


@functools.cache
def _kernel(heads: int, seq: int, mqa: bool, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b = _block(seq)
    mask = sm.MultiHeadMask([sm.CausalMask((seq, seq)) for _ in range(heads)])
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                          block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)  # fmt: skip
    make = sk.make_splash_mqa if mqa else sk.make_splash_mha
    with jax.ensure_compile_time_eval():  # its mask tables: constants, not this trace's values
        return make(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def live_pairs(seq: int) -> int:
    """(query, key) pairs the kernel computes for a causal sequence: every tile on or below
    the diagonal, whole.

    >>> live_pairs(1024)  # 2 x 2 tiles of 512: 3 live
    786432
    """
    b = _block(seq)
    n = seq // b
    return n * (n + 1) // 2 * b * b


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of ``q`` ``[batch, seq, heads, head_dim]`` over ``k``, ``v`` ``[batch,
    seq, kv_heads, head_dim]`` (``kv_heads`` divides ``heads``): the result has ``q``'s shape
    and dtype, as `attention.reference` computes it. `splash_attention_heads_first` on the
    kernel's own layout, with the heads moved before the sequence and back.

    Raises:
      ValueError: as `splash_attention_heads_first`.
    """
    heads_first = lambda a: a.transpose(0, 2, 1, 3)
    return heads_first(splash_attention_heads_first(*map(heads_first, (q, k, v))))


def splash_attention_heads_first(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`splash_attention` of ``q`` ``[batch, heads, seq, head_dim]`` over ``k``, ``v``
    ``[batch, kv_heads, seq, head_dim]``, the kernel's layout: a model that projects its queries,
    keys and values straight into it (and its output projection out of it) moves no activation
    between layouts (`replicator.models.gpt` with ``attention='splash'``).

    Raises:
      ValueError: for a sequence the kernel's tiles do not divide, or a ``model``,
        ``context`` or ``expert`` axis, which XLA would split the kernel's call over (XLA
        cannot: it would gather the whole batch to every device instead).
    """
    from replicator._src.core.collectives import auto_axis_size

    for axis in ("model", "context", "expert"):  # XLA cannot split a kernel's call
        if auto_axis_size(axis) > 1:
            raise ValueError(
                f"attention='splash' runs the kernel on whole heads, sequences and batches of a "
                f"replica, but the mesh's {axis!r} axis splits them; use attention="
                f"'dot_product' with a model or expert axis, or 'ring'/'all_to_all' with a "
                f"context axis."
            )
    batch, heads, seq, dim = q.shape
    dtype = q.dtype
    kv_heads = k.shape[1]
    interpret = binding_lib.current_binding().platform != "tpu"
    q = (q * (1 / math.sqrt(dim))).astype(q.dtype)
    flops = 4 * dim * live_pairs(seq) * heads * batch  # QK^T and PV, per call

    def attend(q, k, v):
        if kv_heads == heads:
            return jax.vmap(_kernel(heads, seq, False, interpret))(q, k, v)
        group = heads // kv_heads
        qg = q.reshape(batch, kv_heads, group, seq, dim)
        mqa = jax.vmap(jax.vmap(_kernel(group, seq, True, interpret)))
        return mqa(qg, k, v).reshape(batch, heads, seq, dim)

    with jax.named_scope(KERNEL_FLOPS.format(flops)):
        out = _by_hand(attend)(q, k, v)
    return out.astype(dtype)


def _by_hand(f):
    """``f`` mapped by hand over the mesh's axes of size 1 left to XLA: the TPU compiles a
    Pallas kernel only where every axis is manual, so a mesh that names ``model`` or
    ``expert`` with size 1 would otherwise fail to compile. A larger axis left to XLA is not
    mapped (whole values over it would gather the batch to every device): ``model``,
    ``context`` and ``expert`` are refused above, and the TPU compiler refuses the others."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    auto = {a for a, size in sizes.items() if a not in manual and size == 1}
    if not auto:
        return f
    whole = jax.sharding.PartitionSpec()
    return jax.shard_map(f, in_specs=(whole,) * 3, out_specs=whole, axis_names=auto,
                         check_vma=False)  # fmt: skip
