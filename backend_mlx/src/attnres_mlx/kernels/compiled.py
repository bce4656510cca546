"""The compiled implementation: the spec's ops composed from plain `mlx.core` and run under
`mx.compile`.  It runs on every device and dtype (float64 included, on the CPU); `metal.py`
holds the kernels preferred on Apple GPUs.  `ops.py` chooses between them once per call.

The math functions (`attend_forward`, `attend_backward`, `merge_forward`, `merge_backward`)
take arrays already in the compute dtype (float32, or float64 for float64 sources, C10) and in
*broadcast form*:

* sources `xs`: a list of N arrays `[..., H, Dh]` (heads split off the last axis), or one
  stacked array `[N, ..., H, Dh]`; a stacked array is read source by source through views
  `xs[i]` (never split into a list) and its gradient is computed as one `[N, ..., H, Dh]` array;
* `qg = query * norm_weight` broadcastable against a source (`[H, Dh]`, `[..., H, Dh]`, or for
  the two-phase op `[S, 1.., H, Dh]` against sources `[1, ..., H, Dh]`);
* `rs`: per source either None (the inverse RMS is computed here) or a cached inverse RMS
  `[..., H]` (the router's sealed blocks); or, for stacked sources, one stacked array
  `[N, ..., H]` holding every source's cached inverse RMS.

Two forward layouts, chosen per call (`ops.py`, `Static.vectorized`): small calls (at most
`VECTOR_MAX_ELEMENTS` source elements, e.g. single-token decode) reduce over all sources at once
on one stacked `[N, ..., H, Dh]` array (a list is stacked inside the compiled function), a
handful of graph nodes whatever N; larger calls stream source by source (no `[N, ..., D]`
temporaries).  Either layout gives the same bits for a list and a stacked array.

Math (spec 2.1/2.3): r_i = 1/sqrt(mean(x_i^2) + eps), s_i = <qg, x_i>, z_i = scale r_i s_i,
p = softmax_i(z) or sigmoid(z), out = sum_i p_i x_i, lse = logsumexp_i z; with the fused output
norm (C17, section 2.6) also out_normed = rmsnorm(out) * w over all D channels, from out in the
compute dtype in the same compiled function, and its d_y prologue in the backward.

`IMPLEMENTATION` wraps them into the entry points `ops.py` calls: they take the op's own
arrays (sources as given, query, gain, cached inverse RMS), build the broadcast forms, and
return the op's outputs and gradients in their final shapes and dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import List, Optional, Sequence, Union

import mlx.core as mx

from ..common import compute_dtype, query_grads, sum_to

#: N sources in broadcast form: a list of `[..., H, Dh]` or one stacked `[N, ..., H, Dh]`.
Sources = Union[mx.array, List[mx.array]]

_E = 2.718281828459045

#: Calls whose sources hold at most this many elements in all take the vectorized forward (one
#: reduction over the stacked sources instead of a few graph nodes per source): there the time
#: is per-node overhead, not memory traffic, and the `[N, ..., D]` temporaries are small.
VECTOR_MAX_ELEMENTS = 1 << 17


def exp(x: mx.array) -> mx.array:
    """exp that is exact in float64 too: MLX 0.32's CPU `mx.exp` on float64 is accurate to float32
    precision only (relative error ~1e-7), while `mx.power` is correctly rounded."""
    return mx.power(mx.array(_E, dtype=mx.float64), x) if x.dtype == mx.float64 else mx.exp(x)


def sigmoid(x: mx.array) -> mx.array:
    """Logistic function; float64 through `exp` (MLX's float64 `mx.sigmoid` is float32-accurate)."""
    return 1.0 / (1.0 + exp(-x)) if x.dtype == mx.float64 else mx.sigmoid(x)


def heads(x: mx.array, num_heads: int) -> mx.array:
    """`[..., D]` -> `[..., H, Dh]`."""
    return x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)


