"""The spec's operators in float64: forward and hand-written VJP (spec sections 2-4).

Every function here computes in float64 whatever the input dtype (the oracle: callers upcast the
exact low-precision inputs and compare).  Shapes: N sources `[..., D]`, a pseudo-query `[D]` or a
per-token query `[..., D]`, a key-norm gain `[D]`.  With `num_heads = H`, D splits into H
contiguous heads of `Dh = D / H` channels; RMS, logits and weights are then per head.

Notation (spec section 2.1), per token and head:
    r_i   = 1 / sqrt(mean(x_i ** 2) + eps)            (1 when key_norm=False)
    qg    = query * norm_weight                        (norm_weight = 1 when None)
    s_i   = <qg, x_i>
    z_i   = scale * r_i * s_i                          logits
    p_i   = softmax_i(z) or sigmoid(z_i)               depth weights
    out   = sum_i p_i x_i
    lse   = log sum_i exp(z_i)                         (softmax only)
    rho   = 1 / sqrt(mean_D(out ** 2) + eps_o)        fused output norm (C17), over all D channels
    out_normed = rho * out * out_norm_weight
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import numpy as np
from attnres_core import validation

Sources = Union[np.ndarray, Sequence[np.ndarray]]


def _dtype_name(a: np.ndarray) -> str:
    name = np.asarray(a).dtype.name
    # ml_dtypes' bfloat16 (if a caller passes one) names itself "bfloat16" already.
    return name


def _as_stack(sources: Sources) -> tuple[np.ndarray, bool]:
    """Validate-friendly view: returns (float64 `[N, ..., D]` copy, was_stacked)."""
    if isinstance(sources, np.ndarray):
        return np.array(sources, dtype=np.float64), True
    return np.stack([np.asarray(s, dtype=np.float64) for s in sources]), False


def _source_meta(sources: Sources):
    if isinstance(sources, np.ndarray):
        if sources.ndim < 2:
            # Let the shared check produce the message (a 1-D "stack" has scalar sources).
            return [()] * (sources.shape[0] if sources.ndim else 0), [_dtype_name(sources)] * max(
                sources.shape[0] if sources.ndim else 0, 0), True
        return [sources.shape[1:]] * sources.shape[0], [_dtype_name(sources)] * sources.shape[0], True
    if not isinstance(sources, (list, tuple)):
        raise TypeError(
            f"sources: expected a sequence of arrays [..., D] or one stacked array [N, ..., D], "
            f"got {type(sources).__name__}"
        )
    arrays = [np.asarray(s) for s in sources]
    return [a.shape for a in arrays], [_dtype_name(a) for a in arrays], False


def _heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """`[..., D]` -> `[..., H, Dh]`."""
    return x.reshape(x.shape[:-1] + (num_heads, x.shape[-1] // num_heads))


def _stats(x, q, g, *, eps, scale, num_heads, key_norm):
    """Shared forward statistics.  x `[N, ..., H, Dh]`, q and g broadcastable to `[..., H, Dh]`.

    Returns r `[N, ..., H]`, qg `[..., H, Dh]`, s `[N, ..., H]`, z `[N, ..., H]`.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        return _stats_unguarded(x, q, g, eps=eps, scale=scale, key_norm=key_norm)


def _inv_rms(x: np.ndarray, eps: float) -> np.ndarray:
    """`(mean(x ** 2) + eps) ** -0.5` over the last axis: `[..., K]` -> `[...]`.

    C10.6: overflow-safe for every finite row.  Where the sum of squares overflows float64
    (|x| beyond ~1e154) the row is scaled by a power of two 2^-k (exact) first and the result
    scaled back: (mean(x^2) + eps)^-1/2 = 2^-k (mean((2^-k x)^2) + 2^-2k eps)^-1/2.  Rows with a
    non-finite element keep the plain formula (C12: inf -> r = 0, then NaN downstream).
    """
    with np.errstate(invalid="ignore", over="ignore"):
        ms = np.sum(x * x, axis=-1) / x.shape[-1]
        r = 1.0 / np.sqrt(ms + eps)
        redo = ~np.isfinite(ms) & np.all(np.isfinite(x), axis=-1)
    if np.any(redo):
        _, k = np.frexp(np.max(np.abs(x[redo]), axis=-1))  # max |x| < 2^k
        xs = np.ldexp(x[redo], -k[:, None])
        inner = np.sum(xs * xs, axis=-1) / x.shape[-1] + np.ldexp(eps, -2 * k)
        r = np.array(r, copy=True)
        r[redo] = np.ldexp(1.0 / np.sqrt(inner), -k)
    return r


