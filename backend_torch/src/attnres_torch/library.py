"""`torch.library` custom ops of the fast paths ("triton", "cpu_c" and "cpu"), with fake implementations
and explicit autograd, so `torch.compile(fullgraph=True)` treats them as single graph nodes and
CUDA graphs can capture them.

Ops (namespace `attnres`):
  depth_attention(sources N x [..., D], query [D] | [..., D], norm_weight [D]?, eps, scale, impl)
      -> (out [..., D] source dtype, lse [...] fp32)
  depth_attention_backward(sources, query, norm_weight, out, lse, d_out, d_lse?, eps, scale, impl)
      -> [d_source_0 .. d_source_{N-1}, d_query (fp32, query's shape), d_norm_weight (fp32 [D])]
  depth_attention_multi(sources, queries [S, D], norm_weights [S, D]?, eps, scale, impl)
      -> (out [S, ..., D] source dtype, lse [S, ...] fp32)
The backward saves only references to the inputs, the output and the fp32 lse (no stacked or
normalized copy of the sources); rms inverses are recomputed chunk by chunk.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from . import cpu_c, cpu_kernel, dispatch


def _qg(query: Tensor, norm_weight: Optional[Tensor]) -> Tensor:
    """query * gain in fp32, `[D]` or per-token flattened to `[T, D]`."""
    q = query.float() if norm_weight is None else query.float() * norm_weight.float()
    return q if q.dim() == 1 else q.reshape(-1, q.shape[-1])


def _flat(t: Tensor) -> Tensor:
    """`[..., D]` -> `[T, D]` (a view when the strides allow it)."""
    return t.reshape(-1, t.shape[-1])


def _cpu_module(impl: str):
    """The CPU kernel module behind `impl` ("cpu_c" or "cpu"); both share one interface."""
    return cpu_c if impl == "cpu_c" else cpu_kernel


def _unit_rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`[T, D]` in `dtype` with unit stride along D (a broadcast d_out may arrive with stride 0)."""
    t = t.to(dtype)
    return t if t.numel() == 0 or t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("attnres::depth_attention", mutates_args=())
def depth_attention_op(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                       eps: float, scale: float, impl: str) -> tuple[Tensor, Tensor]:
    if impl == "triton":
        out, lse = dispatch.triton_kernels().forward(list(sources), query, norm_weight, eps, scale)
        return out.contiguous(), lse.contiguous()
    x0 = sources[0]
    out = torch.empty(x0.shape, dtype=x0.dtype, device=x0.device)
    lse = torch.empty(x0.shape[:-1], dtype=torch.float32, device=x0.device)
    _cpu_module(impl).forward_into([_flat(s) for s in sources], _qg(query, norm_weight).contiguous(),
                                   eps, scale, _flat(out), lse.view(-1))
    return out, lse


@depth_attention_op.register_fake
def _(sources, query, norm_weight, eps, scale, impl):
    x0 = sources[0]
    return x0.new_empty(x0.shape), x0.new_empty(x0.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("attnres::depth_attention_backward", mutates_args=())
def depth_attention_backward_op(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                                out: Tensor, lse: Tensor, d_out: Tensor, d_lse: Optional[Tensor],
                                eps: float, scale: float, impl: str) -> List[Tensor]:
    dim = query.shape[-1]
    if impl == "triton":
        d_src, d_q, d_g = dispatch.triton_kernels().backward(
            list(sources), query, norm_weight, out, lse, d_out, d_lse, eps, scale)
        if d_g is None:
            d_g = torch.zeros(dim, dtype=torch.float32, device=query.device)
        return [d.contiguous() for d in d_src] + [d_q.float().contiguous(), d_g.float().contiguous()]
    d_src = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in sources]
    d_qg = _cpu_module(impl).backward_into(
        [_flat(s) for s in sources], _qg(query, norm_weight).contiguous(), lse.reshape(-1).contiguous(),
        _unit_rows(_flat(d_out), sources[0].dtype),
        None if d_lse is None else d_lse.reshape(-1).float().contiguous(), eps, scale,
        [_flat(d) for d in d_src])
    gain = torch.ones(dim, device=query.device) if norm_weight is None else norm_weight.float()
    d_query = (d_qg * gain).reshape(query.shape)
    d_gain = (d_qg * query.float().reshape(d_qg.shape)).reshape(-1, dim).sum(0)
    return d_src + [d_query, d_gain]


@depth_attention_backward_op.register_fake
def _(sources, query, norm_weight, out, lse, d_out, d_lse, eps, scale, impl):
    return ([s.new_empty(s.shape) for s in sources]
            + [query.new_empty(query.shape, dtype=torch.float32),
               query.new_empty((query.shape[-1],), dtype=torch.float32)])