def _rms_factors(x: mx.array, eps: float, keepdims: bool = False):
    """(pre, rr) over the last axis of `x [..., Dh]` with 1/sqrt(mean(x^2) + eps) = pre * rr,
    each `[...]` (`[..., 1]` with keepdims).

    Overflow-safe (C10.6): where mean(x^2) overflows (fp32: |x| >= ~1.8e19), pre = 2^-k and rr
    comes from the squares of x * 2^-k (k = 79 fp32, 527 float64: finite for every finite x;
    eps is far below the mean there); elsewhere pre = 1.  `(x * pre) * rr` is the normalized x
    without forming the (possibly subnormal) product pre * rr."""
    k = int(math.log2(mx.finfo(x.dtype).max)) // 2 + 16
    lo, zero = mx.array(2.0 ** -k, dtype=x.dtype), mx.array(0.0, dtype=x.dtype)
    ms = mx.mean(x * x, axis=-1, keepdims=True)
    big = mx.isinf(ms)
    # The rescaled squares only for overflowed rows, zero elsewhere: (x 2^-k)^2 of ordinary x is
    # subnormal, and subnormal arithmetic is slow on CPUs.
    y = x * mx.where(big, lo, zero)
    ms_lo = mx.where(big, mx.mean(y * y, axis=-1, keepdims=True), 1.0)
    pre = mx.where(big, lo, mx.array(1.0, dtype=x.dtype))
    rr = mx.where(big, mx.rsqrt(ms_lo), mx.rsqrt(ms + eps))
    return (pre, rr) if keepdims else (pre[..., 0], rr[..., 0])


def inverse_rms(x: mx.array, eps: float) -> mx.array:
    """r = 1 / sqrt(mean(x^2) + eps) over the last axis: `[..., Dh]` -> `[...]`, overflow-safe
    (C10.6, `_rms_factors`): huge sources keep their weights instead of going uniform."""
    # pre * rr of `_rms_factors` formed in one select (pre = 1 exactly on ordinary rows): the
    # same bits in fewer graph nodes (the router calls this on every sealed source).
    k = int(math.log2(mx.finfo(x.dtype).max)) // 2 + 16
    lo, zero = mx.array(2.0 ** -k, dtype=x.dtype), mx.array(0.0, dtype=x.dtype)
    ms = mx.mean(x * x, axis=-1, keepdims=True)
    big = mx.isinf(ms)
    y = x * mx.where(big, lo, zero)
    ms_lo = mx.where(big, mx.mean(y * y, axis=-1, keepdims=True), 1.0)  # no rsqrt(0): its
    return mx.where(big, lo * mx.rsqrt(ms_lo), mx.rsqrt(ms + eps))[..., 0]  # VJP would be NaN


def out_norm_forward(y: mx.array, w: mx.array, eps: float) -> mx.array:
    """C17 fused output norm: (rho y) w with rho = 1/sqrt(mean(y^2) + eps) over all D channels.

    y `[..., D]` (out in the compute dtype, before its final rounding), w `[D]` in the compute
    dtype -> `[..., D]` in the compute dtype.  rho y is formed as (y pre) rr (`_rms_factors`)."""
    pre, rr = _rms_factors(y, eps, keepdims=True)
    return ((y * pre) * rr) * w


def out_norm_backward(y: mx.array, w: mx.array, d_normed: mx.array, eps: float):
    """VJP prologue of `out_norm_forward` (C17), all `[..., D]` in the compute dtype:
    a = d_normed w, y_hat = rho y, d_y = rho (a - y_hat <a, y_hat> / D).

    Returns (d_y `[..., D]`, d_normed y_hat `[..., D]`: d w's per-token terms)."""
    pre, rr = _rms_factors(y, eps, keepdims=True)
    y_hat = (y * pre) * rr
    a = d_normed * w
    dot = mx.sum(a * y_hat, axis=-1, keepdims=True)
    return ((a - y_hat * (dot / y.shape[-1])) * pre) * rr, d_normed * y_hat


def _stats(x, qg, r, *, eps, scale, key_norm):
    """(r, s, z) of one source; r is None when key_norm=False (r = 1, C9)."""
    s = mx.sum(qg * x, axis=-1)
    if not key_norm:
        return None, s, scale * s
    if r is None:
        r = inverse_rms(x, eps)
    return r, s, scale * r * s


def _logits(xs: Sources, qg, rs, *, eps, scale, key_norm):
    """(r, s, z), each `[N, ...]` (r None without key norm), one source at a time."""
    stats = [_stats(xs[i], qg, rs[i], eps=eps, scale=scale, key_norm=key_norm)
             for i in range(len(xs))]
    r, s, z = (None if t[0] is None else mx.stack(t) for t in zip(*stats))
    return r, s, z


