"""AttnRes under `jax.shard_map` (docs/distributed.md): call these inside a shard_map body.

Hidden-dimension sharding (`depth_attention_tp`): the last dimension of the sources, query and
gain is split evenly over mesh axis `axis_name`.  Per token, head h and source i the local
partial  s_i = <q g, x_i>  and  ss_i = sum x_i^2  are `psum`-ed (2 N H scalars; N H without key
norm); z, p and lse are then identical on every device and  out[local] = sum_i p_i x_i[local]
stays local.  JAX differentiates the psum: the backward reduces the cotangent of p, again N H
scalars per token (the transpose of the implicit broadcast of p to the device-varying x).

Sequence sharding (`sequence_sharded_prefill`): block representations sharded along the
sequence over `axis_name`; phase 1 local, phase 2 merged locally between the reduce-scatter
(`psum_scatter`) and the all-gather that replace a tensor-parallel sublayer's all-reduce
(paper section 4.2).

Numerics follow C10: compute in float32 (float64 for float64 sources), one final cast.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from attnres_core import validation
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ResidualStream

from . import ops
from .residual_ops import JaxOps


def _head_map(axis_name: str, local_dim: int, dim: int, num_heads: int, dtype):
    """`[D_r, H]` 0/1: local channel c belongs to head (offset + c) // (D / H)."""
    offset = jax.lax.axis_index(axis_name) * local_dim
    heads = (offset + jnp.arange(local_dim)) // (dim // num_heads)
    return jax.nn.one_hot(heads, num_heads, dtype=dtype)


def depth_attention_tp(sources, query, norm_weight=None, *, axis_name: str, eps: float = 1e-6,
                       scale: float = 1.0, num_heads: int = 1, activation: str = "softmax",
                       key_norm: bool = True, return_lse: bool = False, out_norm_weight=None,
                       out_norm_eps=None):
    """Depth attention on hidden-dimension shards (inside `shard_map` over `axis_name`).

    Args:
      sources: N local shards `[..., D/P]` (list) or one stacked `[N, ..., D/P]` array.
      query: `[D/P]` or per-token `[..., D/P]`; norm_weight: `[D/P]` or None.
      eps, scale, num_heads, activation, key_norm, return_lse: as `attnres_jax.depth_attention`
        on the full arrays (D = P * D/P must divide by num_heads).
      out_norm_weight: this device's slice `[D/P]` of the fused output norm's gain (C17), or
        None; out_norm_eps: its eps (None: eps).  The norm is over all D channels: one more psum
        of one scalar per token (its sum of squares), from out before its rounding.
    Returns out `[..., D/P]` (sources' dtype), or `(out, out_normed?, lse?)`: out_normed
      `[..., D/P]` (sources' dtype) with out_norm_weight, the replicated lse `[...]` (`[..., H]`
      if H > 1; compute dtype) with return_lse.
    """
    xs = list(sources) if isinstance(sources, (list, tuple)) else [sources[i] for i in range(sources.shape[0])]
    world = jax.lax.axis_size(axis_name)
    local_dim = xs[0].shape[-1]
    dim = local_dim * world

    def full(shape):
        return tuple(shape[:-1]) + (dim,)

    geo = validation.check_depth_attention(
        [full(x.shape) for x in xs], [ops.dtype_name(x) for x in xs], full(query.shape),
        ops.dtype_name(query), None if norm_weight is None else full(norm_weight.shape),
        None if norm_weight is None else ops.dtype_name(norm_weight),
        stacked=not isinstance(sources, (list, tuple)), eps=eps, scale=scale, num_heads=num_heads,
        activation=activation, key_norm=key_norm, return_lse=return_lse,
        out_norm_weight_shape=None if out_norm_weight is None else full(out_norm_weight.shape),
        out_norm_weight_dtype=None if out_norm_weight is None else ops.dtype_name(out_norm_weight),
        out_norm_eps=out_norm_eps)
    h = geo.num_heads
    cd = ops.compute_dtype(xs[0].dtype)  # C10
    m = _head_map(axis_name, local_dim, dim, h, cd)  # [D_r, H]
    x = jnp.stack([s.astype(cd) for s in xs])  # [N, ..., D_r]
    qg = query.astype(cd) if norm_weight is None else query.astype(cd) * norm_weight.astype(cd)
    hi = jax.lax.Precision.HIGHEST
    partial = [jnp.matmul(x * qg, m, precision=hi)]  # s_i per head [N, ..., H]
    if key_norm:
        partial.append(jnp.matmul(x * x, m, precision=hi))  # ss_i per head
    stats = jax.lax.psum(jnp.stack(partial), axis_name)
    s = stats[0]
    r = jax.lax.rsqrt(stats[1] / (dim // h) + eps) if key_norm else jnp.ones_like(s)
    z = scale * r * s
    p = jax.nn.softmax(z, axis=0) if activation == "softmax" else jax.nn.sigmoid(z)
    out_c = jnp.sum(jnp.matmul(p, m.T, precision=hi) * x, axis=0)  # [..., D_r], compute dtype
    results = [out_c.astype(xs[0].dtype)]
    if out_norm_weight is not None:  # C17 over all D: the per-token sum of squares is psum-ed
        ms = jax.lax.psum(jnp.sum(out_c * out_c, axis=-1, keepdims=True), axis_name) / dim
        normed = out_c * jax.lax.rsqrt(ms + geo.out_norm_eps) * out_norm_weight.astype(cd)
        results.append(normed.astype(xs[0].dtype))
    if return_lse:
        lse = jax.nn.logsumexp(z, axis=0)
        results.append(lse[..., 0] if h == 1 else lse)
    return results[0] if len(results) == 1 else tuple(results)


def sequence_sharded_prefill(embedding, sublayers: Sequence[Callable], queries, norm_weights, *,
                             block_size: int, axis_name: str, seq_dim: int = 0, eps: float = 1e-6,
                             scale: float = 1.0):
    """Block AttnRes (two-phase) with sequence-sharded block representations (inside shard_map).

    Args:
      embedding: local tokens of b_0, `[.., T/P, .., D]` (sequence at `seq_dim`).
      sublayers: L callables `h [.., T, .., D] -> y_r [.., T, .., D]`, this device's
        tensor-parallel partial of f_l(h) (the sum over `axis_name` is f_l(h)).
      queries, norm_weights: `[L + 1, D]` (norm_weights may be None); row L aggregates the output.
    Returns (out `[.., T/P, .., D]`, the local shards of the blocks `[b_0..b_N]`).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    num_layers = len(sublayers)
    if queries.ndim != 2 or queries.shape[0] != num_layers + 1:
        raise ValueError(f"queries: expected shape [L + 1, D] = [{num_layers + 1}, D] for "
                         f"{num_layers} sublayers, got shape {tuple(queries.shape)}")

    config = ResidualConfig(kind="block", block_size=block_size, eps=eps, scale=scale)
    ops_ = JaxOps({"queries": queries, "norm_weights": norm_weights})
    # Phase 1 on the local shards (no collective), phase 2 on the local tokens; each sublayer
    # sees the gathered sequence, its partial output is reduce-scattered.
    stream = ResidualStream(config, ops_, embedding, num_layers=num_layers, schedule="two_phase")
    for f in sublayers:
        h_full = jax.lax.all_gather(stream.input(), axis_name, axis=seq_dim, tiled=True)
        stream.push(jax.lax.psum_scatter(f(h_full), axis_name, scatter_dimension=seq_dim,
                                         tiled=True))
    return stream.output(), stream.blocks
