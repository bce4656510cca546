"""The chunked torch kernel of the default op (softmax, key norm, one head; spec 2.1-2.3, C10):
implementation "chunked" of `dispatch.py`, the CPU fallback of the fused C kernel (`cpu_c.py`).

Tokens are processed in chunks of C rows so that one chunk of a source (`[C, D]` fp32) plus the
fp32 accumulator stay in cache: each source is read from memory once per pass, every statistic
is fp32, and no `[N, T, D]` stack or normalized copy of the sources is ever built.  Only `[C, D]`
chunk buffers and `[N, C]` statistics are allocated, once per call.  Phase 1 (`multi_forward_into`)
uses an online softmax over depth (running max m, running sum l, accumulators `[S, C, D]`).

All functions take 2-D views: sources N x `[T, D]`, query*gain `qg` as `[D]` or per token
`[T, D]` (fp32), and write into caller-provided buffers (so tests can NaN-poison them).
"""

from __future__ import annotations

from typing import List, Optional

import torch

#: Bytes of one fp32 source chunk `[C, D]`; C = CHUNK_BYTES // (4 D), at least 1 row.
CHUNK_BYTES = 1 << 21


def chunk_rows(dim: int) -> int:
    return max(1, CHUNK_BYTES // (4 * dim))


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a_t, b> per row: a `[C, D]`, b `[D]` (a matrix-vector product) or `[C, D]` -> `[C]`."""
    if b.dim() == 1:
        return a @ b
    return torch.linalg.vecdot(a, b)


def _rms_inv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """r = 1 / sqrt(mean(x^2) + eps) per row, `[C]` fp32.  Rows whose fp32 sum of squares
    overflows (|x| >= ~1.8e19) take it in float64 instead: the key norm is scale-invariant and
    must not collapse to r = 0 (C10.6).  One check per chunk; no cost otherwise."""
    ms = torch.linalg.vector_norm(x, dim=-1).square_().div_(x.shape[-1])
    r = torch.rsqrt(ms + eps)
    big = torch.isinf(ms)
    if bool(big.any()):
        r[big] = torch.rsqrt(x[big].double().square().mean(-1) + eps).float()
    return r


def _f32(chunk: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The chunk in fp32: itself when already fp32, else converted into the reused buffer."""
    return chunk if chunk.dtype == torch.float32 else buf[: chunk.shape[0]].copy_(chunk)


def _rows(t: Optional[torch.Tensor], t0: int, t1: int) -> Optional[torch.Tensor]:
    """Token rows of a per-token tensor; a `[D]` pseudo-query is shared by every row."""
    return t if t is None or t.dim() == 1 else t[t0:t1]


@torch.no_grad()
def forward_into(sources: List[torch.Tensor], qg: torch.Tensor, eps: float, scale: float,
                 out: torch.Tensor, lse: torch.Tensor,
                 weights: Optional[torch.Tensor] = None) -> None:
    """out `[T, D]` (source dtype) and lse `[T]` (fp32) of depth attention over N x `[T, D]`;
    with `weights` (`[N, T]` fp32) also the softmax weights p of that lse (same logits, max and
    sum: they sum to 1, and are exactly 1 at N = 1).

    Per chunk: pass 1 reads each source chunk once from memory for its logits z `[N, C]`
    (r and <qg, x> per row); softmax over depth in fp32; pass 2 accumulates sum_i p_i x_i from
    the chunks still in cache, straight into `out` when it is fp32.
    """
    rows, dim = sources[0].shape
    step = chunk_rows(dim)
    x_buf, acc_buf = (torch.empty(min(step, rows), dim, device=out.device) for _ in range(2))
    z = torch.empty(len(sources), min(step, rows), device=out.device)  # [N, C]
    direct = out.dtype == torch.float32 and out.is_contiguous()
    for t0 in range(0, rows, step):
        t1 = min(rows, t0 + step)
        q = _rows(qg, t0, t1)
        zc = z[:, : t1 - t0]
        for i, src in enumerate(sources):
            x = _f32(src[t0:t1], x_buf)
            torch.mul(_rowdot(x, q), _rms_inv(x, eps), out=zc[i]).mul_(scale)
        m = zc.amax(0)  # [C]
        p = torch.exp(zc - m)
        l = p.sum(0)
        p.div_(l)
        lse[t0:t1] = m + torch.log(l)
        if weights is not None:
            weights[:, t0:t1] = p
        acc = out[t0:t1] if direct else acc_buf[: t1 - t0]
        torch.mul(_f32(sources[0][t0:t1], x_buf), p[0].unsqueeze(1), out=acc)
        for i in range(1, len(sources)):
            acc.addcmul_(_f32(sources[i][t0:t1], x_buf), p[i].unsqueeze(1))
        if not direct:
            out[t0:t1].copy_(acc)


@torch.no_grad()
def backward_into(sources: List[torch.Tensor], qg: torch.Tensor, lse: torch.Tensor,
                  d_out: torch.Tensor, d_lse: Optional[torch.Tensor], eps: float, scale: float,
                  d_sources: List[torch.Tensor]) -> torch.Tensor:
    """Writes d_sources N x `[T, D]` (source dtype); returns d(qg) in fp32 (`[D]` summed over
    tokens, or `[T, D]` for a per-token query).

    Per row (spec 2.3): p_i = exp(z_i - lse), dp_i = <d_out, x_i>, dz_i = p_i (dp_i - sum_j p_j dp_j
    + d_lse), dx_i = p_i d_out + a_i qg - b_i x_i with a_i = scale dz_i r_i, b_i = a_i s_i r_i^2 / D,
    d(qg) = sum_i a_i x_i.  Pass 1 over the chunk's sources gathers the `[N, C]` statistics; pass 2
    (the chunks still in cache) writes dx.  `<d_out, out>` is formed as sum_j p_j dp_j in fp32, so
    the rounding of out to a low-precision dtype never enters the gradient.
    """
    rows, dim = sources[0].shape
    step = chunk_rows(dim)
    d_qg = torch.zeros(qg.shape, dtype=torch.float32, device=qg.device)
    g_buf, x_buf, dx_buf = (torch.empty(min(step, rows), dim, device=qg.device) for _ in range(3))
    for t0 in range(0, rows, step):
        t1 = min(rows, t0 + step)
        q = _rows(qg, t0, t1)
        g = _f32(d_out[t0:t1], g_buf)
        lse_c = lse[t0:t1]
        stats = []  # (r, s, p, dp) per source, each [C]
        for src in sources:
            x = _f32(src[t0:t1], x_buf)
            r, s = _rms_inv(x, eps), _rowdot(x, q)
            stats.append((r, s, torch.exp(s * r * scale - lse_c), _rowdot(x, g)))
        base = -sum(p * dp for _, _, p, dp in stats)  # -<d_out, out>  [C]
        if d_lse is not None:
            base += d_lse[t0:t1]
        d_q = d_qg if qg.dim() == 1 else d_qg[t0:t1]
        for src, dst, (r, s, p, dp) in zip(sources, d_sources, stats):
            x = _f32(src[t0:t1], x_buf)
            a = p * (dp + base) * (scale * r)
            b = a * s * r * r / dim
            direct = dst.dtype == torch.float32 and dst.is_contiguous()
            dx = torch.mul(g, p.unsqueeze(1), out=dst[t0:t1] if direct else dx_buf[: t1 - t0])
            dx.addcmul_(x, b.unsqueeze(1), value=-1.0)
            if q.dim() == 1:
                dx.addr_(a, q)
                d_q.addmv_(x.t(), a)
            else:
                dx.addcmul_(q, a.unsqueeze(1))
                d_q.addcmul_(x, a.unsqueeze(1))
            if not direct:
                dst[t0:t1].copy_(dx)
    return d_qg


def _multi_logits(x: torch.Tensor, qgs: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    """z `[S, C]` of one source chunk x `[C, D]` for S queries qgs `[S, D]`."""
    return (qgs @ x.t()).mul_(_rms_inv(x, eps)).mul_(scale)


@torch.no_grad()
def multi_forward_into(sources: List[torch.Tensor], qgs: torch.Tensor, eps: float, scale: float,
                       out: torch.Tensor, lse: torch.Tensor) -> None:
    """Phase 1 (spec 3.1): S pseudo-queries qgs `[S, D]` (fp32) over N x `[T, D]`, each source
    chunk read once for all S; writes out `[S, T, D]` (source dtype) and lse `[S, T]` (fp32)."""
    rows, dim = sources[0].shape
    step = chunk_rows(dim)
    acc_buf = torch.empty(qgs.shape[0], min(step, rows), dim, device=out.device)
    x_buf = torch.empty(min(step, rows), dim, device=out.device)
    for t0 in range(0, rows, step):
        t1 = min(rows, t0 + step)
        first = _f32(sources[0][t0:t1], x_buf)
        m = _multi_logits(first, qgs, eps, scale)  # [S, C]
        acc = acc_buf[:, : t1 - t0].copy_(first.unsqueeze(0))  # [S, C, D]
        l = torch.ones_like(m)
        for src in sources[1:]:
            x = _f32(src[t0:t1], x_buf)
            z = _multi_logits(x, qgs, eps, scale)
            m_new = torch.maximum(m, z)
            alpha = torch.exp(m - m_new)
            p = torch.exp(z - m_new)
            l = l.mul_(alpha).add_(p)
            acc.mul_(alpha.unsqueeze(2)).addcmul_(x.unsqueeze(0), p.unsqueeze(2))
            m = m_new
        out[:, t0:t1].copy_(acc.div_(l.unsqueeze(2)))
        lse[:, t0:t1] = m + torch.log(l)
