"""Mixed precision: a policy of three dtypes, for parameters, computation and outputs.

The usual policy keeps fp32 *master* parameters, which the optimizer updates, computes in bf16
(or fp16, with loss scaling from ``wrap_optimizer(loss_scale="dynamic")``), and returns fp32
outputs such as the loss. Gradients flow back through the casts, so they arrive in the
parameters' dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from replicator._src.core.typing import PyTree


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters, computation and outputs use.

    Only floating-point leaves are cast; integer leaves (token ids, step counts) pass through.

    Attributes:
      param_dtype: the dtype parameters are stored in.
      compute_dtype: the dtype ``cast_to_compute`` gives, for the step's arithmetic.
      output_dtype: the dtype ``cast_to_output`` gives, for losses and metrics.

    Raises:
      ValueError: for a dtype that is not floating-point.

    >>> import jax.numpy as jnp, replicator as rp
    >>> policy = rp.Policy(compute_dtype=jnp.bfloat16)
    >>> params = {"w": jnp.ones((2, 2)), "step": jnp.int32(3)}
    >>> cast = policy.cast_to_compute(params)
    >>> cast["w"].dtype, cast["step"].dtype
    (dtype(bfloat16), dtype('int32'))
    >>> policy.cast_to_output(cast["w"].sum()).dtype
    dtype('float32')
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            dtype = jnp.dtype(getattr(self, name))
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"Policy: {name} must be a floating dtype; got {dtype}.")
            object.__setattr__(self, name, dtype)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Floating leaves in ``param_dtype``: for initialising master parameters."""
        return _cast(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Floating leaves in ``compute_dtype``: parameters and inputs on the way in."""
        return _cast(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Floating leaves in ``output_dtype``: the loss and other outputs on the way out."""
        return _cast(tree, self.output_dtype)

    def apply(self, fn):
        """``fn`` with its arguments cast to ``compute_dtype`` and its result to ``output_dtype``.

        ``jax.grad(policy.apply(loss_fn))(params, batch)`` differentiates a bf16 computation
        and returns gradients in the parameters' own dtype.
        """

        def wrapped(*args, **kwargs):
            args, kwargs = self.cast_to_compute((args, kwargs))
            return self.cast_to_output(fn(*args, **kwargs))

        return wrapped


def _cast(tree: PyTree, dtype) -> PyTree:
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(cast, tree)