def _combine(w: mx.array, xs: Sources) -> mx.array:
    """sum_i w_i x_i for weights `[N, ...]` (in source order, whatever the layout)."""
    out = w[0][..., None] * xs[0]
    for i in range(1, len(xs)):
        out = out + w[i][..., None] * xs[i]
    return out


def _key_grad(x, qg, r, s, *, scale, rms_path):
    """dz/dx: scale (r qg - s r^3 x / Dh), `[..., H, Dh]`.

    r = 1 without key norm (r None).  The r-path (the second term) is dropped for a cached r:
    its gradient leaves through d r instead.  `rms_path` is a bool, or for stacked sources with
    some cached r a 0/1 mask `[N, 1, ...]`.
    """
    if r is None:
        return scale * qg
    if rms_path is False:
        return scale * r[..., None] * qg
    # s r^3 x / Dh as ((s r) r / Dh)(r x): the normalized key r x times s r^2 / Dh, never r^3
    # (r^3 underflows in fp32 from |x| ~ 1e13, zeroing this term while the forward is right)
    rms = ((s * r) * r / x.shape[-1])[..., None] * (r[..., None] * x)
    if rms_path is not True:
        rms = rms_path * rms
    return scale * (r[..., None] * qg - rms)


def _key_grad_of(dzr, x, qg, r, s, *, scale, rms_path):
    """dz_i dz_i/dx_i (`_key_grad` times dz_i) from dzr = dz_i r_i (dz_i itself without key norm):
    scale dzr (qg - ((s r) / Dh)(r x)), `[..., H, Dh]`, the r-path dropped for a cached r as
    there.  dz_i alone, ~|x| sqrt(Dh), would overflow fp32 for |x| ~ 1e37 (C10.6)."""
    dzr = dzr[..., None]
    if r is None or rms_path is False:
        return scale * dzr * qg
    rms = ((s * r) / x.shape[-1])[..., None] * (r[..., None] * x)
    if rms_path is not True:
        rms = rms_path * rms
    return scale * dzr * (qg - rms)


def _dot_scale(r: mx.array):
    """(1 / a, a) `[..., H]`: a = 2^e per token and head, a power of two at least the largest rms
    = 1 / r over the sources, 1 below rms 1, finite (`attend_backward`, C10.6)."""
    e = mx.clip(mx.ceil(mx.log2(1.0 / mx.min(r, axis=0))), 0, int(math.log2(mx.finfo(r.dtype).max)))
    e = mx.where(mx.isnan(e), 0, e)  # NaN sources (C12): unscaled, the NaN propagates as before
    two = mx.array(2.0, dtype=r.dtype)
    return mx.power(two, -e), mx.power(two, e)


def _weights_lse(z: mx.array, activation: str):
    """z `[N, ...]` -> (p `[N, ...]`, lse `[...]` or None).  C12: NaN/inf propagate."""
    if activation == "sigmoid":
        return sigmoid(z), None
    m = mx.max(z, axis=0)
    e = exp(z - m)
    den = mx.sum(e, axis=0)
    return e / den, m + mx.log(den)


def _stacked_rms(X: mx.array, rs, eps: float) -> mx.array:
    """`[N, ..., H]` inverse RMS of stacked sources X: rs itself when it is one stacked array,
    else per source the cached r or the one computed here."""
    if isinstance(rs, mx.array):
        return rs
    if all(r is None for r in rs):
        return inverse_rms(X, eps)
    return mx.stack([inverse_rms(X[i], eps) if r is None else r for i, r in enumerate(rs)])


