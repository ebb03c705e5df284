"""Which kernel `attention` runs on, by the platform its step is compiled for.

* TPU: the splash-attention Pallas kernel (`splash`), for whole sequences (one device, and
  each device after the all-to-all of ``impl="all_to_all"``) and for each block of the ring
  (``impl="ring"``: `fold` and `grads`), wherever its tiles divide the sequence or block and
  the heads are a multiple of 128 wide (Llama's and Gemma's, as MaxText runs the kernel).
* GPU: cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``)
  for whole sequences in fp16 or bf16 with a head size cuDNN takes (`cudnn_applies`); ring
  blocks keep the blockwise kernel (cuDNN's public call gives no log-sum-exp to fold with).
* Elsewhere, and where a kernel does not apply: XLA's blockwise kernel (`attention`'s tiles of
  64 keys and an online softmax), which is also the oracle.

`forced` overrides the choice for the steps traced inside it, so that the tests run the Pallas
path on a CPU (in Pallas's interpreter):

>>> with forced("xla"):
...     choose(seqs=(1024,), dtype="bfloat16", head_dim=128)
'xla'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from replicator._src.core import scoped
from replicator._src.sharded import splash

KERNELS = ("xla", "splash", "cudnn")
_FORCED: scoped.Stack[str] = scoped.Stack()


@contextlib.contextmanager
def forced(kernel: str) -> Iterator[None]:
    """Within the block, `attention` traces with ``kernel`` (one of `KERNELS`) instead of the
    platform's choice: ``"splash"`` on a CPU runs the TPU's kernel in Pallas's interpreter.
    A step compiled inside keeps the kernel it was traced with.

    Raises:
      ValueError: for an unknown kernel.
    """
    if kernel not in KERNELS:
        raise ValueError(f"forced: kernel={kernel!r}; use one of {', '.join(map(repr, KERNELS))}.")
    with _FORCED.push(kernel):
        yield


def cudnn_applies(dtype, head_dim: int, natural: bool) -> bool:
    """Whether cuDNN's fused attention takes a whole sequence: fp16 or bf16, a head size that
    is a multiple of 8 up to 128, and a causal mask in natural order (or none)."""
    ok = jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
    return ok and head_dim % 8 == 0 and head_dim <= 128 and natural


def choose(*, seqs: tuple[int, ...], dtype, head_dim: int, whole: bool = True,
           natural: bool = True, platform: str | None = None) -> str:  # fmt: skip
    """The kernel for attention over sequences (or ring blocks) of ``seqs`` tokens: `forced`'s,
    else by ``platform`` (default: the step's, `splash.platform`). ``whole``: the sequences
    are whole (not ring blocks); ``natural``: a causal mask in natural order.

    >>> choose(seqs=(1024,), dtype="bfloat16", head_dim=128, platform="tpu")
    'splash'
    >>> choose(seqs=(1000,), dtype="bfloat16", head_dim=128, platform="tpu")  # tiles do not divide
    'xla'
    >>> choose(seqs=(1024,), dtype="bfloat16", head_dim=32, platform="tpu")  # narrow heads
    'xla'
    >>> choose(seqs=(1024,), dtype="bfloat16", head_dim=128, platform="gpu")
    'cudnn'
    >>> choose(seqs=(512, 256), dtype="bfloat16", head_dim=128, whole=False, platform="gpu")
    'xla'
    """
    kernel = _FORCED.top(None)
    if kernel is None:
        platform = splash.platform() if platform is None else platform
        kernel = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(platform, "xla")
        if kernel == "splash" and head_dim % 128:  # heads the TPU's lanes hold whole (MaxText's)
            kernel = "xla"
    if kernel == "splash" and not all(splash.fits(s) for s in seqs):
        return "xla"
    if kernel == "cudnn" and not (whole and cudnn_applies(dtype, head_dim, natural)):
        return "xla"
    return kernel


def whole(q, k, v, *, causal: bool, positions, kernel: str) -> jax.Array:
    """Attention over whole ``[B, S, H, D]`` sequences (``k``, ``v`` with their own heads) by
    ``kernel`` (``"splash"`` or ``"cudnn"``): `attention.reference` at ``positions``."""
    if kernel == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    heads_first = lambda a: a.transpose(0, 2, 1, 3)
    out = splash.attend(*map(heads_first, (q, k, v)), causal=causal, positions=positions)
    return heads_first(out)


def fold(acc, q, k, v, *, causal: bool):
    """Folds one ring block (``q`` ``[B, Sq, H, D]`` against ``k``, ``v`` ``[B, Sk, KV, D]``)
    into the running ``(o, m, total)`` of `attention`'s online softmax (``o`` unnormalised, fp32)
    by the splash kernel: the block's output ``o_b`` and log-sum-exp ``l_b`` are the state
    ``(o_b, l_b, 1)``, merged as two parts of one softmax."""
    t = lambda a: a.transpose(0, 2, 1, 3)
    out, lse = splash.block_forward(t(q), t(k), t(v), causal=causal)
    o, m, total = acc
    lse = lse.transpose(0, 2, 1)
    m_new = jnp.maximum(m, lse)
    old, new = jnp.exp(m - m_new), jnp.exp(lse - m_new)
    o = o * old[..., None] + t(out).astype(jnp.float32) * new[..., None]
    return o, m_new, total * old + new


def grads(q, k, v, out, lse, do, *, causal: bool):
    """The gradients ``(dq, dk, dv)`` (fp32) of one ring block by the splash kernel's
    backward, given the global ``out`` ``[B, Sq, H, D]`` and log-sum-exp ``lse`` ``[B, Sq, H]``
    (`splash.block_backward`)."""
    t = lambda a: a.transpose(0, 2, 1, 3)
    g = splash.block_backward(
        t(q), t(k), t(v), t(out), lse.transpose(0, 2, 1), t(do), causal=causal
    )
    return tuple(t(x).astype(jnp.float32) for x in g)


def natural(positions) -> bool:
    """Whether ``positions`` are in natural order (increasing)."""
    return bool(np.all(np.diff(np.asarray(positions)) > 0))
