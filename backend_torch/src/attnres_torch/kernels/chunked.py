"""Implementation "chunked": the chunked torch kernel of the default op (softmax, key norm, one
head; spec 2.1-2.3, C10), the CPU fallback of the fused C kernel (`cpu_c.py`) and the kernel of
sources strided along D.  This module owns its support check (`refusal`), its host code and its
custom-op bodies (registered by `dispatch` as `attnres::chunked_*`).  No merge
kernel (`merge` is None) and no fused output norm: such calls take the composition.

Tokens are processed in chunks of C rows so that one chunk of a source (`[C, D]` fp32) plus the
fp32 accumulator stay in cache: each source is read from memory once per pass, every statistic
is fp32, and no `[N, T, D]` stack or normalized copy of the sources is ever built.  Only `[C, D]`
chunk buffers and `[N, C]` statistics are allocated, once per call.  Phase 1 (`multi_forward_into`)
uses an online softmax over depth (running max m, running sum l, accumulators `[S, C, D]`).

The `*_into` functions take 2-D views: sources N x `[T, D]`, query*gain `qg` as `[D]` or per
token `[T, D]` (fp32), and write into caller-provided buffers (so tests can NaN-poison them); the
op bodies at the end flatten `[..., D]` arguments to them and allocate the outputs.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .. import _rows
from .._args import autocast_off

NAME = "chunked"
#: The device the automatic choice needs every tensor on (a forced call runs on any).
DEVICE_TYPE = "cpu"
#: No phase-2 merge kernel: merge_partial takes the composition.
merge = None

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


def _token_rows(t: Optional[torch.Tensor], t0: int, t1: int) -> Optional[torch.Tensor]:
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
        q = _token_rows(qg, t0, t1)
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
        q = _token_rows(qg, t0, t1)
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


# -- the implementation: support check and custom-op bodies --------------------------------------

def unavailable_reason() -> Optional[str]:
    """None: plain torch, it serves calls everywhere."""
    return None


def refusal(call) -> Optional[str]:
    """None when this kernel takes `call` (a `dispatch.Call`), else why not."""
    if not call.default_op:
        return ("the chunked kernel covers only softmax, key_norm, num_heads=1 and "
                "float16/bfloat16/float32 sources")
    if call.out_norm:
        return "it has no fused output norm (out_norm_weight, C17); the composition serves such calls"
    return None


def _forward(sources, query, norm_weight, eps, scale, with_weights):
    out, _, lse, weights = _rows.forward_outputs(sources, with_weights, False)
    with autocast_off(out.device):
        forward_into([_rows.flat(s) for s in sources], _rows.qg(query, norm_weight), eps, scale,
                     _rows.flat(out), lse.view(-1),
                     None if weights is None else weights.view(len(sources), -1))
    return out, lse, weights


def depth_attention(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor], eps: float,
                    scale: float, save: str) -> tuple[Tensor, Tensor]:
    """out `[..., D]` (sources' dtype), lse `[...]` fp32 (spec 2.1)."""
    return _forward(sources, query, norm_weight, eps, scale, False)[:2]


def depth_attention_weights(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                            eps: float, scale: float, save: str) -> tuple[Tensor, Tensor, Tensor]:
    """`depth_attention` plus the weights `[N, ...]` fp32 of that lse (same logits, max, sum)."""
    return _forward(sources, query, norm_weight, eps, scale, True)


def depth_attention_backward(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                             out: Optional[Tensor], lse: Tensor, d_out: Tensor,
                             d_lse: Optional[Tensor], eps: float, scale: float) -> List[Tensor]:
    """[d_source_0 .. d_source_{N-1} (sources' dtype), d_query fp32 (query's shape),
    d_norm_weight fp32 `[D]`] (spec 2.3); `out` is not read (delta comes from the sources)."""
    d_src = _rows.source_grads(sources)
    with autocast_off(query.device):
        d_qg = backward_into([_rows.flat(s) for s in sources], _rows.qg(query, norm_weight),
                             lse.reshape(-1).contiguous(),
                             _rows.unit_rows(_rows.flat(d_out), sources[0].dtype),
                             None if d_lse is None else d_lse.reshape(-1).float().contiguous(),
                             eps, scale, [_rows.flat(d) for d in d_src])
    return d_src + _rows.query_grads(d_qg, query, norm_weight)


def depth_attention_multi(sources: List[Tensor], queries: Tensor, norm_weights: Optional[Tensor],
                          eps: float, scale: float, save: str) -> tuple[Tensor, Tensor]:
    """Phase 1 (spec 3.1): queries `[S, D]` -> out `[S, ..., D]`, lse `[S, ...]` fp32."""
    return _rows.multi(multi_forward_into, sources, queries, norm_weights, eps, scale)


def reads_out(dtype: torch.dtype, out_norm: bool) -> bool:
    return False  # delta is recomputed from the sources in fp32