def attend_forward(xs: Sources, qg: mx.array, rs, *, eps: float, scale: float,
                   activation: str, key_norm: bool, vectorized: bool = False):
    """Returns out `[..., H, Dh]`, p `[N, ..., H]`, lse `[..., H]` (None for sigmoid).

    vectorized: reduce over all sources at once on the stacked `[N, ..., H, Dh]` (a list is
    stacked first); else source by source."""
    if not vectorized:
        _, _, z = _logits(xs, qg, rs, eps=eps, scale=scale, key_norm=key_norm)
        p, lse = _weights_lse(z, activation)
        return _combine(p, xs), p, lse
    # Trailing unit axis kept throughout (z, p `[N, ..., H, 1]`): no squeeze/expand nodes.
    X = xs if isinstance(xs, mx.array) else mx.stack(xs)
    s = mx.sum(qg * X, axis=-1, keepdims=True)
    z = scale * _stacked_rms(X, rs, eps)[..., None] * s if key_norm else scale * s
    if activation == "sigmoid":
        p, lse = sigmoid(z), None
    else:
        m = mx.max(z, axis=0, keepdims=True)
        e = exp(z - m)
        den = mx.sum(e, axis=0, keepdims=True)
        p, lse = e / den, (m + mx.log(den))[0, ..., 0]
    return mx.sum(p * X, axis=0), p[..., 0], lse


def attend_backward(xs: Sources, qg: mx.array, rs: Sequence[Optional[mx.array]],
                    g_out: mx.array, d_lse: Optional[mx.array], *, eps: float, scale: float,
                    activation: str, key_norm: bool, out_norm=None):
    """VJP of `attend_forward` (spec 2.3).  g_out `[..., H, Dh]`, d_lse `[..., H]` or None.

    out_norm: None, or (w `[D]`, d_normed `[..., D]`, eps_o) of the fused output norm (C17):
    its d_y prologue is added to g_out first, with y = out recomputed here in the compute dtype.

    Returns (dxs: per source, broadcast-shaped `[..., H, Dh]` (a list for a list, one
    `[N, ..., H, Dh]` array for stacked sources), dqg (broadcast shape), drs: per source
    d r `[..., H]` for a cached r, else None (one `[N, ..., H]` array for a stacked rs), and
    the per-token terms of d w `[..., D]` (None without out_norm)).
    """
    r, s, z = _logits(xs, qg, rs, eps=eps, scale=scale, key_norm=key_norm)
    p, _ = _weights_lse(z, activation)
    y = _combine(p, xs) if activation == "softmax" or out_norm is not None else None
    dw = None
    if out_norm is not None:  # C17: g_total = g_out + d_y over the whole row of D channels
        w, d_normed, eps_o = out_norm
        d_y, dw = out_norm_backward(y.reshape(d_normed.shape), w, d_normed, eps_o)
        g_out = g_out + d_y.reshape(g_out.shape)
    if activation == "softmax":
        # dz_i = p_i (<g, x_i> - <g, out>) as p_i <g, x_i - out>: with peaked weights (x_i ~ out)
        # the two dots over D are large and nearly equal, and fp32 loses their difference
        # (conformance's out_norm N3-T2-D4100 float32 row: d norm_weight 2.8e-4 off, 1e-4
        # allowed; 4.2e-5 this way).
        # C10.6: of (x_i - out) / a (a = 2^e >= the token's largest rms, exact), and dz_i kept as
        # dzr = dz_i r_i, its only use with the key norm: <g, x_i - out> overflows fp32 for
        # |x| ~ 1e37 (D = 4100) while every source gradient is of order 1.
        inv_a, a = (None, None) if r is None else _dot_scale(r)
        unit = (lambda v: v) if r is None else (lambda v: v * inv_a[..., None])
        dza = p * mx.stack([mx.sum(g_out * unit(xs[i] - y), axis=-1) for i in range(len(xs))])
        dzr = dza if r is None else dza * (a * r)
        if d_lse is not None:
            dzr = dzr + p * d_lse * (1.0 if r is None else r)
    else:
        inv_a, a = (None, None) if r is None else _dot_scale(r)
        unit = (lambda v: v) if r is None else (lambda v: v * inv_a[..., None])
        dp = mx.stack([mx.sum(g_out * unit(xs[i]), axis=-1) for i in range(len(xs))])
        dzr = dp * p * (1.0 - p) * (1.0 if r is None else a * r)
    dz = dzr if r is None else dzr / r  # dz_i itself: only the gradient of a cached r reads it
    rs_stacked = isinstance(rs, mx.array)  # every r cached, one `[N, ..., H]` array
    rms_path = [False] * len(xs) if rs_stacked else [cached is None for cached in rs]
    if isinstance(xs, mx.array):
        if all(rms_path) or not any(rms_path):
            mask = all(rms_path)
        else:
            mask = mx.array(rms_path, dtype=qg.dtype).reshape((len(rs),) + (1,) * (xs.ndim - 1))
        dxs = p[..., None] * g_out + _key_grad_of(dzr, xs, qg, r, s, scale=scale, rms_path=mask)
    else:
        dxs = [p[i][..., None] * g_out + _key_grad_of(
            dzr[i], x, qg, None if r is None else r[i], s[i], scale=scale, rms_path=rms_path[i])
            for i, x in enumerate(xs)]
    if rs_stacked:
        drs = dz * scale * s
    else:
        drs = [None if cached is None else dz[i] * scale * s[i] for i, cached in enumerate(rs)]
    dqg = _combine(dzr * scale, xs)
    return dxs, dqg, drs, dw