def _stats_unguarded(x, q, g, *, eps, scale, key_norm):
    # C12: Inf/NaN inputs propagate (inf * 0 -> NaN) without warnings or exceptions.
    if key_norm:
        r = _inv_rms(x, eps)
    else:
        r = np.ones(x.shape[:-1])
    qg = q * g
    s = np.sum(qg * x, axis=-1)
    z = scale * r * s
    return r, qg, s, z


def _weights(z: np.ndarray, activation: str) -> np.ndarray:
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    m = np.max(z, axis=0, keepdims=True)
    # C12: an all -inf / NaN column yields NaN weights, which propagate instead of crashing.
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(z - m)
        return e / np.sum(e, axis=0, keepdims=True)


def _lse(z: np.ndarray) -> np.ndarray:
    m = np.max(z, axis=0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return m + np.log(np.sum(np.exp(z - m[None]), axis=0))


def _prepare(sources, query, norm_weight, eps, scale, num_heads, activation, key_norm, return_lse,
             out_norm_weight=None, out_norm_eps=None):
    shapes, dtypes, stacked = _source_meta(sources)
    query = np.asarray(query)
    nw = None if norm_weight is None else np.asarray(norm_weight)
    ow = None if out_norm_weight is None else np.asarray(out_norm_weight)
    geo = validation.check_depth_attention(
        shapes, dtypes, query.shape, _dtype_name(query),
        None if nw is None else nw.shape, None if nw is None else _dtype_name(nw),
        stacked=stacked, eps=eps, scale=scale, num_heads=num_heads, activation=activation,
        key_norm=key_norm, return_lse=return_lse,
        out_norm_weight_shape=None if ow is None else ow.shape,
        out_norm_weight_dtype=None if ow is None else _dtype_name(ow), out_norm_eps=out_norm_eps,
    )
    x, _ = _as_stack(sources)
    h = geo.num_heads
    xh = _heads(x, h)  # [N, ..., H, Dh]
    qh = _heads(query.astype(np.float64), h)  # [H, Dh] or [..., H, Dh]
    gh = _heads(np.ones(geo.dim) if nw is None else nw.astype(np.float64), h)  # [H, Dh]
    return geo, xh, qh, gh


def _out_norm(out: np.ndarray, eps_o: float):
    """C17: rho `[...]` and y_hat = rho * out `[..., D]` of out `[..., D]`, over ALL D channels
    (whatever num_heads).  rho comes from the overflow-safe `_inv_rms` (C10.6) and y_hat is
    formed as one product rho * y, so it is finite and of RMS ~1 for every finite out."""
    with np.errstate(invalid="ignore", over="ignore"):  # C12: NaN/Inf propagate silently
        rho = _inv_rms(out, eps_o)
        return rho, rho[..., None] * out


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
    out_norm_weight=None,
    out_norm_eps: Optional[float] = None,
):
    """Depth attention over N sources (spec section 2, constraints C1-C12, C17).

    Args:
      sources: a sequence of N >= 1 arrays `[..., D]` or one stacked array `[N, ..., D]`.
      query: pseudo-query `[D]` or per-token query `[..., D]`.
      norm_weight: key RMSNorm gain `[D]`, or None for no gain.
      eps, scale, num_heads, activation, key_norm: spec options (C8, C9).
      return_lse / return_weights: also return lse `[...]` (`[..., H]` if H > 1) and the depth
        weights `[N, ...]` (`[N, ..., H]` if H > 1).
      out_norm_weight: the fused output norm's gain `[D]` (C17), or None (off); then also return
        out_normed `[..., D]` = rmsnorm(out) * out_norm_weight over all D channels.
      out_norm_eps: that norm's eps; None means `eps`.

    Returns:
      out `[..., D]` float64; or a tuple `(out, out_normed?, lse?, weights?)` in that order.
    """
    geo, xh, qh, gh = _prepare(sources, query, norm_weight, eps, scale, num_heads, activation,
                               key_norm, return_lse, out_norm_weight, out_norm_eps)
    _, _, _, z = _stats(xh, qh, gh, eps=eps, scale=scale, num_heads=geo.num_heads, key_norm=key_norm)
    p = _weights(z, activation)
    out = np.sum(p[..., None] * xh, axis=0).reshape(geo.batch_shape + (geo.dim,))
    extra = []
    if out_norm_weight is not None:  # C17: from out before any rounding
        _, y_hat = _out_norm(out, geo.out_norm_eps)
        extra.append(y_hat * np.asarray(out_norm_weight, dtype=np.float64))
    if return_lse:
        lse = _lse(z)
        extra.append(lse if geo.num_heads > 1 else lse[..., 0])
    if return_weights:
        extra.append(p if geo.num_heads > 1 else p[..., 0])
    return (out, *extra) if extra else out