def _setup(ctx, inputs, output):
    """Saved for both custom ops: references to the inputs and the (out, lse) outputs only."""
    sources, query, norm_weight, eps, scale, impl = inputs
    ctx.save_for_backward(*sources, query, norm_weight, *output)
    ctx.num_sources, ctx.has_gain = len(sources), norm_weight is not None
    ctx.eps, ctx.scale, ctx.impl = eps, scale, impl


def _saved(ctx):
    """What `_setup` saved: (sources list, query(ies), norm weight(s) or None, out, lse)."""
    saved, n = ctx.saved_tensors, ctx.num_sources
    return list(saved[:n]), saved[n], saved[n + 1], saved[n + 2], saved[n + 3]


def _backward(ctx, d_out, d_lse):
    n = ctx.num_sources
    sources, query, norm_weight, out, lse = _saved(ctx)
    if d_out is None:
        d_out = torch.zeros_like(out)
    grads = depth_attention_backward_op(sources, query, norm_weight, out, lse, d_out, d_lse,
                                        ctx.eps, ctx.scale, ctx.impl)
    d_gain = grads[n + 1].to(norm_weight.dtype) if ctx.has_gain else None
    return grads[:n], grads[n].to(query.dtype), d_gain, None, None, None


depth_attention_op.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("attnres::depth_attention_multi", mutates_args=())
def depth_attention_multi_op(sources: List[Tensor], queries: Tensor, norm_weights: Optional[Tensor],
                             eps: float, scale: float, impl: str) -> tuple[Tensor, Tensor]:
    if impl == "triton":
        out, lse = dispatch.triton_kernels().multi_forward(list(sources), queries, norm_weights,
                                                          eps, scale)
        return out.contiguous(), lse.contiguous()
    x0 = sources[0]
    num_q = queries.shape[0]
    out = torch.empty((num_q,) + tuple(x0.shape), dtype=x0.dtype, device=x0.device)
    lse = torch.empty((num_q,) + tuple(x0.shape[:-1]), dtype=torch.float32, device=x0.device)
    qgs = queries.float() if norm_weights is None else queries.float() * norm_weights.float()
    _cpu_module(impl).multi_forward_into([_flat(s) for s in sources], qgs.contiguous(), eps, scale,
                                         out.view(num_q, -1, x0.shape[-1]), lse.view(num_q, -1))
    return out, lse


def merge_cpu_c(out1: Tensor, lse1: Tensor, partial: Tensor, query: Tensor,
                norm_weight: Optional[Tensor], eps: float, scale: float) -> tuple[Tensor, Tensor]:
    """`merge_partial` (no gradient) on the C kernel: out `[..., D]` in partial's dtype and lse
    `[...]` fp32.  Not a custom op: callers keep it out of torch.compile traces."""
    out = torch.empty(partial.shape, dtype=partial.dtype)
    lse = torch.empty(partial.shape[:-1], dtype=torch.float32)
    cpu_c.merge_forward_into(_flat(out1), lse1.float().reshape(-1).contiguous(), _flat(partial),
                             _qg(query, norm_weight).contiguous(), eps, scale, _flat(out),
                             lse.view(-1))
    return out, lse


@depth_attention_multi_op.register_fake
def _(sources, queries, norm_weights, eps, scale, impl):
    x0 = sources[0]
    num_q = queries.shape[0]
    return (x0.new_empty((num_q,) + tuple(x0.shape)),
            x0.new_empty((num_q,) + tuple(x0.shape[:-1]), dtype=torch.float32))


def _backward_multi(ctx, d_out, d_lse):
    """Sum over the S queries of the single-query backward (phase 1 is the inference path)."""
    n = ctx.num_sources
    sources, queries, norm_weights, out, lse = _saved(ctx)
    if d_out is None:
        d_out = torch.zeros_like(out)
    d_src, d_q, d_g = None, [], []
    for s in range(queries.shape[0]):
        grads = depth_attention_backward_op(
            sources, queries[s], None if norm_weights is None else norm_weights[s], out[s], lse[s],
            d_out[s], None if d_lse is None else d_lse[s], ctx.eps, ctx.scale, ctx.impl)
        d_src = grads[:n] if d_src is None else [a + b for a, b in zip(d_src, grads[:n])]
        d_q.append(grads[n])
        d_g.append(grads[n + 1])
    d_gains = torch.stack(d_g).to(norm_weights.dtype) if ctx.has_gain else None
    return d_src, torch.stack(d_q).to(queries.dtype), d_gains, None, None, None


depth_attention_multi_op.register_autograd(_backward_multi, setup_context=_setup)
