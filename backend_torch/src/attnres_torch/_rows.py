"""Row views and buffers of the CPU kernel implementations (`kernels/cpu_c.py`, `kernels/chunked.py`).

Their kernels take 2-D `[T, D]` views, query * gain in fp32 and caller-provided outputs; these
helpers flatten the token axes, allocate the outputs and turn a kernel's d(query * gain) into
d_query and d_norm_weight.  Each returns before the kernel runs or after it; `multi`, the phase-1
op body both implementations share, calls the `multi_forward_into` it is given.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._args import autocast_off


def flat(t: Tensor) -> Tensor:
    """`[..., D]` -> `[T, D]` (a view when the strides allow it)."""
    return t.reshape(-1, t.shape[-1])


def qg(query: Tensor, norm_weight: Optional[Tensor]) -> Tensor:
    """query * gain in fp32, contiguous: `[D]`, or a per-token query flattened to `[T, D]`
    (queries `[S, D]` with gains `[S, D]`: `[S, D]`)."""
    q = query.float() if norm_weight is None else query.float() * norm_weight.float()
    return (q if q.dim() == 1 else flat(q)).contiguous()


def unit_rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`[T, D]` in `dtype` with unit stride along D (a broadcast d_out may arrive with stride 0)."""
    t = t.to(dtype)
    return t if t.numel() == 0 or t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous()


def query_grads(d_qg: Tensor, query: Tensor, norm_weight: Optional[Tensor]) -> List[Tensor]:
    """[d_query fp32 (query's shape), d_norm_weight fp32 `[D]`] from a CPU kernel's d(query * gain)
    (`[D]` summed over tokens, or `[T, D]` for a per-token query)."""
    dim = query.shape[-1]
    gain = torch.ones(dim, device=query.device) if norm_weight is None else norm_weight.float()
    d_query = (d_qg * gain).reshape(query.shape)
    d_gain = (d_qg * query.float().reshape(d_qg.shape)).reshape(-1, dim).sum(0)
    return [d_query, d_gain]


def forward_outputs(sources: List[Tensor], with_weights: bool,
                    out_norm: bool) -> Tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]:
    """Empty (out `[..., D]`, out_normed `[..., D]` or None, lse `[...]` fp32, weights `[N, ...]`
    fp32 or None) for N sources `[..., D]`."""
    x0 = sources[0]
    out = torch.empty(x0.shape, dtype=x0.dtype, device=x0.device)
    normed = torch.empty(x0.shape, dtype=x0.dtype, device=x0.device) if out_norm else None
    lse = torch.empty(x0.shape[:-1], dtype=torch.float32, device=x0.device)
    weights = (torch.empty((len(sources),) + tuple(x0.shape[:-1]), dtype=torch.float32,
                           device=x0.device) if with_weights else None)
    return out, normed, lse, weights


def multi_outputs(sources: List[Tensor], num_queries: int) -> Tuple[Tensor, Tensor]:
    """Empty (out `[S, ..., D]`, lse `[S, ...]` fp32) of phase 1 for S queries."""
    x0 = sources[0]
    out = torch.empty((num_queries,) + tuple(x0.shape), dtype=x0.dtype, device=x0.device)
    lse = torch.empty((num_queries,) + tuple(x0.shape[:-1]), dtype=torch.float32, device=x0.device)
    return out, lse


def multi(multi_forward_into, sources: List[Tensor], queries: Tensor,
          norm_weights: Optional[Tensor], eps: float, scale: float) -> Tuple[Tensor, Tensor]:
    """Phase 1 (spec 3.1) on an implementation's `multi_forward_into(rows, qg, eps, scale, out,
    lse)`: queries `[S, D]` -> out `[S, ..., D]`, lse `[S, ...]` fp32."""
    num_q, dim = queries.shape
    out, lse = multi_outputs(sources, num_q)
    with autocast_off(queries.device):
        multi_forward_into([flat(s) for s in sources], qg(queries, norm_weights), eps, scale,
                           out.view(num_q, -1, dim), lse.view(num_q, -1))
    return out, lse


def source_grads(sources: List[Tensor]) -> List[Tensor]:
    """Empty d_sources, each shaped, typed and placed like its source."""
    return [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in sources]
