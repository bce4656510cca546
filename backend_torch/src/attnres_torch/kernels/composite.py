"""The plain differentiable torch composition of the ops (spec section 2; the comparison baseline).

Everything is computed in the compute dtype (C10: float32, float64 for float64 sources) with
autograd doing the backward.  It stacks the sources into `[N, ..., D]`, which is exactly what the
fast paths avoid; it covers every option (heads, sigmoid, no key norm, per-token query).
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[..., D]` -> `[..., H, Dh]`."""
    return x.unflatten(-1, (num_heads, x.shape[-1] // num_heads))


def _pow2_scale(x: torch.Tensor) -> torch.Tensor:
    """a = 2^e `[..., 1]` (detached): the power of two just above max|x| over the last axis,
    1 when max|x| < 1, at most 2^127 (fp32) / 2^1023 (float64) so that it stays finite."""
    with torch.no_grad():
        _, e = torch.frexp(x.abs().amax(-1, keepdim=True))
        top = int(math.log2(torch.finfo(x.dtype).max))
        return torch.ldexp(torch.ones_like(x[..., :1]), e.clamp(0, top))


def logits(sources: List[torch.Tensor], query, norm_weight, *, eps, scale, num_heads, key_norm,
           cdtype) -> torch.Tensor:
    """z `[N, ..., H]` in `cdtype` (spec 2.1: z_i = scale * r_i * <q * g, x_i>)."""
    x = _heads(torch.stack([s.to(cdtype) for s in sources]), num_heads)  # [N, ..., H, Dh]
    qg = query.to(cdtype) if norm_weight is None else query.to(cdtype) * norm_weight.to(cdtype)
    if not key_norm:
        return scale * (x * _heads(qg, num_heads)).sum(-1)
    # z = scale r <qg, x> evaluated on y = x / a (a = 2^e, exact): z = scale rho <qg, y> with
    # rho = (mean(y^2) + eps / a^2)^(-1/2) = a r.  Every factor is of order 1 whatever the
    # sources' magnitude, so neither the sum of squares (|x| >= ~1.8e19 in fp32, C10.6) nor
    # autograd's chain (r^3 and s dz: underflow / overflow from |x| ~ 1e13 in fp32) leave the
    # range; equal to the plain formula for max|x| < 1 (a = 1).
    a = _pow2_scale(x)
    y = x / a
    rho = torch.rsqrt(y.square().mean(-1) + eps / a[..., 0].square())
    return scale * rho * (y * _heads(qg, num_heads)).sum(-1)


def _depth_attention(sources: List[torch.Tensor], query, norm_weight: Optional[torch.Tensor], *,
                     eps: float, scale: float, num_heads: int, activation: str, key_norm: bool):
    """(y `[..., D]` in the compute dtype, before out's rounding; lse; weights)."""
    cdtype = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    z = logits(sources, query, norm_weight, eps=eps, scale=scale, num_heads=num_heads,
               key_norm=key_norm, cdtype=cdtype)
    p = torch.softmax(z, 0) if activation == "softmax" else torch.sigmoid(z)
    x = _heads(torch.stack([s.to(cdtype) for s in sources]), num_heads)
    y = (p.unsqueeze(-1) * x).sum(0).flatten(-2)
    lse = torch.logsumexp(z, 0) if activation == "softmax" else None
    return y, lse, p


def depth_attention(sources: List[torch.Tensor], query, norm_weight: Optional[torch.Tensor], *,
                    eps: float, scale: float, num_heads: int, activation: str, key_norm: bool):
    """Returns out `[..., D]` (source dtype), lse `[..., H]` (compute dtype, None for sigmoid) and
    weights `[N, ..., H]` (compute dtype)."""
    y, lse, p = _depth_attention(sources, query, norm_weight, eps=eps, scale=scale,
                                 num_heads=num_heads, activation=activation, key_norm=key_norm)
    return y.to(sources[0].dtype), lse, p


def rms_norm(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(rho y) w over the last axis of y `[..., D]` in y's dtype (C17), rho = (mean(y^2) + eps)^-1/2.

    Evaluated on y / a (a = 2^e `[..., 1]`, exact, detached) as rho' (y / a) with
    rho' = (mean((y / a)^2) + eps / a^2)^-1/2 = a rho: the sum of squares stays finite for every
    finite y (C10.6) and rho y is one factor of order 1 (autograd never forms rho^3 alone)."""
    a = _pow2_scale(y)
    ys = y / a
    rho = torch.rsqrt(ys.square().mean(-1, keepdim=True) + eps / a.square())
    return (rho * ys) * weight.to(y.dtype)


def depth_attention_out_norm(sources: List[torch.Tensor], query, norm_weight, out_norm_weight, *,
                             eps: float, scale: float, num_heads: int, activation: str,
                             key_norm: bool, out_norm_eps: float):
    """`depth_attention` with the fused output norm (C17, spec 2.6): returns out, out_normed
    (`[..., D]`, both in the source dtype; out_normed from the unrounded y over all D channels),
    lse and weights."""
    y, lse, p = _depth_attention(sources, query, norm_weight, eps=eps, scale=scale,
                                 num_heads=num_heads, activation=activation, key_norm=key_norm)
    normed = rms_norm(y, out_norm_weight, out_norm_eps)
    return y.to(sources[0].dtype), normed.to(sources[0].dtype), lse, p


class _LogisticPair(torch.autograd.Function):
    """(w1, w2) = (sigmoid(delta), sigmoid(-delta)), each `[...]` like delta, each from its own
    logistic; backward d_delta = (g1 - g2) w1 w2.  Autograd through sigmoid would form w1 (1 - w1),
    which keeps ~e^-|delta| / 6e-8 of the small weight's bits at |delta| >> 1 (C10.7)."""

    @staticmethod
    def forward(ctx, delta):
        w1, w2 = torch.sigmoid(delta), torch.sigmoid(-delta)
        ctx.save_for_backward(w1, w2)
        return w1, w2

    @staticmethod
    def backward(ctx, g1, g2):
        w1, w2 = ctx.saved_tensors
        return (g1 - g2) * (w1 * w2)


class _MergeLogit(torch.autograd.Function):
    """z2 = scale r <qg, x> `[...]` for x, qg `[..., D]` (the merge's key-normed logit, spec 3.2),
    evaluated on x / a like `logits`; backward in the spec's factored form
    d_x = dz2 (scale (r qg - s r^3 x / D)), d_qg = dz2 (scale r x): the bracket is finite for every
    finite x, so an infinite dz2 (+Inf in out1, C12) gives +-Inf per element, not the NaN of
    autograd's two separate paths (Inf - Inf)."""

    @staticmethod
    def forward(ctx, x, qg, eps, scale):
        a = _pow2_scale(x)
        y = x / a
        rho = torch.rsqrt(y.square().mean(-1) + eps / a[..., 0].square())  # = a r
        sy = (y * qg).sum(-1)  # = s / a
        ctx.save_for_backward(y, qg, a, rho, sy)
        ctx.scale = scale
        return scale * rho * sy

    @staticmethod
    def backward(ctx, dz2):
        y, qg, a, rho, sy = ctx.saved_tensors
        r = rho.unsqueeze(-1) / a  # r = rho / a; r x = rho y; s r^3 x / D = r (sy rho^2 y / D)
        f_x = ctx.scale * r * (qg - (sy * rho * rho / y.shape[-1]).unsqueeze(-1) * y)
        f_q = ctx.scale * rho.unsqueeze(-1) * y
        d = dz2.unsqueeze(-1)
        return d * f_x, d * f_q, None, None


def merge_partial(out1, lse1, partial, query, norm_weight, *, eps: float, scale: float):
    """Phase 2 (spec 3.2): out = w1 * out1 + w2 * partial, w1 = sigmoid(lse1 - z2),
    w2 = sigmoid(z2 - lse1) (not 1 - w1: a small w2 would lose its bits), lse = logaddexp(lse1,
    z2); out in partial's dtype, lse in the compute dtype."""
    cdtype = torch.float64 if partial.dtype == torch.float64 else torch.float32
    x = partial.to(cdtype)
    qg = query.to(cdtype) if norm_weight is None else query.to(cdtype) * norm_weight.to(cdtype)
    z2 = _MergeLogit.apply(x, qg.expand_as(x), eps, scale)  # C12: the factored backward
    l1 = lse1.to(cdtype)
    w1, w2 = _LogisticPair.apply(l1 - z2)
    out = w1.unsqueeze(-1) * out1.to(cdtype) + w2.unsqueeze(-1) * partial.to(cdtype)
    return out.to(partial.dtype), torch.logaddexp(l1, z2)