#: C12: NaN/Inf inputs propagate through the VJP (inf * 0 -> NaN) without warnings or exceptions.
_SILENT_NONFINITE = np.errstate(invalid="ignore", over="ignore")


@_SILENT_NONFINITE
def depth_attention_vjp(
    sources: Sources,
    query,
    norm_weight,
    d_out,
    d_lse=None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    num_heads: int = 1,
    activation: str = "softmax",
    key_norm: bool = True,
    out_norm_weight=None,
    out_norm_eps: Optional[float] = None,
    d_out_normed=None,
) -> Dict[str, object]:
    """VJP of `depth_attention` (spec sections 2.3 and 2.6).

    Args:
      d_out: cotangent of out `[..., D]` (None: zero); d_lse: optional cotangent of lse `[...]`
        (`[..., H]`); d_out_normed: optional cotangent of out_normed `[..., D]` (needs
        out_norm_weight).  out_norm_weight, out_norm_eps: as in `depth_attention` (C17).

    Returns a dict: "sources" (a list of `[..., D]` if sources was a sequence, else `[N, ..., D]`),
    "query" (shaped like query), "norm_weight" (`[D]`, or None when norm_weight is None),
    and "out_norm_weight" (`[D]`) only when out_norm_weight is given.
    Depth weights are not differentiable (C11).
    """
    geo, xh, qh, gh = _prepare(sources, query, norm_weight, eps, scale, num_heads, activation,
                               key_norm, d_lse is not None, out_norm_weight, out_norm_eps)
    full_shape = geo.batch_shape + (geo.dim,)
    if d_out is not None:
        validation.check_cotangent("d_out", np.shape(d_out), full_shape)
    if d_lse is not None:
        lse_shape = geo.batch_shape + ((geo.num_heads,) if geo.num_heads > 1 else ())
        validation.check_cotangent("d_lse", np.shape(d_lse), lse_shape)
    if d_out_normed is not None:
        if out_norm_weight is None:
            raise ValueError("d_out_normed: given while out_norm_weight is None (there is no "
                             "out_normed output to take a cotangent of)")
        validation.check_cotangent("d_out_normed", np.shape(d_out_normed), full_shape)
    r, qg, s, z = _stats(xh, qh, gh, eps=eps, scale=scale, num_heads=geo.num_heads, key_norm=key_norm)
    p = _weights(z, activation)
    out = np.sum(p[..., None] * xh, axis=0)  # [..., H, Dh]
    g_full = np.zeros(full_shape) if d_out is None else np.asarray(d_out, dtype=np.float64)
    d_onw = None
    if out_norm_weight is not None:  # C17 backward: fold d_out_normed into d_out
        w = np.asarray(out_norm_weight, dtype=np.float64)
        gn = np.zeros(full_shape) if d_out_normed is None else np.asarray(d_out_normed, dtype=np.float64)
        rho, y_hat = _out_norm(out.reshape(full_shape), geo.out_norm_eps)
        a = gn * w
        g_full = g_full + rho[..., None] * (a - y_hat * (np.sum(a * y_hat, axis=-1) / geo.dim)[..., None])
        d_onw = np.sum((gn * y_hat).reshape(-1, geo.dim), axis=0)
    g_out = _heads(g_full, geo.num_heads)  # [..., H, Dh]
    dp = np.sum(g_out[None] * xh, axis=-1)  # [N, ..., H]
    if activation == "softmax":
        dz = p * (dp - np.sum(g_out * out, axis=-1)[None])
        if d_lse is not None:
            dl = np.asarray(d_lse, dtype=np.float64)
            dl = dl if geo.num_heads > 1 else dl[..., None]
            dz = dz + p * dl[None]
    else:
        dz = dp * p * (1.0 - p)
    head_dim = geo.head_dim
    # d z_i / d x_i = scale * (r_i qg - s_i r_i^3 x_i / Dh)   (key_norm)   or scale * qg; the
    # second term as ((s_i r_i) r_i / Dh)(r_i x_i), C10.6: r^3 underflows for |x| beyond ~1e102
    if key_norm:
        dkey = scale * (r[..., None] * qg[None] - ((s * r) * r / head_dim)[..., None] * (r[..., None] * xh))
    else:
        dkey = scale * np.broadcast_to(qg[None], xh.shape)
    dx = p[..., None] * g_out[None] + dz[..., None] * dkey
    dqg = np.sum((dz * scale * r)[..., None] * xh, axis=0)  # [..., H, Dh]
    dq_full = dqg * gh
    dg_full = dqg * qh
    tok_axes = tuple(range(len(geo.batch_shape)))
    dq = dq_full if geo.per_token_query else np.sum(dq_full, axis=tok_axes)
    dg = np.sum(dg_full, axis=tok_axes)
    dx = dx.reshape((geo.num_sources,) + full_shape)
    d_sources = dx if isinstance(sources, np.ndarray) else [dx[i] for i in range(geo.num_sources)]
    grads = {
        "sources": d_sources,
        "query": dq.reshape(np.shape(query)),
        "norm_weight": None if norm_weight is None else dg.reshape(geo.dim),
    }
    if out_norm_weight is not None:  # only then: callers that map every key onto an argument keep working
        grads["out_norm_weight"] = d_onw
    return grads


