"""The spec's operators in JAX (spec sections 2-3): XLA path with a memory-lean custom VJP.

Pure functions: they work under `jax.jit`, `jax.grad`, `jax.vjp`, `jax.vmap` and
`jax.checkpoint`, and validate shapes and dtypes at trace time with the shared checks of
`attnres_numpy.validation`.

Notation (spec 2.1), per token and head:
    r_i = 1 / sqrt(mean(x_i ** 2) + eps)    (1 when key_norm=False)
    qg  = query * norm_weight
    s_i = <qg, x_i>,  z_i = scale * r_i * s_i,  p = softmax_i(z) or sigmoid(z_i)
    out = sum_i p_i x_i,  lse = logsumexp_i z_i

One core (`_attend`) serves `depth_attention` (S = 1 query set, H heads) and
`depth_attention_multi` (S pseudo-queries, one head).  Sources are never stacked: a list stays a
list of N arrays, a stacked `[N, ..., D]` array is read slice by slice; tokens are flattened to
`[T, D]` (a free reshape).

Numerics (C10): every intermediate in the compute dtype (float32, float64 for float64 sources),
one final cast to the sources' dtype.  The contractions with pseudo-queries are matmuls at
`precision=HIGHEST` (a TPU/GPU would otherwise run them in bf16/tf32); per-token contractions
are elementwise products and sums in the compute dtype.  float64 needs `jax_enable_x64` (e.g.
`with jax.enable_x64(True):`); inputs are converted with `jnp.asarray`, so JAX's usual dtype
canonicalization applies.

Memory (custom VJP): the residuals are the inputs themselves plus per-token statistics
p, s `[N, T, K]` and r `[N, T, H]` (K = S * H columns) in the compute dtype; the backward
recomputes `<d_out, out>` as `sum_i p_i <d_out, x_i>` and never needs `out` or any
`[N, T, D]` temporary.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from attnres_numpy import validation

from .pallas import dispatch, kernels

Sources = Union[jax.Array, Sequence[jax.Array]]
HIGHEST = jax.lax.Precision.HIGHEST


class _Options(NamedTuple):
    """Static options of one call (hashable: nondiff argument of the custom VJP)."""

    eps: float
    scale: float
    num_heads: int
    activation: str
    key_norm: bool
    multi: bool  # query is a set of S pseudo-queries [S, D] (depth_attention_multi)


# -- input handling --------------------------------------------------------------------------


def dtype_name(x) -> str:
    """Canonical dtype name of an array ("float32", "bfloat16", ...)."""
    return jnp.dtype(x.dtype).name


def _as_array(x):
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _optional(x):
    return None if x is None else _as_array(x)


def canonical_sources(sources):
    """A list/tuple stays a list/tuple of arrays; any array is a stacked `[N, ..., D]` array.

    Returns (sources, shapes, dtype names, stacked) for `validation.check_sources`.
    """
    if isinstance(sources, (list, tuple)):
        arrays = type(sources)(_as_array(s) for s in sources)
        return arrays, [a.shape for a in arrays], [dtype_name(a) for a in arrays], False
    if not hasattr(sources, "shape") or not hasattr(sources, "dtype"):
        raise TypeError(
            "sources: expected a sequence of arrays [..., D] or one stacked array [N, ..., D], "
            f"got {type(sources).__name__}"
        )
    stack = _as_array(sources)
    n = stack.shape[0] if stack.ndim else 0
    return stack, [stack.shape[1:]] * n, [dtype_name(stack)] * n, True


def _meta(x):
    return (None, None) if x is None else (x.shape, dtype_name(x))


def _unstack(sources) -> list:
    """The N sources as a list of `[..., D]` arrays (slices of a stacked array, never a copy)."""
    if isinstance(sources, (list, tuple)):
        return list(sources)
    return [sources[i] for i in range(sources.shape[0])]


def _restack(grads: list, like):
    """Source gradients in the form the sources were given (list, tuple or stacked)."""
    if isinstance(like, (list, tuple)):
        return type(like)(grads)
    return jnp.stack(grads)


def _compute_dtype(x):
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _sum_to(x, shape):
    """Sum the broadcast axes of x `[...]` down to `shape` (same rank)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=axes, keepdims=True)