def merge_forward(o1, l1, x, qg, *, eps: float, scale: float):
    """Phase 2 (spec 3.2) in the compute dtype: o1, x `[..., D]`; l1 `[...]`; qg broadcastable.

    Returns (out `[..., D]`, lse `[...]`).
    """
    _, _, z2 = _stats(x, qg, None, eps=eps, scale=scale, key_norm=True)
    w1, w2 = sigmoid(l1 - z2), sigmoid(z2 - l1)  # C10.7: w2 is not 1 - w1 (its bits)
    m = mx.maximum(l1, z2)
    lse = m + mx.log(exp(l1 - m) + exp(z2 - m))
    return w1[..., None] * o1 + w2[..., None] * x, lse


def merge_backward(o1, l1, x, qg, d_out, d_lse, *, eps: float, scale: float):
    """VJP of `merge_forward`: returns (d_o1, d_l1, d_x, dqg) in broadcast shapes."""
    r, s, z2 = _stats(x, qg, None, eps=eps, scale=scale, key_norm=True)
    w1, w2 = sigmoid(l1 - z2), sigmoid(z2 - l1)  # C10.7: w2 is not 1 - w1 (its bits)
    d_delta = mx.sum(d_out * (o1 - x), axis=-1) * w1 * w2  # delta = lse1 - z2
    d_l1, d_z2 = d_delta, -d_delta
    if d_lse is not None:
        d_l1 = d_l1 + d_lse * w1
        d_z2 = d_z2 + d_lse * w2
    dkey = _key_grad(x, qg, r, s, scale=scale, rms_path=True)
    d_x = w2[..., None] * d_out + d_z2[..., None] * dkey
    dqg = (d_z2 * scale * r)[..., None] * x
    return w1[..., None] * d_out, d_l1, d_x, dqg


# -- the implementation ops.py dispatches to -------------------------------------------------

def _broadcast(st, xs, q, g, rs):
    """The broadcast forms (module docstring) of one call, in the compute dtype.

    xs: list of N `[..., D]` or stacked `[N, ..., D]`; q `[D]`, `[..., D]` or (multi) `[S, D]`;
    g like q's last axes; rs: the cached inverse RMS given, `[..., H]`, in source order (with
    `st.stacked_rms`: [one `[N, ..., H]` array]).
    Returns (xb, qg, rb) with rb: per source None or its cached r (the stacked array itself
    with `st.stacked_rms`).
    """
    stacked = isinstance(xs, mx.array)
    c = compute_dtype(xs.dtype if stacked else xs[0].dtype)
    if st.mode == "multi":  # sources [1, ..., 1, D] against S queries [S, 1.., 1, D]
        batch_ndim = xs.ndim - 2 if stacked else xs[0].ndim - 1
        lead = (q.shape[0],) + (1,) * batch_ndim + (1, q.shape[-1])
        xb = (heads(xs.astype(c)[:, None], 1) if stacked
              else [heads(x.astype(c)[None], 1) for x in xs])
        qg = q.astype(c).reshape(lead) * g.astype(c).reshape(lead)
        given = iter(r.astype(c)[None] for r in rs)
    else:
        H = st.num_heads
        xb = heads(xs.astype(c), H) if stacked else [heads(x.astype(c), H) for x in xs]
        qg = heads(q.astype(c), H) * heads(g.astype(c), H)
        if st.stacked_rms:  # one `[N, ..., H]` array: every source's cached r
            return xb, qg, rs[0].astype(c)
        given = iter(r.astype(c) for r in rs)
    return xb, qg, [next(given) if cached else None for cached in st.cached]