def _check_multi(sources, queries, norm_weights, eps, scale):
    """Run `validation.check_multi`; returns (queries, norm_weights) as arrays (or None)."""
    shapes, dtypes, stacked = _source_meta(sources)
    queries = np.asarray(queries)
    nw = None if norm_weights is None else np.asarray(norm_weights)
    validation.check_multi(shapes, dtypes, queries.shape, _dtype_name(queries),
                           None if nw is None else nw.shape, None if nw is None else _dtype_name(nw),
                           stacked=stacked, eps=eps, scale=scale)
    return queries, nw


def depth_attention_multi(sources: Sources, queries, norm_weights=None, *, eps: float = 1e-6,
                          scale: float = 1.0):
    """Phase 1 of the two-phase schedule (spec section 3.1): S pseudo-queries over N sources.

    Args:
      sources: `N x [..., D]` or `[N, ..., D]`.
      queries: `[S, D]`.
      norm_weights: `[S, D]` or None.
      eps, scale: spec options.

    Returns:
      (out `[S, ..., D]`, lse `[S, ...]`), each row equal to
      `depth_attention(sources, queries[s], norm_weights[s], return_lse=True)`.
    """
    queries, nw = _check_multi(sources, queries, norm_weights, eps, scale)
    outs, lses = [], []
    for s in range(queries.shape[0]):
        o, l = depth_attention(sources, queries[s], None if nw is None else nw[s], eps=eps,
                               scale=scale, return_lse=True)
        outs.append(o)
        lses.append(l)
    return np.stack(outs), np.stack(lses)


def depth_attention_multi_vjp(sources: Sources, queries, norm_weights, d_out, d_lse=None, *,
                              eps: float = 1e-6, scale: float = 1.0) -> Dict[str, object]:
    """VJP of `depth_attention_multi`: d_out `[S, ..., D]`, d_lse `[S, ...]` or None.

    Returns "sources" (list or stacked, as given), "queries" `[S, D]`, "norm_weights" `[S, D]`/None.
    """
    queries, _ = _check_multi(sources, queries, norm_weights, eps, scale)
    token_shape = _source_meta(sources)[0][0]  # [..., D]
    validation.check_cotangent("d_out", np.shape(d_out), (queries.shape[0],) + tuple(token_shape))
    if d_lse is not None:
        validation.check_cotangent("d_lse", np.shape(d_lse), (queries.shape[0],) + tuple(token_shape[:-1]))
    queries = queries.astype(np.float64)
    d_src = None
    dq, dg = [], []
    for s in range(queries.shape[0]):
        g = depth_attention_vjp(sources, queries[s], None if norm_weights is None else
                                np.asarray(norm_weights)[s], np.asarray(d_out)[s],
                                None if d_lse is None else np.asarray(d_lse)[s], eps=eps, scale=scale)
        ds = g["sources"]
        d_src = ds if d_src is None else (
            d_src + ds if isinstance(ds, np.ndarray) else [a + b for a, b in zip(d_src, ds)])
        dq.append(g["query"])
        dg.append(g["norm_weight"])
    return {
        "sources": d_src,
        "queries": np.stack(dq),
        "norm_weights": None if norm_weights is None else np.stack(dg),
    }


