"""Attention that is exact across a sequence split over the mesh's ``context`` axis.

Two ways: ring attention (key/value blocks passed round the axis, an online softmax, causal
blocks skipped, the zigzag layout for balance) or all-to-all over heads (DeepSpeed-Ulysses).
Without a ``context`` axis both are plain attention, the one-device oracle (see
`replicator._src.sharded.attention`).

>>> import jax, jax.numpy as jnp
>>> from replicator import attention
>>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))   # [batch, seq, heads, dim]
>>> out = attention.attention(q, k, v, causal=True, impl="all_to_all")
>>> bool(jnp.allclose(out, attention.reference(q, k, v, causal=True), atol=1e-6))
True
"""

from replicator._src.sharded.attention import IMPLS as IMPLS
from replicator._src.sharded.attention import LAYOUTS as LAYOUTS
from replicator._src.sharded.attention import attention as attention
from replicator._src.sharded.attention import constrain_tokens as constrain_tokens
from replicator._src.sharded.attention import context_size as context_size
from replicator._src.sharded.attention import reference as reference
from replicator._src.sharded.attention import zigzag_order as zigzag_order
