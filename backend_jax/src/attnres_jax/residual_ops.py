"""JAX's `ResidualOps` (`JaxOps`): the primitives the shared residual schedule
(`attnres_core.schedule`) runs on, and the gainless `rmsnorm` / full-precision `matmul` they use.
`stack_apply`, `scan_apply` (and so the NNX modules), the Full scan's fused backward
(`_scan_full`) and the shard_map prefill (`distributed`) all drive the schedule with this object;
nothing in JAX re-derives the schedule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from attnres_core.schedule import ResidualOps, split_result

from ._math import HIGHEST
from .ops import compute_dtype, depth_attention, depth_attention_multi, merge_partial


def _rmsnorm_compute(x, eps: float):
    """Gainless RMSNorm over the last axis in the compute dtype (C10: float32, float64 for
    float64 x), not rounded back: `[..., D]`."""
    xc = x.astype(compute_dtype(x.dtype))
    return xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)


def rmsnorm(x, eps: float):
    """Gainless RMSNorm over the last axis, statistics in the compute dtype (C10: float32, float64
    for float64 x).  x `[..., D]` -> `[..., D]` in x's dtype."""
    return _rmsnorm_compute(x, eps).astype(x.dtype)


def matmul(x, w):
    """Right-multiplication `x [..., D_in] @ w [D_in, D_out]` at full precision."""
    return jnp.matmul(x, w.astype(x.dtype), precision=HIGHEST)


class JaxOps(ResidualOps):
    """JAX's `ResidualOps` for the shared schedule (`attnres_core.schedule`).

    params: name -> array of `ResidualConfig.param_shapes(L, D)` (a missing or None
    "norm_weights" means a gainless key norm).  The stream keeps the embedding's dtype, the
    scheme's own parameters are cast to it, the depth-attention query and gain pass as they are.
    """

    def rmsnorm(self, x, eps):
        return rmsnorm(x, eps)

    def matmul(self, x, w):
        return matmul(x, w)

    def sigmoid(self, x):
        return jax.nn.sigmoid(x)

    def tanh(self, x):
        return jnp.tanh(x)

    def to_compute(self, x):
        return x.astype(compute_dtype(x.dtype))

    def rmsnorm_gain(self, x, weight, eps):
        """M15 composed: `rmsnorm(x) * weight` in the compute dtype, rounded once (C10)."""
        normed = _rmsnorm_compute(x, eps)
        return (normed * weight.astype(normed.dtype)).astype(x.dtype)

    def depth_attention(self, sources, stats, query, norm_weight, config, *, return_weights,
                        out_norm_weight=None):
        result = depth_attention(list(sources), query, norm_weight, eps=config.eps,
                                 scale=config.scale, num_heads=config.num_heads,
                                 activation=config.activation, key_norm=config.key_norm,
                                 return_weights=return_weights, out_norm_weight=out_norm_weight)
        return split_result(result, out_norm_weight, return_weights)

    def depth_attention_multi(self, sources, stats, queries, norm_weights, config):
        return depth_attention_multi(list(sources), queries, norm_weights, eps=config.eps,
                                     scale=config.scale)

    def where(self, cond, a, b):
        return jnp.where(cond, a, b)

    def rows_init(self, first, rows):
        return jnp.zeros((rows,) + first.shape, first.dtype).at[0].set(first)

    def write_row(self, buffer, index, value):
        return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), index, 0)

    def take(self, x, i):
        return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)

    def depth_attention_prefix(self, buffer, count, query, norm_weight, config, *, return_weights,
                               out_norm_weight=None):
        result = depth_attention(buffer, query, norm_weight, eps=config.eps, scale=config.scale,
                                 num_heads=config.num_heads, activation=config.activation,
                                 key_norm=config.key_norm, return_weights=return_weights,
                                 out_norm_weight=out_norm_weight, num_valid=count)
        return split_result(result, out_norm_weight, return_weights)

    def merge_partial(self, out1, lse1, partial, query, norm_weight, config):
        return merge_partial(out1, lse1, partial, query, norm_weight, eps=config.eps,
                             scale=config.scale)