def _merge_prepare(out1, lse1, partial, query, norm_weight, eps, scale):
    out1, lse1, partial, query = (np.asarray(a) for a in (out1, lse1, partial, query))
    nw = None if norm_weight is None else np.asarray(norm_weight)
    geo = validation.check_merge(out1.shape, _dtype_name(out1), lse1.shape, _dtype_name(lse1),
                                 partial.shape, _dtype_name(partial), query.shape, _dtype_name(query),
                                 None if nw is None else nw.shape,
                                 None if nw is None else _dtype_name(nw), eps=eps, scale=scale)
    x = partial.astype(np.float64)[None, ..., None, :]  # [1, ..., H=1, D]
    q = query.astype(np.float64)[..., None, :]
    g = (np.ones(geo.dim) if nw is None else nw.astype(np.float64))[None, :]
    r, qg, s, z = _stats(x, q, g, eps=eps, scale=scale, num_heads=1, key_norm=True)
    z2 = z[0, ..., 0]  # [...]
    l1 = lse1.astype(np.float64)
    # w1 = e^{lse1} / (e^{lse1} + e^{z2}) = sigmoid(lse1 - z2)
    with np.errstate(over="ignore", invalid="ignore"):
        # Both weights from their own logistic: w2 = 1 - w1 would round a tiny partial weight
        # (lse1 - z2 >> 1) to exactly 0 and lose its gradient (1e-19 is not 0).
        w1 = 1.0 / (1.0 + np.exp(z2 - l1))
        w2 = 1.0 / (1.0 + np.exp(l1 - z2))
    return geo, out1.astype(np.float64), x, q, g, r, qg, s, z2, l1, w1, w2


def merge_partial(out1, lse1, partial, query, norm_weight=None, *, eps: float = 1e-6,
                  scale: float = 1.0, return_lse: bool = False):
    """Phase 2 (spec section 3.2): online-softmax merge of phase 1 with the intra-block partial sum.

    Args:
      out1: phase 1's output `[..., D]` for this query.
      lse1: phase 1's lse `[...]`.
      partial: the intra-block partial sum `[..., D]`.
      query: `[D]` or `[..., D]`.
      norm_weight: the key norm's gain `[D]` or None.
      eps, scale: spec options.
      return_lse: also return the merged lse.

    Returns:
      out `[..., D]` (and lse `[...]` if return_lse), equal to
      `depth_attention(phase1_sources + [partial], query, norm_weight)`.
    """
    geo, o1, x, q, g, r, qg, s, z2, l1, w1, w2 = _merge_prepare(out1, lse1, partial, query, norm_weight,
                                                                eps, scale)
    out = w1[..., None] * o1 + w2[..., None] * x[0, ..., 0, :]
    if not return_lse:
        return out
    m = np.maximum(l1, z2)
    with np.errstate(invalid="ignore"):
        lse = m + np.log(np.exp(l1 - m) + np.exp(z2 - m))
    return out, lse


@_SILENT_NONFINITE
def merge_partial_vjp(out1, lse1, partial, query, norm_weight, d_out, d_lse=None, *,
                      eps: float = 1e-6, scale: float = 1.0) -> Dict[str, Optional[np.ndarray]]:
    """VJP of `merge_partial`; returns "out1", "lse1", "partial", "query", "norm_weight"."""
    geo, o1, x, q, g, r, qg, s, z2, l1, w1, w2 = _merge_prepare(out1, lse1, partial, query, norm_weight,
                                                                eps, scale)
    validation.check_cotangent("d_out", np.shape(d_out), geo.batch_shape + (geo.dim,))
    if d_lse is not None:
        validation.check_cotangent("d_lse", np.shape(d_lse), geo.batch_shape)
    d_out = np.asarray(d_out, dtype=np.float64)
    xp = x[0, ..., 0, :]
    dw1 = np.sum(d_out * (o1 - xp), axis=-1)
    d_delta = dw1 * w1 * w2  # delta = lse1 - z2
    d_l1 = d_delta
    d_z2 = -d_delta
    if d_lse is not None:
        dl = np.asarray(d_lse, dtype=np.float64)
        d_l1 = d_l1 + dl * w1
        d_z2 = d_z2 + dl * w2
    rr, ss = r[0, ..., 0], s[0, ..., 0]
    qg_ = qg[..., 0, :]
    d_partial = w2[..., None] * d_out + (d_z2 * scale)[..., None] * (
        rr[..., None] * qg_ - ((ss * rr) * rr / geo.dim)[..., None] * (rr[..., None] * xp))  # C10.6: no r^3
    dqg = (d_z2 * scale * rr)[..., None] * xp
    g1 = g[0]
    q1 = q[..., 0, :]
    tok_axes = tuple(range(len(geo.batch_shape)))
    dq = dqg * g1 if geo.per_token_query else np.sum(dqg * g1, axis=tok_axes)
    dg = np.sum(dqg * q1, axis=tok_axes)
    return {
        "out1": w1[..., None] * d_out,
        "lse1": d_l1,
        "partial": d_partial,
        "query": dq.reshape(np.shape(query)),
        "norm_weight": None if norm_weight is None else dg,
    }
