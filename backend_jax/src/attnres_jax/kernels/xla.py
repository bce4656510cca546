"""The XLA implementation: the spec's forward formulas and VJP rules in jnp (spec 2.1, 2.3, 3.1,
3.2), and `XLA`, their entry points for the registry (`attnres_jax.dispatch`).  The query side,
the column layout and the numerics the Pallas implementation shares are in `_math`.

Notation (spec 2.1), per token and head:
    r_i = 1 / sqrt(mean(x_i ** 2) + eps)    (1 when key_norm=False)
    qg  = query * norm_weight
    s_i = <qg, x_i>,  z_i = scale * r_i * s_i,  p = softmax_i(z) or sigmoid(z_i)
    out = sum_i p_i x_i,  lse = logsumexp_i z_i

One core serves `depth_attention` (S = 1 query set, H heads) and `depth_attention_multi`
(S pseudo-queries, one head).  Sources are never stacked: the N sources arrive as a list of
`[..., D]` arrays.  Token axes `...` are kept as they are (so shardings over batch/sequence
propagate unchanged).  Per-token statistics are `[..., K]` (K = S * H columns, column
k = s * H + h).  Pseudo-queries also become one block-diagonal matrix `Qm [D, K]` (column k holds
qg[s] on head h's channels) for the backward's products, at HIGHEST precision (a TPU/GPU would
otherwise run them in bf16/tf32).  Every contraction over D (the logits s, <d_out, x_i>, the key
norm's sum of squares) is an elementwise product and a reduce (`channel_sum`), not a matmul:
XLA:CPU's dot emitter accumulates a matvec sequentially (~D eps), its reduce in vector lanes.

Numerics (C10): every intermediate in the compute dtype `ct` (`_args.compute_dtype`), one final
cast by the caller.  Memory: the residuals are the inputs plus p, s `[N, ..., K]` and
r `[N, ..., H]`; the backward recomputes `<d_out, out>` as `sum_i p_i <d_out, x_i>` and never
needs `out` or any `[N, ..., D]` temporary.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Optional

import jax
import jax.numpy as jnp

from .._args import MergeOptions, Options, Request, sum_to
from .._math import HIGHEST, Query, inv_rms, join_columns, merge_weights, split_columns, tile_sets
from .._math import at as _at
from .._math import lead as _lead
from .._math import trail as _trail

# -- column layout helpers (S = 1 and H = 1 take no reshape: `_math`) -------------------------------


def block_diag_rows(m, s: int, num_heads: int):
    """Inverse of `block_diag` on a `[K, D]` matrix: the head-h block of row (s, h) -> `[S, D]`."""
    if num_heads == 1:  # K = S: the rows themselves
        return m
    d = m.shape[1]
    m = m.reshape(s, num_heads, num_heads, d // num_heads)  # [S, H', H, Dh]
    return jnp.einsum("shhj->shj", m).reshape(s, d)


def _per_head(v, num_heads: int, dim: int):
    """Per-head values `[..., H]` -> each head's value over its Dh channels, broadcastable to
    `[..., D]` (v itself, `[..., 1]`, for one head)."""
    if num_heads == 1:
        return v
    v = _trail(v)
    return jnp.broadcast_to(v, v.shape[:-1] + (dim // num_heads,)).reshape(v.shape[:-2] + (dim,))


def _expand(v, s: int, num_heads: int, dim: int):
    """Per-column values `[..., K]` -> each head's value over its Dh channels, broadcastable to
    `[S, ..., D]` (`[S, ..., 1]` for one head)."""
    return _per_head(split_columns(v, s), num_heads, dim)


def _scaled(v, scale: float):
    """scale * v; v itself for scale 1 (bitwise the same, and no op to trace or compile)."""
    return v if scale == 1.0 else scale * v


def _sum(terms):
    """The sum of a sequence of arrays in its order (C10.5), without `sum`'s leading `0 +`."""
    return functools.reduce(operator.add, terms)