# -- the core: N sources [..., D], S query sets, H heads, K = S * H logit columns ----------------
#
# Token axes `...` are kept as they are (so shardings over batch/sequence propagate unchanged).
# Per-token statistics are `[..., K]` with column k = s * H + h.  Pseudo-queries become one
# block-diagonal matrix `Qm [D, K]` (column k holds qg[s] on head h's channels), so the logits of
# every query set and head are one matmul `x [..., D] @ Qm` at HIGHEST precision, reading the
# source once.


def _block_diag(qg, num_heads: int):
    """qg `[S, D]` -> `Qm [D, S*H]` with Qm[h*Dh + j, s*H + h] = qg[s, h*Dh + j], zero elsewhere."""
    s, d = qg.shape
    m = qg.reshape(s, num_heads, d // num_heads)[..., None] * jnp.eye(num_heads, dtype=qg.dtype)[:, None]
    return m.transpose(1, 2, 0, 3).reshape(d, s * num_heads)  # [H, Dh, S, H'] -> [D, K]


def _block_diag_rows(m, s: int, num_heads: int):
    """Inverse of `_block_diag` on a `[K, D]` matrix: the head-h block of row (s, h) -> `[S, D]`."""
    d = m.shape[1]
    m = m.reshape(s, num_heads, num_heads, d // num_heads)  # [S, H', H, Dh]
    return jnp.einsum("shhj->shj", m).reshape(s, d)


# S = 1 and H = 1 (the common case) avoid every reshape, transpose and size-1 axis around a
# reduction: XLA:CPU lowers a row sum of `[1, T, D]` or `[T, 1, D]` about 40x slower than the
# same sum of `[T, D]`.


def _split_columns(v, s: int):
    """`[..., K]` -> `[S, ..., H]`."""
    if s == 1:
        return v[None]
    return jnp.moveaxis(v.reshape(v.shape[:-1] + (s, v.shape[-1] // s)), -2, 0)


def _join_columns(v):
    """`[S, ..., H]` -> `[..., K]`."""
    if v.shape[0] == 1:
        return v[0]
    v = jnp.moveaxis(v, 0, -2)
    return v.reshape(v.shape[:-2] + (-1,))


def _expand(v, s: int, num_heads: int, dim: int):
    """Per-column values `[..., K]` -> each head's value over its Dh channels, broadcastable to
    `[S, ..., D]` (`[S, ..., 1]` for one head)."""
    v = _split_columns(v, s)
    if num_heads == 1:
        return v
    v = v[..., None]
    return jnp.broadcast_to(v, v.shape[:-1] + (dim // num_heads,)).reshape(v.shape[:-2] + (dim,))


def _head_sums(w, num_heads: int):
    """`[..., D]` -> sums over each head's channels `[..., H]`."""
    if num_heads == 1:
        return jnp.sum(w, axis=-1, keepdims=True)
    return jnp.sum(w.reshape(w.shape[:-1] + (num_heads, -1)), axis=-1)


def _columns(w, num_heads: int):
    """`[S, ..., D]` -> per-column sums over each head's channels `[..., K]`."""
    if w.shape[0] == 1:
        return _head_sums(w[0], num_heads)
    return _join_columns(_head_sums(w, num_heads))


def _sum_sets(w):
    """Sum over the leading query-set axis S (a free squeeze when S = 1)."""
    return w[0] if w.shape[0] == 1 else jnp.sum(w, axis=0)


def _times_columns(v, qm):
    """`v [..., K] @ Qm^T [K, D]` (a broadcast product when K = 1)."""
    return v * qm[:, 0] if qm.shape[1] == 1 else jnp.matmul(v, qm.T, precision=HIGHEST)


def _head_rms(x, opts: _Options):
    """r `[..., H]`: 1 / sqrt(mean over each head's channels of x^2 + eps) (ones without key norm)."""
    if not opts.key_norm:
        return jnp.ones(x.shape[:-1] + (opts.num_heads,), x.dtype)
    return jax.lax.rsqrt(_head_sums(x * x, opts.num_heads) / (x.shape[-1] // opts.num_heads) + opts.eps)


class _Query(NamedTuple):
    """The query side in compute dtype: pseudo-queries (`qm [D, K]`) or a per-token query."""

    q: jax.Array  # [S, D] (pseudo) or [..., D] (per token)
    g: jax.Array  # [S or 1, D] (pseudo) or [1.., D] (per token); ones when norm_weight is None
    qm: Optional[jax.Array]  # [D, K] block-diagonal (pseudo-queries only)
    num_sets: int  # S


def _query(query, norm_weight, opts: _Options, dim: int, ct) -> _Query:
    per_token = not opts.multi and query.ndim > 1
    q = query.astype(ct) if per_token else query.astype(ct).reshape(-1, dim)
    rows = query.shape[0] if opts.multi else 1
    gshape = (1,) * (q.ndim - 1) + (dim,) if per_token else (rows, dim)
    g = jnp.ones(gshape, ct) if norm_weight is None else norm_weight.astype(ct).reshape(gshape)
    qm = None if per_token else _block_diag(q * g, opts.num_heads)
    return _Query(q, g, qm, rows)


def _forward(xs: list, qs: _Query, opts: _Options, ct):
    """Forward over N sources `[..., D]`.  Returns out `[S, ..., D]` (compute dtype), lse
    `[..., K]` (None for sigmoid), and the residual statistics p, s `[N, ..., K]`, r `[N, ..., H]`."""
    h, sets, dim = opts.num_heads, qs.num_sets, xs[0].shape[-1]
    rs, ss = [], []
    for x in xs:
        x = x.astype(ct)
        rs.append(_head_rms(x, opts))
        if qs.qm is not None:
            ss.append(jnp.matmul(x, qs.qm, precision=HIGHEST))
        else:
            ss.append(_columns((x * (qs.q * qs.g))[None], h))
    r, s = jnp.stack(rs), jnp.stack(ss)
    z = opts.scale * _tile_sets(r, sets) * s
    if opts.activation == "softmax":
        m = jnp.max(z, axis=0)
        e = jnp.exp(z - m[None])
        total = jnp.sum(e, axis=0)
        p = e / total[None]
        lse = m + jnp.log(total)
    else:
        p = jax.nn.sigmoid(z)
        lse = None
    out = sum(_expand(p[i], sets, h, dim) * x.astype(ct)[None] for i, x in enumerate(xs))
    return out, lse, p, r, s


def _tile_sets(r, sets: int):
    """r `[N, ..., H]` -> `[N, ..., K]` (the same head statistic for every query set)."""
    return jnp.tile(r, (1,) * (r.ndim - 1) + (sets,))


def _kernel_forward(xs: list, qs: _Query, opts: _Options, ct, plan: dispatch.Plan):
    """`_forward` on the Pallas kernels (one head; tokens flattened to `[T, D]` for the kernels):
    the forward kernel, or the phase-1 kernel for S query sets."""
    tokens, dim, n = xs[0].shape[:-1], xs[0].shape[-1], len(xs)
    flat = [x.reshape(-1, dim) for x in xs]
    kw = dict(eps=opts.eps, scale=opts.scale, tb=plan.tile, ct=ct, interpret=plan.interpret, poison=plan.poison)
    if opts.multi:
        sets = qs.num_sets
        outs, lses, rs, ss = kernels.phase1(flat, qs.q * qs.g, **kw)
        out = jnp.stack(outs).reshape((sets,) + tokens + (dim,))
        lse = jnp.concatenate(lses, axis=1).reshape(tokens + (sets,))
        s = jnp.concatenate(ss, axis=1).reshape((-1, n, sets)).transpose(1, 0, 2).reshape((n,) + tokens + (sets,))
    else:
        per_token = qs.qm is None
        qg = (qs.q * qs.g).reshape(-1, dim)
        out, lse, rs, ss = kernels.forward(flat, qg, per_token=per_token, softmax=opts.activation == "softmax",
                                           key_norm=opts.key_norm, **kw)
        out = out.reshape((1,) + tokens + (dim,))
        lse = None if lse is None else lse.reshape(tokens + (1,))
        s = jnp.stack(ss).reshape((n,) + tokens + (1,))
    r = jnp.stack(rs).reshape((n,) + tokens + (1,))
    z = opts.scale * _tile_sets(r, qs.num_sets) * s
    p = jax.nn.sigmoid(z) if lse is None else jnp.exp(z - lse[None])
    return out, lse, p, r, s


def _plan(opts: _Options, xs: list, qs: _Query):
    return dispatch.plan(num_heads=opts.num_heads, dim=xs[0].shape[-1], dtype=xs[0].dtype,
                         num_sources=len(xs), num_sets=qs.num_sets)


def _varying_axes(x) -> frozenset:
    """Mesh axes over which x varies inside `shard_map` (empty outside it)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older JAX


def _like_primals(cotangents, primals):
    """Give every cotangent its primal's type under `shard_map`: a gradient built from
    token-sharded data varies over mesh axes that a replicated primal (a pseudo-query, a gain)
    does not, and the gradient of a replicated input is the sum over those axes (what JAX's own
    autodiff inserts for replicated inputs).  A no-op outside `shard_map`."""

    def one(ct, primal):
        if ct is None:
            return None
        extra = _varying_axes(ct) - _varying_axes(primal)
        return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct

    return jax.tree_util.tree_map(one, cotangents, primals, is_leaf=lambda x: x is None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(opts: _Options, sources, query, norm_weight):
    """out `[S, ..., D]` (sources' dtype), lse `[S, ..., H]` or None, weights `[N, S, ..., H]`."""
    return _attend_fwd(opts, sources, query, norm_weight)[0]


def _attend_fwd(opts: _Options, sources, query, norm_weight):
    xs = _unstack(sources)
    ct = _compute_dtype(xs[0])
    qs = _query(query, norm_weight, opts, xs[0].shape[-1], ct)
    plan = _plan(opts, xs, qs)
    if plan is None:
        out, lse, p, r, s = _forward(xs, qs, opts, ct)
    else:
        out, lse, p, r, s = _kernel_forward(xs, qs, opts, ct, plan)
    sets = qs.num_sets
    out = out.astype(xs[0].dtype)
    lse = None if lse is None else _split_columns(lse, sets)
    weights = jnp.moveaxis(_split_columns(p, sets), 0, 1)  # [N, S, ..., H]
    return (out, lse, weights), (sources, query, norm_weight, p, r, s)


def _attend_bwd(opts: _Options, res, cotangents):
    sources, query, norm_weight, p, r, s = res
    d_out, d_lse, _ = cotangents  # depth weights are not differentiable (C11)
    xs = _unstack(sources)
    ct = p.dtype
    dim = xs[0].shape[-1]
    qs = _query(query, norm_weight, opts, dim, ct)
    d_lse = None if d_lse is None else _join_columns(d_lse.astype(ct))  # [..., K]
    plan = None if opts.multi else _plan(opts, xs, qs)
    if plan is None:
        d_sources, dqg = _xla_backward(xs, qs, opts, ct, d_out.astype(ct), d_lse, p, r, s)
    else:
        d_sources, dqg = _kernel_backward(xs, qs, opts, ct, plan, d_out[0], d_lse, p, r, s)
    d_sources = [dx.astype(x.dtype) for dx, x in zip(d_sources, xs)]
    d_query = _sum_to(dqg * qs.g, qs.q.shape).reshape(query.shape).astype(query.dtype)
    d_norm = None
    if norm_weight is not None:
        d_norm = _sum_to(dqg * qs.q, qs.g.shape).reshape(norm_weight.shape).astype(norm_weight.dtype)
    return _like_primals((_restack(d_sources, sources), d_query, d_norm),
                         (sources, query, norm_weight))


def _xla_backward(xs: list, qs: _Query, opts: _Options, ct, g, d_lse, p, r, s):
    """Backward on XLA.  g `[S, ..., D]`, d_lse `[..., K]` or None; p, s `[N, ..., K]`,
    r `[N, ..., H]`.  Returns the source gradients N x `[..., D]` (compute dtype) and dqg
    (`[S, D]` for pseudo-queries, `[..., D]` per token)."""
    sets, h, dim = qs.num_sets, opts.num_heads, xs[0].shape[-1]
    head_dim = dim // h
    xs = [x.astype(ct) for x in xs]
    dp = jnp.stack([_columns(g * x[None], h) for x in xs])  # [N, ..., K]
    if opts.activation == "softmax":
        dz = p * (dp - jnp.sum(p * dp, axis=0)[None])
        if d_lse is not None:
            dz = dz + p * d_lse[None]
    else:
        dz = dp * p * (1.0 - p)
    c = opts.scale * dz  # dL/d(r_i s_i)
    rk = _tile_sets(r, sets)
    tok = tuple(range(xs[0].ndim - 1))
    d_sources, dqg = [], None
    for i, x in enumerate(xs):
        # d z_i / d x_i = scale * (r_i qg - s_i r_i^3 x_i / Dh)  (key_norm)  or  scale * qg
        cr = c[i] * rk[i]  # [..., K]
        dx = _sum_sets(_expand(p[i], sets, h, dim) * g)
        if qs.qm is not None:
            dx = dx + _times_columns(cr, qs.qm)
            term = jnp.tensordot(cr, x, axes=(tok, tok), precision=HIGHEST)  # [K, D]
        else:
            dx = dx + _expand(cr, 1, h, dim)[0] * (qs.q * qs.g)
            term = _expand(cr, 1, h, dim)[0] * x  # [..., D]
        if opts.key_norm:  # c s r^3 as (c r)(s r) r: bounded factors, no overflow for huge x
            crsr = _sum_sets(_split_columns(cr * (s[i] * rk[i]), sets))  # [..., H]
            dx = dx - _expand(crsr * r[i] / head_dim, 1, h, dim)[0] * x
        d_sources.append(dx)
        dqg = term if dqg is None else dqg + term
    return d_sources, (dqg if qs.qm is None else _block_diag_rows(dqg, sets, h))


def _kernel_backward(xs: list, qs: _Query, opts: _Options, ct, plan: dispatch.Plan, g, d_lse, p, r, s):
    """`_xla_backward` on the Pallas backward kernel (one head, S = 1); g `[..., D]`."""
    dim = xs[0].shape[-1]
    cols = lambda a: list(a.reshape(a.shape[0], -1, 1))  # noqa: E731  [N, ..., 1] -> N x [T, 1]
    per_token = qs.qm is None
    dxs, dqg = kernels.backward(
        [x.reshape(-1, dim) for x in xs], (qs.q * qs.g).reshape(-1, dim), g.reshape(-1, dim),
        None if d_lse is None else d_lse.reshape(-1, 1), cols(p), cols(r), cols(s), per_token=per_token,
        scale=opts.scale, softmax=opts.activation == "softmax", key_norm=opts.key_norm, tb=plan.tile, ct=ct,
        interpret=plan.interpret, poison=plan.poison)
    if per_token:
        return [dx.reshape(x.shape) for dx, x in zip(dxs, xs)], dqg.reshape(qs.q.shape)
    # The per-tile partial sums `[tiles, D]`, reduced in tile order.
    return [dx.reshape(x.shape) for dx, x in zip(dxs, xs)], jnp.sum(dqg, axis=0, keepdims=True)


_attend.defvjp(_attend_fwd, _attend_bwd)


# -- public ops ------------------------------------------------------------------------------


def depth_attention(
    sources: Sources,
    query,
    norm_weight=None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    num_heads: int = 1,
    activation: str = "softmax",
    key_norm: bool = True,
    return_lse: bool = False,
    return_weights: bool = False,
):
    """Depth attention over N sources (spec section 2, C1-C12).

    Args:
      sources: a list/tuple of N >= 1 arrays `[..., D]` or one stacked array `[N, ..., D]`.
      query: pseudo-query `[D]` or per-token query `[..., D]` (any floating dtype).
      norm_weight: key RMSNorm gain `[D]`, or None.
      eps, scale, num_heads, activation, key_norm: the spec's options (static Python values).
      return_lse / return_weights: also return lse `[...]` (`[..., H]` if H > 1, compute dtype,
        differentiable) and the depth weights `[N, ...]` (`[N, ..., H]`, not differentiable).

    Returns: out `[..., D]` in the sources' dtype, or `(out, lse?, weights?)` in that order.
    """
    sources, shapes, dtypes, stacked = canonical_sources(sources)
    query, norm_weight = _as_array(query), _optional(norm_weight)
    geo = validation.check_depth_attention(
        shapes, dtypes, query.shape, dtype_name(query), *_meta(norm_weight), stacked=stacked,
        eps=eps, scale=scale, num_heads=num_heads, activation=activation, key_norm=key_norm,
        return_lse=return_lse,
    )
    opts = _Options(float(eps), float(scale), geo.num_heads, activation, key_norm, multi=False)
    out, lse, p = _attend(opts, sources, query, norm_weight)
    extra = []
    if return_lse:
        extra.append(lse[0] if geo.num_heads > 1 else lse[0, ..., 0])
    if return_weights:
        p = jax.lax.stop_gradient(p[:, 0])
        extra.append(p if geo.num_heads > 1 else p[..., 0])
    return (out[0], *extra) if extra else out[0]


def depth_attention_multi(sources: Sources, queries, norm_weights=None, *, eps: float = 1e-6,
                          scale: float = 1.0):
    """Phase 1 of the two-phase schedule (spec 3.1): S pseudo-queries over N sources.

    Args: sources `N x [..., D]` or `[N, ..., D]`; queries `[S, D]`; norm_weights `[S, D]` or None.
    Returns: (out `[S, ..., D]` in the sources' dtype, lse `[S, ...]` in the compute dtype);
      row s equals `depth_attention(sources, queries[s], norm_weights[s], return_lse=True)`.
    """
    sources, shapes, dtypes, stacked = canonical_sources(sources)
    queries, norm_weights = _as_array(queries), _optional(norm_weights)
    validation.check_multi(shapes, dtypes, queries.shape, dtype_name(queries),
                           *_meta(norm_weights), stacked=stacked, eps=eps, scale=scale)
    opts = _Options(float(eps), float(scale), 1, "softmax", True, multi=True)
    out, lse, _ = _attend(opts, sources, queries, norm_weights)
    return out, lse[..., 0]


# -- phase 2: merge ------------------------------------------------------------------------------


class _MergeOptions(NamedTuple):
    eps: float
    scale: float


def _merge_stats(opts: _MergeOptions, lse1, partial, query, norm_weight):
    """Per-token statistics of the partial sum: r, s, z2, l1, w1 `[...]` and x, qg `[..., D]`."""
    ct = _compute_dtype(partial)
    x = partial.astype(ct)
    qg = query.astype(ct)
    if norm_weight is not None:
        qg = qg * norm_weight.astype(ct)
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + opts.eps)
    s = jnp.sum(qg * x, axis=-1)
    z2 = opts.scale * r * s
    l1 = lse1.astype(ct)
    w1 = 1.0 / (1.0 + jnp.exp(z2 - l1))  # e^{lse1} / (e^{lse1} + e^{z2}) = sigmoid(lse1 - z2)
    return x, qg, r, s, z2, l1, w1


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _merge(opts: _MergeOptions, out1, lse1, partial, query, norm_weight):
    return _merge_fwd(opts, out1, lse1, partial, query, norm_weight)[0]


def _merge_fwd(opts, out1, lse1, partial, query, norm_weight):
    plan = dispatch.plan(num_heads=1, dim=partial.shape[-1], dtype=partial.dtype, num_sources=2)
    if plan is not None:
        return _kernel_merge(opts, plan, out1, lse1, partial, query, norm_weight)
    x, _, r, s, z2, l1, w1 = _merge_stats(opts, lse1, partial, query, norm_weight)
    o1 = out1.astype(x.dtype)
    out = (w1[..., None] * o1 + (1.0 - w1)[..., None] * x).astype(partial.dtype)
    m = jnp.maximum(l1, z2)
    lse = m + jnp.log(jnp.exp(l1 - m) + jnp.exp(z2 - m))
    return (out, lse), (out1, lse1, partial, query, norm_weight, r, s, w1)


def _kernel_merge(opts, plan, out1, lse1, partial, query, norm_weight):
    """`_merge_fwd` on the Pallas merge kernel (tokens flattened to `[T, D]`)."""
    ct = _compute_dtype(partial)
    tokens, dim = partial.shape[:-1], partial.shape[-1]
    qg = query.astype(ct).reshape(-1, dim)
    if norm_weight is not None:
        qg = qg * norm_weight.astype(ct)
    flat = lambda a, width: a.reshape(-1, width)  # noqa: E731
    out, lse, r, s, w1 = kernels.merge(flat(out1, dim), flat(lse1, 1), flat(partial, dim), qg,
                                       per_token=query.ndim > 1, eps=opts.eps, scale=opts.scale, tb=plan.tile,
                                       ct=ct, interpret=plan.interpret, poison=plan.poison)
    out = out.reshape(partial.shape)
    lse, r, s, w1 = (a.reshape(tokens) for a in (lse, r, s, w1))
    return (out, lse), (out1, lse1, partial, query, norm_weight, r, s, w1)


def _merge_bwd(opts, res, cotangents):
    out1, lse1, partial, query, norm_weight, r, s, w1 = res
    d_out, d_lse = cotangents
    ct = w1.dtype
    x = partial.astype(ct)
    qg = query.astype(ct)
    gain = None if norm_weight is None else norm_weight.astype(ct)
    if gain is not None:
        qg = qg * gain
    g = d_out.astype(ct)
    w2 = 1.0 - w1
    d_delta = jnp.sum(g * (out1.astype(ct) - x), axis=-1) * w1 * w2  # delta = lse1 - z2
    d_l1 = d_delta + d_lse.astype(ct) * w1
    d_z2 = -d_delta + d_lse.astype(ct) * w2
    c = opts.scale * d_z2
    d_partial = w2[..., None] * g + c[..., None] * (
        r[..., None] * qg - ((s * r) * r * r)[..., None] * x / x.shape[-1])
    dqg = (c * r)[..., None] * x  # [..., D]
    d_query = dqg if gain is None else dqg * gain
    d_query = _sum_to(d_query, (1,) * (dqg.ndim - query.ndim) + query.shape)
    d_norm = None
    if norm_weight is not None:
        d_norm = _sum_to(dqg * query.astype(ct), (1,) * (dqg.ndim - 1) + norm_weight.shape)
        d_norm = d_norm.reshape(norm_weight.shape).astype(norm_weight.dtype)
    cts = ((w1[..., None] * g).astype(out1.dtype), d_l1.astype(lse1.dtype),
           d_partial.astype(partial.dtype), d_query.reshape(query.shape).astype(query.dtype), d_norm)
    return _like_primals(cts, (out1, lse1, partial, query, norm_weight))


_merge.defvjp(_merge_fwd, _merge_bwd)


def merge_partial(out1, lse1, partial, query, norm_weight=None, *, eps: float = 1e-6,
                  scale: float = 1.0, return_lse: bool = False):
    """Phase 2 (spec 3.2): online-softmax merge of phase 1 with the intra-block partial sum.

    Args: out1 `[..., D]` and lse1 `[...]` from phase 1 for this query; partial `[..., D]`;
      query `[D]` or `[..., D]`; norm_weight `[D]` or None.
    Returns: out `[..., D]` in partial's dtype (and lse `[...]` in the compute dtype if
      return_lse), equal to `depth_attention(phase1_sources + [partial], query, norm_weight)`.
    """
    out1, lse1, partial, query = (_as_array(a) for a in (out1, lse1, partial, query))
    norm_weight = _optional(norm_weight)
    validation.check_merge(out1.shape, dtype_name(out1), lse1.shape, dtype_name(lse1), partial.shape,
                           dtype_name(partial), query.shape, dtype_name(query), *_meta(norm_weight),
                           eps=eps, scale=scale)
    out, lse = _merge(_MergeOptions(float(eps), float(scale)), out1, lse1, partial, query, norm_weight)
    return (out, lse) if return_lse else out