def _squeeze_heads(st, a: mx.array) -> mx.array:
    """`[..., H]` -> `[...]` where the op has one head (and always for phase 1)."""
    return a[..., 0] if st.mode == "multi" or st.num_heads == 1 else a


def _attend_forward(st, xs, q, g, rs, ws, consts):
    """The op's outputs: out `[..., D]` (`[S, ..., D]` for phase 1) and, with the fused output
    norm (ws = [w `[D]`], C17), out_normed `[..., D]`, both in the sources' dtype; lse
    `[..., H?]` (`[S, ...]`; softmax, single-query op with `st.with_lse`) and weights
    `[N, ..., H?]` (single-query op with `st.with_weights`) in the compute dtype; H? is absent
    with one head.  consts: [eps, scale, out_norm_eps?] as 0-d arrays (`_constants`)."""
    eps, scale, *out_norm_eps = consts
    xb, qg, rb = _broadcast(st, xs, q, g, rs)
    out, p, lse = attend_forward(xb, qg, rb, eps=eps, scale=scale,
                                 activation=st.activation, key_norm=st.key_norm,
                                 vectorized=st.vectorized)
    source = xs[0]  # a view for stacked sources: only its shape and dtype are read
    shape = source.shape if st.mode == "single" else (q.shape[0], *source.shape)
    out = out.reshape(shape)
    outs = [out.astype(source.dtype)]
    if ws:  # C17: from out in the compute dtype, before its final rounding; rounded once
        outs.append(out_norm_forward(out, ws[0].astype(out.dtype),
                                     out_norm_eps[0]).astype(source.dtype))
    if lse is not None and (st.mode == "multi" or st.with_lse):
        outs.append(_squeeze_heads(st, lse))
    if st.mode == "single" and st.with_weights:
        outs.append(_squeeze_heads(st, p))
    return tuple(outs)


def _attend_backward(st, xs, q, g, rs, ws, consts, d_out, d_normed, d_lse):
    """Gradients (sources as given, query, gain, cached rs, [out-norm weight]), each in its
    input's shape/dtype.  d_normed: out_normed's cotangent `[..., D]` (None without ws);
    consts as for `_attend_forward`."""
    eps, scale, *out_norm_eps = consts
    xb, qg, rb = _broadcast(st, xs, q, g, rs)
    c = qg.dtype
    g_out = heads(d_out.astype(c), 1 if st.mode == "multi" else st.num_heads)
    if d_lse is not None:
        d_lse = d_lse.astype(c)
        d_lse = d_lse[..., None] if st.mode == "multi" or st.num_heads == 1 else d_lse
    out_norm = (ws[0].astype(c), d_normed.astype(c), out_norm_eps[0]) if ws else None
    dxs, dqg, drs, dw = attend_backward(xb, qg, rb, g_out, d_lse, eps=eps, scale=scale,
                                        activation=st.activation, key_norm=st.key_norm,
                                        out_norm=out_norm)
    if isinstance(xs, mx.array):
        d_sources = sum_to(dxs, xb.shape).reshape(xs.shape).astype(xs.dtype)
    else:
        d_sources = [sum_to(dx, x.shape).reshape(s.shape).astype(s.dtype)
                     for dx, x, s in zip(dxs, xb, xs)]
    # `[..., H, Dh]` -> `[..., D]` (no -1: MLX cannot infer it for an empty token axis)
    dq, dg = query_grads(dqg.reshape(*dqg.shape[:-2], dqg.shape[-2] * dqg.shape[-1]), q, g,
                         multi=st.mode == "multi")
    if st.stacked_rms:
        d_rs = [sum_to(drs, rb.shape).reshape(rs[0].shape).astype(rs[0].dtype)]
    else:
        d_rs = [sum_to(dr, r.shape).reshape(given.shape).astype(given.dtype)
                for dr, r, given in zip((d for d in drs if d is not None),
                                        (r for r in rb if r is not None), rs)]
    d_ws = [sum_to(dw, ws[0].shape).astype(ws[0].dtype)] if ws else []  # C17, sum over tokens
    return d_sources, dq, dg, d_rs, d_ws