#: Up to this many channels the pairwise sum is one reduce.
LEAF = 8


def channel_sum(w, pairwise: bool = False):
    """`[..., n]` -> `[..., 1]`: the sum over the last axis, in an order fixed by the shape
    (C10.5, C15): one reduce, or with `pairwise` a halving `w[:n/2] + w[n/2:]` (zero-padded to
    a power of two; one reduce for n <= `LEAF`).

    Never a matmul: XLA:CPU lowers a matvec `x @ qg` as one sequential accumulation (error
    growing with D); a reduce over the minor axis accumulates in vector lanes, and the halving
    pairwise, both far more accurate.  Which of the two is faster depends on the summand on
    XLA:CPU: for fp32 sources the reduce (the halving is emitted as scalar code per token); for
    bf16/fp16 sources, whose summands are converts fused into the sum, the halving (the reduce of
    a fused convert is not vectorized).  Callers pass `pairwise=low_precision(source)`."""
    n = w.shape[-1]
    if not pairwise or n <= LEAF:
        return jnp.sum(w, axis=-1, keepdims=True)
    width = 1 << (n - 1).bit_length()
    if width != n:
        w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, width - n)])
    while w.shape[-1] > 1:  # lax slices: the same HLO as `w[..., :half]`, ~10x cheaper to trace
        half = w.shape[-1] // 2
        w = jax.lax.slice_in_dim(w, 0, half, axis=-1) + jax.lax.slice_in_dim(w, half, 2 * half, axis=-1)
    return w


def low_precision(x) -> bool:
    """Whether x's dtype is narrower than 32 bits (its sums over D take `channel_sum`'s halving)."""
    return jnp.dtype(x.dtype).itemsize < 4


