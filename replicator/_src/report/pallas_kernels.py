"""JAX's own Pallas kernels read from their shapes, where no caller named their FLOPs.

XLA's cost analysis does not see into a Pallas kernel. replicator's own calls name their FLOPs
in their scope (`hlo`'s ``replicator_kernel_flops_N``); this module reads the kernels of JAX's
own that come without, in another library's program (MaxText's) or a step that calls them
itself: splash attention and the grouped matmuls.
"""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np

_LAYOUT_SHAPES = re.compile(r"\b(bf16|f32|f16|s8|s32|u8|u32|pred)\[([\d,]*)\]")
_FLOATS = ("bf16", "f32", "f16")


def untagged_flops(name: str, shape: str, attrs: str) -> Fraction:
    """The FLOPs of a Pallas kernel of JAX's own that no caller named (0 for any other): from
    the shapes in its ``operand_layout_constraints`` and its result.

    * splash attention (``splash_mha_fwd...``, ``_dq``, ``_dkv``; queries ``[B, H, S, D]``,
      keys ``[B, KV, S', D]``, its block mask ``[1 or H, S / bq, S' / bk]`` first): ``4 D`` a
      live (query, key) pair of a causal mask's blocks, times 1.5 for ``dq`` (the scores
      again), 2 for ``dkv``, 2.5 for a ``dkv`` that also gives ``dq`` (its parts, one result
      of five dimensions);
    * grouped matmuls, megablox's and ``lax.ragged_dot``'s (``gmm``, ``ragged-dot-none``:
      rows ``[m, k]`` by ``[G, k, n]``; ``tgmm``: ``[G, k, n]`` from ``[m, k]`` and ``[m,
      n]``): ``2 m k n``.

    >>> attrs = ("operand_layout_constraints={s8[1,2,2]{2,1,0}, s8[1,2,2]{2,1,0}, "
    ...          "bf16[1,2,1024,128]{3,2,1,0}, bf16[1,1,1024,128]{3,2,1,0}}, api_version=4")
    >>> # 2 x 2 blocks of 512, 3 live: 4 x 128 x 3 x 512^2 x 2 heads
    >>> int(untagged_flops("splash_mha_fwd_residuals.1", "bf16[1,2,1024,128]", attrs))
    805306368
    >>> attrs = ("operand_layout_constraints={s32[], s32[5]{0}, bf16[512,64]{1,0}, "
    ...          "bf16[4,64,256]{2,1,0}}")
    >>> # 512 rows of 64 by 4 groups' [64, 256]: 2 x 512 x 64 x 256
    >>> int(untagged_flops("gmm.3", "bf16[512,256]{1,0}", attrs))
    16777216
    """
    key = "operand_layout_constraints={"
    start = attrs.find(key)
    if start < 0:
        return Fraction(0)
    start += len(key)
    depth, end = 1, start
    while end < len(attrs) and depth:  # to the brace that closes the list
        depth += (attrs[end] == "{") - (attrs[end] == "}")
        end += 1
    listed = attrs[start:end]
    dims = lambda text: [int(d) for d in text.split(",") if d]
    operands = [(dtype, dims(d)) for dtype, d in _LAYOUT_SHAPES.findall(listed)]
    floats = [o for dtype, o in operands if dtype in _FLOATS]
    base = name.split(".")[0]
    if base.startswith("splash_mha_"):
        masks = [o for dtype, o in operands if dtype == "s8" and len(o) == 3]
        heads4 = [o for o in floats if len(o) == 4]
        if not masks or len(heads4) < 2:
            return Fraction(0)
        (b, h, seq, d), kv_len = heads4[0], heads4[1][2]
        nq, nk = masks[0][1], masks[0][2]
        bq, bk = seq // max(nq, 1), kv_len // max(nk, 1)
        if not bq or not bk:
            return Fraction(0)
        ends = np.arange(1, nq + 1) * bq - 1  # each query block's last position
        live = int(np.sum(ends[:, None] >= (np.arange(nk) * bk)[None, :])) * bq * bk
        fused = any(len(dims(d)) == 5 for _, d in _LAYOUT_SHAPES.findall(shape))  # dq's parts
        share = (Fraction(3, 2) if "_dq" in base else
                 (Fraction(5, 2) if fused else 2) if "_dkv" in base else 1)  # fmt: skip
        return Fraction(4 * d * live * h * b) * share
    results = _LAYOUT_SHAPES.findall(shape)
    out = dims(results[0][1]) if results else []
    rows = [o for o in floats if len(o) == 2]
    groups = [o for o in floats if len(o) == 3]
    if base in ("gmm", "ragged-dot-none") and len(out) == 2 and rows and groups:
        m, n = out
        k = int(np.prod(groups[0][1:])) // n
        return Fraction(2 * m * k * n)
    if base == "tgmm" and len(out) == 3 and rows:
        _, k, n = out
        m = int(np.prod(rows[0])) // k
        return Fraction(2 * m * k * n)
    return Fraction(0)
