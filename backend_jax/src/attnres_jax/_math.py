"""Math both implementations share, in jnp (neither is an implementation): the query side of a
call (`Query`, `query_side`), the column layout of the per-token statistics, the overflow-safe
inverse RMS (C10.6) and the merge weights (C10.7).

A leaf module: it calls nothing else of the package.  `dispatch` (the custom VJPs), `kernels.xla` (the
XLA formulas) and `kernels.pallas` (host code and kernel bodies) import from here, so neither
implementation imports the other.

Notation (spec 2.1): qg = query * norm_weight; per-token statistics are `[..., K]` (K = S * H
columns, column k = s * H + h) for S query sets and H heads; pseudo-queries also become one
block-diagonal matrix `Qm [D, K]` (column k holds qg[s] on head h's channels).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from ._args import Options

#: Precision of the products that stay matmuls (a TPU/GPU would otherwise run them in bf16/tf32).
HIGHEST = jax.lax.Precision.HIGHEST


# Indexing through lax: `a[i]`, `a[None]` and `a[..., None]` go through jnp's general indexing,
# slow Python while tracing; these emit the same HLO for a fraction of that (a probe network
# traces thousands of them).


def at(a, i: int):
    """`a[i]` (leading axis)."""
    return jax.lax.index_in_dim(a, i, 0, keepdims=False)


def lead(a):
    """`a[None]`."""
    return jax.lax.expand_dims(a, (0,))


def trail(a):
    """`a[..., None]`."""
    return jax.lax.expand_dims(a, (a.ndim,))


# -- column layout ---------------------------------------------------------------------------------
#
# S = 1 and H = 1 (the common case) avoid every reshape, transpose and size-1 axis around a
# reduction: XLA:CPU lowers a row sum of `[1, T, D]` or `[T, 1, D]` far slower than the same sum
# of `[T, D]`.


def block_diag(qg, num_heads: int):
    """qg `[S, D]` -> `Qm [D, S*H]` with Qm[h*Dh + j, s*H + h] = qg[s, h*Dh + j], zero elsewhere."""
    s, d = qg.shape
    if num_heads == 1:  # the same matrix, without the eye product's ops
        return qg.T
    m = qg.reshape(s, num_heads, d // num_heads)[..., None] * jnp.eye(num_heads, dtype=qg.dtype)[:, None]
    return m.transpose(1, 2, 0, 3).reshape(d, s * num_heads)  # [H, Dh, S, H'] -> [D, K]


def split_columns(v, s: int):
    """`[..., K]` -> `[S, ..., H]`."""
    if s == 1:
        return lead(v)
    return jnp.moveaxis(v.reshape(v.shape[:-1] + (s, v.shape[-1] // s)), -2, 0)


def join_columns(v):
    """`[S, ..., H]` -> `[..., K]`."""
    if v.shape[0] == 1:
        return at(v, 0)
    v = jnp.moveaxis(v, 0, -2)
    return v.reshape(v.shape[:-2] + (v.shape[-2] * v.shape[-1],))  # no -1: T = 0 is legal


def tile_sets(r, sets: int):
    """r `[N, ..., H]` -> `[N, ..., K]` (the same head statistic for every query set)."""
    if sets == 1:
        return r
    return jnp.tile(r, (1,) * (r.ndim - 1) + (sets,))


# -- the query side --------------------------------------------------------------------------------


class Query(NamedTuple):
    """The query side in compute dtype: pseudo-queries (`qm [D, K]`) or a per-token query."""

    q: jax.Array  # [S, D] (pseudo) or [..., D] (per token)
    g: jax.Array  # [S or 1, D] (pseudo) or [1.., D] (per token); ones when norm_weight is None
    qg: jax.Array  # query * norm_weight: [S, D] or [..., D] (q itself when norm_weight is None)
    qm: Optional[jax.Array]  # [D, K] block-diagonal (pseudo-queries only)
    num_sets: int  # S


def query_side(query, norm_weight, opts: Options, dim: int, ct) -> Query:
    """query `[D]`, `[S, D]` (multi) or `[..., D]`; norm_weight `[D]`, `[S, D]` or None."""
    per_token = not opts.multi and query.ndim > 1
    q = query.astype(ct) if per_token else query.astype(ct).reshape(-1, dim)
    rows = query.shape[0] if opts.multi else 1
    gshape = (1,) * (q.ndim - 1) + (dim,) if per_token else (rows, dim)
    g = jnp.ones(gshape, ct) if norm_weight is None else norm_weight.astype(ct).reshape(gshape)
    qg = q if norm_weight is None else q * g  # computed once: every source's logits use it
    qm = None if per_token else block_diag(qg, opts.num_heads)
    return Query(q, g, qg, qm, rows)


# -- numerics both implementations use -------------------------------------------------------------


def inv_rms(x, reduce, count: int, eps: float, ms=None):
    """r = 1 / sqrt(reduce(x^2) / count + eps) in x's dtype (spec 2.1), overflow-safe (C10.6).

    `reduce` sums the squares over each key's channels (`count` of them).  Where that sum
    overflows (fp32: |x| >= ~1.8e19), r comes from the squares of x * 2^-k instead (k = 80 for
    fp32, 528 for float64: finite for every finite x; eps is far below the mean there).  The key
    norm is scale-invariant, so huge sources keep their weights instead of going uniform.
    ms: `reduce(x * x) / count` when the caller has it already."""
    k = jnp.finfo(x.dtype).maxexp // 2 + 16
    lo = jnp.asarray(2.0 ** -k, x.dtype)
    if ms is None:
        ms = reduce(x * x) / count
    y = x * lo
    big = jnp.isinf(ms)
    ms_lo = jnp.where(big, reduce(y * y) / count, 1.0)
    return jnp.where(big, lo * jax.lax.rsqrt(ms_lo), jax.lax.rsqrt(ms + eps))


def merge_weights(l1, z2):
    """w1 = e^{lse1} / (e^{lse1} + e^{z2}) = sigmoid(lse1 - z2) and w2 = sigmoid(z2 - lse1), each
    from its own logistic (spec 3.2, C10.7): w2 = 1 - w1 loses every bit of a small w2 (lse1 - z2
    ~ 10 leaves 1 - w1 ~ 4.5e-5 with fp32 rounding error ~6e-8 absolute, 1e-3 relative)."""
    return 1.0 / (1.0 + jnp.exp(z2 - l1)), 1.0 / (1.0 + jnp.exp(l1 - z2))