def _head_sums(w, num_heads: int, pairwise: bool = False):
    """`[..., D]` -> sums over each head's channels `[..., H]` (`channel_sum`)."""
    if num_heads == 1:
        return channel_sum(w, pairwise)
    return channel_sum(w.reshape(w.shape[:-1] + (num_heads, w.shape[-1] // num_heads)), pairwise)[..., 0]


def _columns(w, num_heads: int, pairwise: bool = False):
    """`[S, ..., D]` -> per-column sums over each head's channels `[..., K]`."""
    if w.shape[0] == 1:
        return _head_sums(_at(w, 0), num_heads, pairwise)
    return join_columns(_head_sums(w, num_heads, pairwise))


def _sum_sets(w):
    """Sum over the leading query-set axis S (a free squeeze when S = 1)."""
    return _at(w, 0) if w.shape[0] == 1 else jnp.sum(w, axis=0)


def inv_rms_cond(x, reduce, count: int, eps: float, raw=None):
    """`inv_rms` with its overflow branch behind one `lax.cond`: the rescaled second sum of
    squares runs only when some mean overflowed (C10.6), not on every call (as a `jnp.where`
    does: an extra pass over x).  Under `vmap` the cond becomes a select and both sides run, as
    in `inv_rms`.

    reduce: hashable (a module function or `HeadSums`), so the branches are the same function
    objects at every call (`_rms_branches`).
    raw: x before its cast to the compute dtype (`x == raw.astype(x.dtype)`), if it was cast.
    The branch takes raw and casts it itself: a branch operand is materialized, and the upcast
    of a 16-bit source as the operand would be a second, float32 copy of it."""
    ms = reduce(x * x) / count
    return rms_from(ms, x if raw is None else raw, reduce, count, eps, x.dtype)


def rms_from(ms, operand, reduce, count: int, eps: float, dtype):
    """`inv_rms_cond` from the mean squares ms it has computed: `rsqrt(ms + eps)`, or where some
    ms overflowed, `inv_rms` of the operand (cast to dtype).  operand: one array (ms of its
    shape but the reduced axis), or a tuple of the N sources with ms `[N, ..., H]` stacked: one
    cond for all of a call's sources, not one per source (fewer ops to trace and compile)."""
    overflow, plain = _rms_branches(reduce, count, float(eps), dtype)
    return jax.lax.cond(jnp.any(ms == jnp.inf), overflow, plain, operand, ms)  # ms >= 0: isinf


@functools.lru_cache(maxsize=256)
def _rms_branches(reduce, count: int, eps: float, dtype):
    """`inv_rms_cond`'s (overflow, plain) branches, one pair per (reduce, count, eps, dtype):
    `lax.cond` traces both branches at every call, and JAX keeps those traces by the function
    object and the operands' types, so stable branches trace once per operand type instead of
    once per call (a Full-AttnRes step calls it once per source)."""

    def overflow(a, ms):
        # the N sources of `rms_from` (ms [N, ..., H]) stacked: a copy, on this rare path only
        a = jnp.stack(a) if isinstance(a, tuple) else a
        return inv_rms(a.astype(dtype), reduce, count, eps, ms)

    def plain(a, ms):
        return jax.lax.rsqrt(ms + eps)

    return overflow, plain


@dataclasses.dataclass(frozen=True)
class HeadSums:
    """`_head_sums` as a hashable reduce for `inv_rms_cond`: `[..., D]` -> `[..., H]`."""

    num_heads: int
    pairwise: bool = False

    def __call__(self, w):
        return _head_sums(w, self.num_heads, self.pairwise)


def last_sum(v):
    """The sum over the last axis, `[..., D]` -> `[...]` (`merge`'s reduce)."""
    return jnp.sum(v, axis=-1)


def _head_rms(x, opts: Options, raw=None):
    """r `[..., H]`: 1 / sqrt(mean over each head's channels of x^2 + eps) (ones without key
    norm); raw: x before its cast to the compute dtype (`inv_rms_cond`)."""
    if not opts.key_norm:
        return jnp.ones(x.shape[:-1] + (opts.num_heads,), x.dtype)
    pairwise = raw is not None and low_precision(raw)
    return inv_rms_cond(x, HeadSums(opts.num_heads, pairwise), x.shape[-1] // opts.num_heads,
                        opts.eps, raw)


def _sources_rms(ms, xs: list, stacked, opts: Options, ct):
    """r `[N, ..., H]` of the N sources from their mean squares ms `[N, ..., H]` (`rms_from`,
    one cond for them all; ones without key norm, ms None).  stacked: `_stacked(xs)`."""
    if not opts.key_norm:
        return jnp.ones((len(xs),) + xs[0].shape[:-1] + (opts.num_heads,), ct)
    operand = tuple(xs) if stacked is None else stacked
    return rms_from(ms, operand, HeadSums(opts.num_heads, low_precision(xs[0])), xs[0].shape[-1] // opts.num_heads,
                    opts.eps, ct)


# -- depth attention: forward and VJP rule ---------------------------------------------------------


#: Up to this many sources the per-source formulas are unrolled (one fused pass per source, no
#: copy); above it they run once, vmapped over the stacked sources `[N, ..., D]`, so the program
#: has the same size for every N (an unrolled program grows with N, and a Full-AttnRes model of L
#: sublayers compiles O(L^2) source passes).  The price is a copy of the sources and of the N
#: gradients, which makes the stacked program slower at small N, hence unrolled up to 16 (the
#: output sum stays unrolled either way).
UNROLL_MAX = 16


def _per_source(fn, xs: list, stacked, *rows):
    """`fn(x_i, *(row[i] for row in rows))` for every source; each output stacked `[N, ...]`.
    Unrolled over the list `xs` when `stacked` is None, else vmapped over `stacked [N, ..., D]`."""
    if stacked is not None:
        return jax.vmap(fn)(stacked, *rows)
    outs = [fn(x, *(_at(row, i) for row in rows)) for i, x in enumerate(xs)]
    return tuple(jnp.stack(o) for o in zip(*outs))


def _stacked(xs: list):
    """The sources stacked `[N, ..., D]` when there are more than `UNROLL_MAX`, else None."""
    return jnp.stack(xs) if len(xs) > UNROLL_MAX else None


def forward(xs: list, qs: Query, opts: Options, ct, num_valid=None):
    """Forward over N sources `[..., D]` (spec 2.1, 3.1).  Returns out `[S, ..., D]` (compute
    dtype), lse `[..., K]` (None for sigmoid) and the residual statistics p, s `[N, ..., K]`,
    r `[N, ..., H]`.  num_valid: None or a 0-d integer n: sources i >= n get the logit -inf, so
    p_i = 0 exactly and `backward` gives them (and takes from them) exact zeros."""
    h, sets, dim = opts.num_heads, qs.num_sets, xs[0].shape[-1]
    stacked = _stacked(xs)
    pairwise = low_precision(xs[0])
    if qs.qm is None or sets == 1:  # one query row against x, broadcast once (not per source)
        qrow = jnp.broadcast_to(qs.qg if qs.qm is None else _at(qs.qg, 0), xs[0].shape)
    else:  # [S, 1.., D] query sets against x: per-column sums (C10)
        qsets = qs.qg.reshape((sets,) + (1,) * (xs[0].ndim - 1) + (dim,))

    def stats(raw):
        x = raw.astype(ct)
        s = _head_sums(x * qrow, h, pairwise) if sets == 1 else _columns(_lead(x) * qsets, h, pairwise)
        if not opts.key_norm:
            return (s,)
        return _head_sums(x * x, h, pairwise) / (dim // h), s  # the mean squares, `_sources_rms`

    *ms, s = _per_source(stats, xs, stacked)
    r = _sources_rms(ms[0] if ms else None, xs, stacked, opts, ct)
    z = _scaled(tile_sets(r, sets), opts.scale) * s
    if num_valid is not None:
        z = jnp.where(jax.lax.broadcasted_iota(jnp.int32, z.shape, 0) < num_valid, z, -jnp.inf)
    if opts.activation == "softmax":
        m = jnp.max(z, axis=0)  # C10.4: subtract the maximum
        e = jnp.exp(z - _lead(m))
        total = jnp.sum(e, axis=0)
        p = e / _lead(total)
        lse = m + jnp.log(total)
    else:
        p = jax.nn.sigmoid(z)
        lse = None
    # One elementwise sum over the sources in a fixed order (C10.5), also when stacked: XLA:CPU
    # reduces the leading axis of `[N, ..., D]` much slower than this fused chain of adds.
    if sets == 1:
        out = _lead(_sum(_per_head(_at(p, i), h, dim) * x.astype(ct) for i, x in enumerate(xs)))
    else:
        out = _sum(_expand(_at(p, i), sets, h, dim) * _lead(x.astype(ct)) for i, x in enumerate(xs))
    return out, lse, p, r, s


def _dot_scale(r, rk):
    """(f `[..., 1]`, rk / f `[N, ..., K]`): f = min(1, the token's smallest r over its sources and
    heads), so x f is at most the size of the normalized keys (`backward`, C10.6): a reduce and
    two products, cheaper to compile than an exact power of two (frexp / ldexp)."""
    f = _trail(jnp.minimum(jnp.min(r, axis=(0, r.ndim - 1)), 1.0))
    return f, rk / _lead(f)


def backward(xs: list, qs: Query, opts: Options, ct, d_out, d_lse, p, r, s):
    """VJP rule of `forward` (spec 2.3).  d_out `[S, ..., D]` (any dtype), d_lse `[..., K]` or
    None; p, s `[N, ..., K]`, r `[N, ..., H]`.  Returns the source gradients N x `[..., D]`
    (compute dtype) and dqg (`[S, D]` for pseudo-queries, `[..., D]` per token)."""
    sets, h, dim = qs.num_sets, opts.num_heads, xs[0].shape[-1]
    head_dim = dim // h
    g = d_out.astype(ct)
    stacked = _stacked(xs)
    pairwise = low_precision(xs[0])
    rk = tile_sets(r, sets)
    g1 = _at(g, 0) if sets == 1 else None  # one query set: d_out `[..., D]` (no set axis)

    def dots(inv_a):  # [N, ..., K]: <d_out, x_i f> (f = inv_a `[..., 1]`, or 1 for None)
        def dot(x):
            x = x.astype(ct)
            x = x if inv_a is None else x * inv_a
            return (_head_sums(g1 * x, h, pairwise) if sets == 1 else _columns(g * _lead(x), h, pairwise),)

        return _per_source(dot, xs, stacked)[0]

    if not opts.key_norm:
        dp, ark = dots(None), rk
    elif pairwise:
        # C10.6: with the key norm dz_i is only used as dz_i r_i, while <d_out, x_i> ~ |x| sqrt(D)
        # overflows for finite gradients (fp32 |x| ~ 1e37): the dots are taken of x f, f = min(1,
        # the token's smallest r), and r_i / f scales back (`_dot_scale`)
        f, ark = _dot_scale(r, rk)
        dp = dots(f)
    else:
        # The same, only where some dot of x itself is not finite, behind one cond: for 32- and
        # 64-bit sources the product x f reads a `[..., D]` broadcast of f that XLA materializes
        # for its reduce fusions (the dot pass ran 2x longer).  16-bit sources keep the product
        # above: as operands of a cond their float32 upcasts are materialized (1.4x slower).
        dp = dots(None)

        def rescaled():
            f, ark_f = _dot_scale(r, rk)
            return dots(f), ark_f

        dp, ark = jax.lax.cond(jnp.all(jnp.isfinite(dp)), lambda: (dp, rk), rescaled)
    if opts.activation == "softmax":
        cr = _scaled(p * (dp - _lead(jnp.sum(p * dp, axis=0))), opts.scale) * ark  # dL/d(s_i) = dz_i scale r_i
        if d_lse is not None:
            cr = cr + _scaled(p * _lead(d_lse), opts.scale) * rk
    else:
        cr = _scaled(dp * p * (1.0 - p), opts.scale) * ark
    tok = tuple(range(xs[0].ndim - 1))
    if qs.qm is not None:  # cr [..., K] @ Qm^T [K, D]: a broadcast product when K = 1
        if qs.qm.shape[1] == 1:  # Qm's one column, broadcast once (not per source)
            qcol, qmt = jnp.broadcast_to(jax.lax.index_in_dim(qs.qm, 0, 1, keepdims=False), xs[0].shape), None
        else:
            qcol, qmt = None, qs.qm.T
    else:  # a per-token query, broadcast once (not per source)
        qg = jnp.broadcast_to(qs.qg, xs[0].shape)

    def grads(x, p_i, cr, rk_i, r_i, s_i):  # rk_i is r_i for one query set
        # d z_i / d x_i = scale * (r_i qg - s_i r_i^3 x_i / Dh)  (key_norm)  or  scale * qg
        x = x.astype(ct)
        dx = _per_head(p_i, h, dim) * g1 if sets == 1 else _sum_sets(_expand(p_i, sets, h, dim) * g)
        if qs.qm is not None:
            dx = dx + (cr * qcol if qmt is None else jnp.matmul(cr, qmt, precision=HIGHEST))
            term = jnp.tensordot(cr, x, axes=(tok, tok), precision=HIGHEST)  # [K, D]
        else:
            c = _per_head(cr, h, dim)
            dx = dx + c * qg
            term = c * x  # [..., D]
        if opts.key_norm:  # c s r^3 x as ((c r)(s r) / Dh)(r x): the normalized key r x times
            # factors of order 1, so nothing under- or overflows for huge x (no r^3)
            crsr = cr * (s_i * rk_i)  # [..., K] -> [..., H]
            crsr = crsr if sets == 1 else _sum_sets(split_columns(crsr, sets))
            dx = dx - _per_head(crsr / head_dim, h, dim) * (_per_head(r_i, h, dim) * x)
        return dx, term

    if stacked is None:
        d_sources, dqg = [], None
        for i, x in enumerate(xs):
            r_i = _at(r, i)
            dx, term = grads(x, _at(p, i), _at(cr, i), r_i if sets == 1 else _at(rk, i), r_i, _at(s, i))
            d_sources.append(dx)
            dqg = term if dqg is None else dqg + term
    else:  # the terms of dqg summed over N in the same order
        d_stacked, terms = jax.vmap(grads)(stacked, p, cr, rk, r, s)
        d_sources, dqg = [_at(d_stacked, i) for i in range(len(xs))], _sum(_at(terms, i) for i in range(len(xs)))
    return d_sources, (dqg if qs.qm is None else block_diag_rows(dqg, sets, h))


# -- the fused output norm (C17, spec 2.6) -----------------------------------------------------------


def out_norm(y, w, eps: float):
    """out_normed = (rho * y) * w of y = out `[..., D]` in the compute dtype (before out's final
    rounding), over all D channels whatever the heads; rho `[..., 1]` from `inv_rms_cond`
    (overflow-safe, C10.6), y_hat = rho * y one product.  Returns (out_normed, rho)."""
    rho = inv_rms_cond(y, channel_sum, y.shape[-1], eps)
    return (rho * y) * w, rho


def out_norm_vjp(y, rho, w, d_out, d_normed):
    """The d_y prologue of spec 2.6 (C17), one elementwise/row-reduce pass: y, d_out, d_normed
    `[..., D]`, rho `[..., 1]`, w `[D]`, all in the compute dtype.  Returns
    g_total = d_out + rho (a - y_hat <a, y_hat> / D) with a = d_normed * w, and
    d_out_norm_weight `[D]` = sum over tokens of d_normed * y_hat."""
    y_hat = rho * y
    a = d_normed * w
    g_total = d_out + rho * (a - y_hat * (channel_sum(a * y_hat) / y.shape[-1]))
    return g_total, sum_to(d_normed * y_hat, w.shape)


def forward_normed(xs: list, qs: Query, opts: Options, ct, w, num_valid=None):
    """`forward` and the fused output norm in the same program (C17), w `[D]` in `ct`: returns
    out, lse, p, r, s as `forward` does, out_normed `[1, ..., D]` (compute dtype) and the saved
    (y, rho) for `backward_normed`: y is out in the compute dtype (for float32/float64 sources
    the very array returned as out, so no extra memory; a float32 copy for 16-bit sources)."""
    out, lse, p, r, s = forward(xs, qs, opts, ct, num_valid)
    y = _at(out, 0)
    normed, rho = out_norm(y, w, opts.out_norm_eps)
    return out, lse, p, r, s, _lead(normed), (y, rho)


def backward_normed(xs: list, qs: Query, opts: Options, ct, d_out, d_lse, p, r, s, w, d_normed, saved):
    """`backward` behind the C17 prologue (`out_norm_vjp` on the saved y, rho of `forward_normed`).
    d_out, d_normed `[1, ..., D]`.  Returns the source gradients, dqg and d_out_norm_weight `[D]`."""
    y, rho = saved
    g, d_w = out_norm_vjp(y, rho, w, _at(d_out, 0).astype(ct), _at(d_normed, 0).astype(ct))
    d_sources, dqg = backward(xs, qs, opts, ct, _lead(g), d_lse, p, r, s)
    return d_sources, dqg, d_w


# -- phase 2: merge ----------------------------------------------------------------------------------


def merge(opts: MergeOptions, out1, lse1, partial, query, norm_weight, ct):
    """Spec 3.2.  out1, partial `[..., D]`; lse1 `[...]`; query `[D]` or `[..., D]`.  Returns
    out `[..., D]` (partial's dtype) and lse, r, s, w1 `[...]` (compute dtype)."""
    x = partial.astype(ct)
    qg = query.astype(ct)
    if norm_weight is not None:
        qg = qg * norm_weight.astype(ct)
    r = inv_rms_cond(x, last_sum, x.shape[-1], opts.eps, partial)
    s = jnp.sum(qg * x, axis=-1)
    z2 = opts.scale * r * s
    l1 = lse1.astype(ct)
    w1, w2 = merge_weights(l1, z2)
    out = (w1[..., None] * out1.astype(ct) + w2[..., None] * x).astype(partial.dtype)
    m = jnp.maximum(l1, z2)
    lse = m + jnp.log(jnp.exp(l1 - m) + jnp.exp(z2 - m))
    return out, lse, r, s, w1


def merge_backward(opts: MergeOptions, out1, lse1, partial, query, norm_weight, r, s, w1, d_out, d_lse):
    """VJP rule of `merge` from its residuals r, s, w1 `[...]` (compute dtype).  Returns the
    cotangents of (out1, lse1, partial, query, norm_weight), each in its input's dtype."""
    ct = w1.dtype
    x = partial.astype(ct)
    qg = query.astype(ct)
    gain = None if norm_weight is None else norm_weight.astype(ct)
    if gain is not None:
        qg = qg * gain
    g = d_out.astype(ct)
    w2 = merge_weights(lse1.astype(ct), opts.scale * r * s)[1]  # C10.7: not 1 - w1
    d_delta = jnp.sum(g * (out1.astype(ct) - x), axis=-1) * w1 * w2  # delta = lse1 - z2
    d_l1 = d_delta + d_lse.astype(ct) * w1
    d_z2 = -d_delta + d_lse.astype(ct) * w2
    c = opts.scale * d_z2
    d_partial = w2[..., None] * g + c[..., None] * (  # s r^3 x as ((s r) r / D)(r x): no r^3
        r[..., None] * qg - ((s * r) * r / x.shape[-1])[..., None] * (r[..., None] * x))
    dqg = (c * r)[..., None] * x  # [..., D]
    d_query = dqg if gain is None else dqg * gain
    d_query = sum_to(d_query, (1,) * (dqg.ndim - query.ndim) + query.shape)
    d_norm = None
    if norm_weight is not None:
        d_norm = sum_to(dqg * query.astype(ct), (1,) * (dqg.ndim - 1) + norm_weight.shape)
        d_norm = d_norm.reshape(norm_weight.shape).astype(norm_weight.dtype)
    return ((w1[..., None] * g).astype(out1.dtype), d_l1.astype(lse1.dtype), d_partial.astype(partial.dtype),
            d_query.reshape(query.shape).astype(query.dtype), d_norm)


# -- the implementation object -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Xla:
    """The XLA formulas as an implementation of the registry (`attnres_jax.dispatch`): runs every
    call on every platform, float64 and multi-head included.  Hashable: a static argument of the
    custom VJPs."""

    name = "xla"

    @staticmethod
    def unavailable(platform: str) -> Optional[str]:
        """None: XLA compiles for every platform JAX runs on."""
        return None

    def supports(self, request: Request) -> Optional[str]:
        """None: XLA runs every call."""
        return None

    def resolve(self, request: Request) -> "Xla":
        return self

    forward = staticmethod(forward)
    backward = staticmethod(backward)
    forward_normed = staticmethod(forward_normed)
    backward_normed = staticmethod(backward_normed)
    phase1 = staticmethod(forward)  # S query sets: the same core
    phase1_backward = staticmethod(backward)
    merge = staticmethod(merge)
    merge_backward = staticmethod(merge_backward)


XLA = Xla()
