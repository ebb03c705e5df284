"""The FLOPs of an HLO convolution, counted as XLA's ``HloCostAnalysis`` counts them.

A convolution's multiply-adds are ``input features per group x output features x batch per
group`` times, for each spatial dimension, the pairs (output position, kernel position) that
land on a real input element: not in the padding, and not in a hole of the input's dilation.
The TPU compiler writes batched matmuls (attention's ``bqhd,bkhd->bqhk``) this way, with the
batch dimensions as a window whose input dilation equals its size: every output position then
meets one kernel position, so such a convolution costs what the matmul costs. Counting the
whole window instead would count it that many times over.
"""

from __future__ import annotations

import re

import numpy as np


def _window(attrs: str) -> dict[str, list]:
    found = re.search(r"window=\{([^}]*)\}", attrs)
    window: dict[str, list] = {}
    for item in found.group(1).split() if found else []:
        key, _, value = item.partition("=")
        parts = value.split("x")
        window[key] = (
            [tuple(map(int, p.split("_"))) for p in parts]
            if key == "pad"
            else [int(p) for p in parts]
        )
    return window


def _valid_pairs(out: int, kernel: int, size: int, stride: int, pad_low: int,
                 lhs_dilation: int, rhs_dilation: int) -> int:  # fmt: skip
    """(output, kernel) position pairs of one spatial dimension that read a real input."""
    o = np.arange(out, dtype=np.int64)[:, None]
    k = np.arange(kernel, dtype=np.int64)[None, :]
    at = o * stride - pad_low + k * rhs_dilation
    real = (at % lhs_dilation == 0) & (at >= 0) & (at // lhs_dilation < size)
    return int(np.count_nonzero(real))


def flops(lhs: list[int], rhs: list[int], out: list[int], attrs: str) -> int:
    """FLOPs (two per multiply-add) of a convolution with these operand and result dims.

    >>> attrs = ("window={size=4x8 stride=3x7 lhs_dilate=4x8}, dim_labels=0b1f_0o1i->01bf")
    >>> flops([4, 64, 8, 32], [4, 64, 8, 32], [4, 8, 64, 64], attrs)  # 4 x 8 matmuls 64x32x64
    8388608
    >>> flops([1, 5, 3], [3, 3, 4], [1, 5, 4], "window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f")
    312
    """
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    if labels is None:
        raise ValueError(f"hlo: a convolution without dim_labels: {attrs[:200]!r}")
    lhs_labels, rhs_labels, out_labels = labels.groups()
    groups = re.search(r"feature_group_count=(\d+)", attrs)
    batch_groups = re.search(r"batch_group_count=(\d+)", attrs)
    feature_groups = int(groups.group(1)) if groups else 1
    batch_groups = int(batch_groups.group(1)) if batch_groups else 1
    in_features = lhs[lhs_labels.index("f")] // feature_groups
    out_features = rhs[rhs_labels.index("o")]
    batch = lhs[lhs_labels.index("b")] // batch_groups
    window = _window(attrs)
    spatial = [c for c in lhs_labels if c.isdigit()]
    pairs = 1
    for n, label in enumerate(sorted(spatial)):

        def get(key, default, n=n):
            values = window.get(key)
            return values[n] if values else default

        pairs *= _valid_pairs(
            out[out_labels.index(label)], rhs[rhs_labels.index(label)],
            lhs[lhs_labels.index(label)], get("stride", 1), get("pad", (0, 0))[0],
            get("lhs_dilate", 1), get("rhs_dilate", 1),
        )  # fmt: skip
    return 2 * in_features * out_features * batch * pairs
