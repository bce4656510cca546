"""The compiled ops twin: forward and backward math of the spec's ops in plain `mlx.core`.

This is the path that runs wherever Metal is unavailable (and the oracle-checked twin of the
Metal kernels).  Every function takes arrays already in the compute dtype (float32, or float64
for float64 sources, C10) and in *broadcast form*:

* sources `xs`: N arrays `[..., H, Dh]` (heads split off the last axis);
* `qg = query * norm_weight` broadcastable against a source (`[H, Dh]`, `[..., H, Dh]`, or for
  the two-phase op `[S, 1.., H, Dh]` against sources `[1, ..., H, Dh]`);
* `rs`: per source either None (the inverse RMS is computed here) or a cached inverse RMS
  `[..., H]` (the router's sealed blocks).

Math (spec 2.1/2.3): r_i = 1/sqrt(mean(x_i^2) + eps), s_i = <qg, x_i>, z_i = scale r_i s_i,
p = softmax_i(z) or sigmoid(z), out = sum_i p_i x_i, lse = logsumexp_i z.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx

_E = 2.718281828459045


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


def sum_to(a: mx.array, shape: Sequence[int]) -> mx.array:
    """Sum a broadcast result back to `shape` (the inverse of broadcasting)."""
    lead = a.ndim - len(shape)
    if lead:
        a = a.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and a.shape[i] != 1)
    return a.sum(axis=axes, keepdims=True) if axes else a


def inverse_rms(x: mx.array, eps: float) -> mx.array:
    """r = 1 / sqrt(mean(x^2) + eps) over the last axis: `[..., Dh]` -> `[...]`."""
    return mx.rsqrt(mx.mean(x * x, axis=-1) + eps)


def _stats(x, qg, r, *, eps, scale, key_norm):
    """(r, s, z) of one source; r is None when key_norm=False (r = 1)."""
    s = mx.sum(qg * x, axis=-1)
    if not key_norm:
        return None, s, scale * s
    if r is None:
        r = inverse_rms(x, eps)
    return r, s, scale * r * s


def _key_grad(x, qg, r, s, *, scale, with_rms_path):
    """dz/dx `[..., H, Dh]`: scale (r qg - s r^3 x / Dh); the r-path is dropped for a cached r
    (its gradient leaves through d r instead) and r = 1 without key norm."""
    if r is None:
        return scale * qg
    if not with_rms_path:
        return scale * r[..., None] * qg
    return scale * (r[..., None] * qg - (s * r ** 3)[..., None] * x / x.shape[-1])


def _weights_lse(z: mx.array, activation: str):
    """z `[N, ...]` -> (p `[N, ...]`, lse `[...]` or None).  C12: NaN/inf propagate."""
    if activation == "sigmoid":
        return sigmoid(z), None
    m = mx.max(z, axis=0)
    e = exp(z - m)
    den = mx.sum(e, axis=0)
    return e / den, m + mx.log(den)


def attend_forward(xs: List[mx.array], qg: mx.array, rs: Sequence[Optional[mx.array]], *,
                   eps: float, scale: float, activation: str, key_norm: bool):
    """Returns out `[..., H, Dh]`, p `[N, ..., H]`, lse `[..., H]` (None for sigmoid)."""
    z = mx.stack([_stats(x, qg, r, eps=eps, scale=scale, key_norm=key_norm)[2]
                  for x, r in zip(xs, rs)])
    p, lse = _weights_lse(z, activation)
    out = p[0][..., None] * xs[0]
    for i in range(1, len(xs)):
        out = out + p[i][..., None] * xs[i]
    return out, p, lse


def attend_backward(xs: List[mx.array], qg: mx.array, rs: Sequence[Optional[mx.array]],
                    g_out: mx.array, d_lse: Optional[mx.array], *, eps: float, scale: float,
                    activation: str, key_norm: bool):
    """VJP of `attend_forward` (spec 2.3).  g_out `[..., H, Dh]`, d_lse `[..., H]` or None.

    Returns (dxs: N broadcast-shaped `[..., H, Dh]`, dqg (broadcast shape), drs: per source
    d r `[..., H]` for a cached r, else None).
    """
    stats = [_stats(x, qg, r, eps=eps, scale=scale, key_norm=key_norm) for x, r in zip(xs, rs)]
    p, _ = _weights_lse(mx.stack([z for _, _, z in stats]), activation)
    dp = mx.stack([mx.sum(g_out * x, axis=-1) for x in xs])
    if activation == "softmax":
        out = p[0][..., None] * xs[0]
        for i in range(1, len(xs)):
            out = out + p[i][..., None] * xs[i]
        dz = p * (dp - mx.sum(g_out * out, axis=-1))
        if d_lse is not None:
            dz = dz + p * d_lse
    else:
        dz = dp * p * (1.0 - p)
    dxs, drs, dqg = [], [], None
    for i, (x, cached, (r, s, _)) in enumerate(zip(xs, rs, stats)):
        dkey = _key_grad(x, qg, r, s, scale=scale, with_rms_path=cached is None)
        dxs.append(p[i][..., None] * g_out + dz[i][..., None] * dkey)
        drs.append(None if cached is None else dz[i] * scale * s)
        w = dz[i] * scale if r is None else dz[i] * scale * r
        term = w[..., None] * x
        dqg = term if dqg is None else dqg + term
    return dxs, dqg, drs


def merge_forward(o1, l1, x, qg, *, eps: float, scale: float):
    """Phase 2 (spec 3.2) in the compute dtype: o1, x `[..., D]`; l1 `[...]`; qg broadcastable.

    Returns (out `[..., D]`, lse `[...]`).
    """
    _, _, z2 = _stats(x, qg, None, eps=eps, scale=scale, key_norm=True)
    w1 = sigmoid(l1 - z2)
    m = mx.maximum(l1, z2)
    lse = m + mx.log(exp(l1 - m) + exp(z2 - m))
    return w1[..., None] * o1 + (1.0 - w1)[..., None] * x, lse


def merge_backward(o1, l1, x, qg, d_out, d_lse, *, eps: float, scale: float):
    """VJP of `merge_forward`: returns (d_o1, d_l1, d_x, dqg) in broadcast shapes."""
    r, s, z2 = _stats(x, qg, None, eps=eps, scale=scale, key_norm=True)
    w1 = sigmoid(l1 - z2)
    w2 = 1.0 - w1
    d_delta = mx.sum(d_out * (o1 - x), axis=-1) * w1 * w2  # delta = lse1 - z2
    d_l1, d_z2 = d_delta, -d_delta
    if d_lse is not None:
        d_l1 = d_l1 + d_lse * w1
        d_z2 = d_z2 + d_lse * w2
    dkey = _key_grad(x, qg, r, s, scale=scale, with_rms_path=True)
    d_x = w2[..., None] * d_out + d_z2[..., None] * dkey
    dqg = (d_z2 * scale * r)[..., None] * x
    return w1[..., None] * d_out, d_l1, d_x, dqg