def _merge_forward(o1, l1, x, q, g, consts):
    """(out in partial's dtype `[..., D]`, lse `[...]` in the compute dtype); consts: [eps, scale]."""
    eps, scale = consts
    c = compute_dtype(x.dtype)
    out, lse = merge_forward(o1.astype(c), l1.astype(c), x.astype(c),
                             q.astype(c) * g.astype(c), eps=eps, scale=scale)
    return out.astype(x.dtype), lse


def _merge_backward(o1, l1, x, q, g, consts, d_out, d_lse):
    """Gradients of (out1, lse1, partial, query, gain) in their own dtypes and shapes."""
    eps, scale = consts
    c = compute_dtype(x.dtype)
    d_o1, d_l1, d_x, dqg = merge_backward(
        o1.astype(c), l1.astype(c), x.astype(c), q.astype(c) * g.astype(c), d_out.astype(c),
        d_lse.astype(c), eps=eps, scale=scale)
    return (d_o1.astype(o1.dtype), d_l1.astype(l1.dtype), d_x.astype(x.dtype),
            *query_grads(dqg, q, g, multi=False))


# eps, scale and the output norm's eps reach the compiled functions as 0-d inputs, not as
# constants: MLX's CPU backend compiles each fused kernel with a C++ compiler on first use, keyed by
# its constants' values, so constant eps/scale compiled every kernel again for each value (the
# conformance report on MLX compiled 345 kernels with them, 284 without).  Same bits: MLX rounds a
# Python scalar to the array's dtype, as `_constants` does.


@functools.lru_cache(maxsize=None)
def _compiled_attend(st):
    """(forward, backward) compiled for `st` with its eps/scale values zeroed (`_structure`)."""
    return (mx.compile(functools.partial(_attend_forward, st)),
            mx.compile(functools.partial(_attend_backward, st)))


@functools.lru_cache(maxsize=None)
def _compiled_merge():
    return mx.compile(_merge_forward), mx.compile(_merge_backward)


@functools.lru_cache(maxsize=1024)
def _structure(st):
    """`st` without its eps, scale and out_norm_eps values (whether the output norm is on stays)."""
    return dataclasses.replace(st, eps=0.0, scale=0.0, out_norm_eps=None if st.out_norm_eps is None else 0.0)


def _constants(dtype, *values: float) -> List[mx.array]:
    """`values` as 0-d arrays of the compute dtype, cached (a decode step makes none) by their
    exact bits (`float.hex`: -0.0 and 0.0 are equal keys to a dict)."""
    return _constants_of(dtype, tuple(float(v).hex() for v in values))


@functools.lru_cache(maxsize=1024)
def _constants_of(dtype, values: tuple) -> List[mx.array]:
    return [mx.array(float.fromhex(v), dtype=dtype) for v in values]


def _attend_constants(st, xs) -> List[mx.array]:
    """[eps, scale, out_norm_eps?] of `st` in the compute dtype of the sources `xs`."""
    source = xs if isinstance(xs, mx.array) else xs[0]
    values = (st.eps, st.scale) if st.out_norm_eps is None else (st.eps, st.scale, st.out_norm_eps)
    return _constants(compute_dtype(source.dtype), *values)


class Compiled:
    """The `mx.compile`d composition: available everywhere, every dtype (see
    `dispatch.Implementation` for the entry points' contract)."""

    name = "compiled"
    stacked_inv_rms = True

    def unavailable(self):
        return None

    def unsupported(self, dtype):
        return None

    def available(self) -> bool:
        return True

    def supports(self, dtype) -> bool:
        return True

    def attend_forward(self, st, xs, q, g, rs, ws):
        return _compiled_attend(_structure(st))[0](xs, q, g, rs, ws, _attend_constants(st, xs))

    def attend_backward(self, st, xs, q, g, rs, ws, d_out, d_normed, d_lse):
        return _compiled_attend(_structure(st))[1](xs, q, g, rs, ws, _attend_constants(st, xs),
                                                   d_out, d_normed, d_lse)

    def merge_forward(self, eps, scale, o1, l1, x, q, g):
        return _compiled_merge()[0](o1, l1, x, q, g, _constants(compute_dtype(x.dtype), eps, scale))

    def merge_backward(self, eps, scale, o1, l1, x, q, g, d_out, d_lse):
        return _compiled_merge()[1](o1, l1, x, q, g, _constants(compute_dtype(x.dtype), eps, scale),
                                    d_out, d_lse)


IMPLEMENTATION = Compiled()
