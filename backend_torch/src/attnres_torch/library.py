"""The `torch.library` custom ops of the kernel implementations ("triton", "cpu_c", "chunked"),
with fake implementations and explicit autograd, so `torch.compile(fullgraph=True)` treats them as
single graph nodes.  The Triton path has no host sync (its pointer tables are written on the
device by a kernel, fresh per call while a CUDA graph captures), so CUDA graphs can capture it by
design; `bench/gpu_check.py` checks capture and replay on a GPU, which has not run yet.

Ops (namespace `attnres`):
  depth_attention(sources N x [..., D], query [D] | [..., D], norm_weight [D]?, eps, scale, impl,
                  save)
      -> (out [..., D] source dtype, lse [...] fp32)
  depth_attention_weights(same arguments) -> (out, lse, weights [N, ...] fp32 of that lse)
  depth_attention_backward(sources, query, norm_weight, out?, lse, d_out, d_lse?, eps, scale, impl)
      -> [d_source_0 .. d_source_{N-1}, d_query (fp32, query's shape), d_norm_weight (fp32 [D])]
  depth_attention_multi(sources, queries [S, D], norm_weights [S, D]?, eps, scale, impl, save)
      -> (out [S, ..., D] source dtype, lse [S, ...] fp32)
  depth_attention_out_norm(sources, query, norm_weight?, out_norm_weight [D], eps, scale,
                           out_norm_eps, impl, with_weights, save)
      -> (out, out_normed [..., D] source dtype, lse [...] fp32, weights [N, ...] fp32 or [0])
      the fused output norm (C17); its backward op (out? as above) returns
      depth_attention_backward's list plus d_out_norm_weight (fp32 [D]).
`impl` names the implementation `ops.py` chose (`dispatch.choose`); each op looks its object up
once (`dispatch.kernel(impl)`) and calls its entry point.  The backward saves only references to
the inputs, the fp32 lse and, depending on `save` (`SAVE_MODES`), the output (no stacked or
normalized copy of the sources); the kernels recompute the rms inverses.  Only the Triton
backward of fp32 sources without the fused norm reads `out` (`triton_depth.backward_reads_out`);
every other kernel backward recomputes what it needs from the sources and takes out=None:
  "auto"  (`ops`' default) saves `out` exactly where the backward reads it;
  "out"   saves `out` on every kernel (kept alive, read only where "auto" saves it);
  "stats" saves the lse alone; where the backward reads `out` it reruns the forward op first
          (the same kernel on the same inputs: bitwise the saved `out`).
`save` has no default here: a custom op's autograd drops an argument passed at its default.
Every op body runs with autocast disabled (C3a, C10: the chunked kernel's fp32 matmuls must
stay fp32 inside a `torch.autocast` region, in the forward, the backward and inside compiled
graphs); mixed source dtypes are promoted before the ops, in `ops.py`
(`torch.library.register_autocast` casts every input to one fixed dtype, which would round fp32
sources to bf16).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from . import dispatch
from ._args import autocast_off

#: The values of the forward ops' `save` argument (see above; `ops.depth_attention(save=...)`).
SAVE_MODES = ("auto", "out", "stats")


def _reads_out(impl: str, dtype: torch.dtype, out_norm: bool = False) -> bool:
    """Whether kernel `impl`'s backward reads the forward's `out` for sources of `dtype`."""
    if impl != "triton":
        return False  # cpu_c, chunked: delta is recomputed from the sources in fp32
    return dispatch.triton_kernels().backward_reads_out(dtype, out_norm)


def check_save(save) -> None:
    """ValueError unless `save` is one of `SAVE_MODES`."""
    if not isinstance(save, str) or save not in SAVE_MODES:
        raise ValueError(f"save: expected one of {SAVE_MODES}, got {save!r}")


def _keeps_out(save: str, impl: str, dtype: torch.dtype, out_norm: bool = False) -> bool:
    """Whether the forward saves `out` for the backward under `save`."""
    check_save(save)
    return save == "out" or (save == "auto" and _reads_out(impl, dtype, out_norm))


@torch.library.custom_op("attnres::depth_attention", mutates_args=())
def depth_attention_op(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                       eps: float, scale: float, impl: str,
                       save: str) -> tuple[Tensor, Tensor]:
    with autocast_off(query.device):
        return dispatch.kernel(impl).forward(list(sources), query, norm_weight, eps, scale)


@depth_attention_op.register_fake
def _(sources, query, norm_weight, eps, scale, impl, save):
    x0 = sources[0]
    return x0.new_empty(x0.shape), x0.new_empty(x0.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("attnres::depth_attention_backward", mutates_args=())
def depth_attention_backward_op(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                                out: Optional[Tensor], lse: Tensor, d_out: Tensor,
                                d_lse: Optional[Tensor],
                                eps: float, scale: float, impl: str) -> List[Tensor]:
    with autocast_off(query.device):
        return dispatch.kernel(impl).backward(list(sources), query, norm_weight, out, lse, d_out,
                                              d_lse, eps, scale)


@depth_attention_backward_op.register_fake
def _(sources, query, norm_weight, out, lse, d_out, d_lse, eps, scale, impl):
    return ([s.new_empty(s.shape) for s in sources]
            + [query.new_empty(query.shape, dtype=torch.float32),
               query.new_empty((query.shape[-1],), dtype=torch.float32)])


def _setup(ctx, inputs, output):
    """Saved for depth_attention(_weights) and _multi: references to the inputs, lse, and `out`
    where `save` keeps it (else None)."""
    sources, query, norm_weight, eps, scale, impl, save = inputs
    out, lse = output
    keep = _keeps_out(save, impl, sources[0].dtype)
    ctx.save_for_backward(*sources, query, norm_weight, out if keep else None, lse)
    ctx.num_sources, ctx.has_gain = len(sources), norm_weight is not None
    ctx.eps, ctx.scale, ctx.impl = eps, scale, impl
    ctx.recompute = not keep and _reads_out(impl, sources[0].dtype)


def _saved(ctx):
    """What `_setup` saved: (sources list, query(ies), norm weight(s) or None, out, lse)."""
    saved, n = ctx.saved_tensors, ctx.num_sources
    return list(saved[:n]), saved[n], saved[n + 1], saved[n + 2], saved[n + 3]


def _zero_cotangent(sources) -> Tensor:
    """The cotangent of an unused `out` `[..., D]` (shaped, typed and placed like a source)."""
    return torch.zeros_like(sources[0])


def _backward(ctx, d_out, d_lse):
    n = ctx.num_sources
    sources, query, norm_weight, out, lse = _saved(ctx)
    if ctx.recompute:  # save="stats" where the backward reads out: the same forward again
        out = depth_attention_op(sources, query, norm_weight, ctx.eps, ctx.scale, ctx.impl,
                                 "stats")[0]
    if d_out is None:
        d_out = _zero_cotangent(sources)
    grads = depth_attention_backward_op(sources, query, norm_weight, out, lse, d_out, d_lse,
                                        ctx.eps, ctx.scale, ctx.impl)
    d_gain = grads[n + 1].to(norm_weight.dtype) if ctx.has_gain else None
    return grads[:n], grads[n].to(query.dtype), d_gain, None, None, None, None


depth_attention_op.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("attnres::depth_attention_weights", mutates_args=())
def depth_attention_weights_op(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                               eps: float, scale: float, impl: str,
                               save: str) -> tuple[Tensor, Tensor, Tensor]:
    """`depth_attention` plus the softmax weights `[N, ...]` fp32 that the kernel's own pass
    produced with its lse (same logits, max and sum); the weights take no gradient (C11)."""
    with autocast_off(query.device):
        return dispatch.kernel(impl).forward(list(sources), query, norm_weight, eps, scale,
                                             with_weights=True)


@depth_attention_weights_op.register_fake
def _(sources, query, norm_weight, eps, scale, impl, save):
    x0 = sources[0]
    return (x0.new_empty(x0.shape), x0.new_empty(x0.shape[:-1], dtype=torch.float32),
            x0.new_empty((len(sources),) + tuple(x0.shape[:-1]), dtype=torch.float32))


def _setup_weights(ctx, inputs, output):
    _setup(ctx, inputs, output[:2])


def _backward_weights(ctx, d_out, d_lse, d_weights):
    """The weights' cotangent is dropped: they are not differentiable (C11)."""
    return _backward(ctx, d_out, d_lse)


depth_attention_weights_op.register_autograd(_backward_weights, setup_context=_setup_weights)


@torch.library.custom_op("attnres::depth_attention_multi", mutates_args=())
def depth_attention_multi_op(sources: List[Tensor], queries: Tensor, norm_weights: Optional[Tensor],
                             eps: float, scale: float, impl: str,
                             save: str) -> tuple[Tensor, Tensor]:
    with autocast_off(queries.device):
        return dispatch.kernel(impl).multi_forward(list(sources), queries, norm_weights, eps, scale)


@depth_attention_multi_op.register_fake
def _(sources, queries, norm_weights, eps, scale, impl, save):
    x0 = sources[0]
    num_q = queries.shape[0]
    return (x0.new_empty((num_q,) + tuple(x0.shape)),
            x0.new_empty((num_q,) + tuple(x0.shape[:-1]), dtype=torch.float32))


def _backward_multi(ctx, d_out, d_lse):
    """Sum over the S queries of the single-query backward (phase 1 is the inference path)."""
    n = ctx.num_sources
    sources, queries, norm_weights, out, lse = _saved(ctx)
    if ctx.recompute:  # save="stats" where the backward reads out: phase 1 again, all S at once
        out = depth_attention_multi_op(sources, queries, norm_weights, ctx.eps, ctx.scale,
                                       ctx.impl, "stats")[0]
    zero = _zero_cotangent(sources) if d_out is None else None
    d_src, d_q, d_g = None, [], []
    for s in range(queries.shape[0]):
        grads = depth_attention_backward_op(
            sources, queries[s], None if norm_weights is None else norm_weights[s],
            None if out is None else out[s], lse[s], zero if d_out is None else d_out[s],
            None if d_lse is None else d_lse[s], ctx.eps, ctx.scale, ctx.impl)
        d_src = grads[:n] if d_src is None else [a + b for a, b in zip(d_src, grads[:n])]
        d_q.append(grads[n])
        d_g.append(grads[n + 1])
    d_gains = torch.stack(d_g).to(norm_weights.dtype) if ctx.has_gain else None
    return d_src, torch.stack(d_q).to(queries.dtype), d_gains, None, None, None, None


depth_attention_multi_op.register_autograd(_backward_multi, setup_context=_setup)


@torch.library.custom_op("attnres::depth_attention_out_norm", mutates_args=())
def depth_attention_out_norm_op(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                                out_norm_weight: Tensor, eps: float, scale: float,
                                out_norm_eps: float, impl: str, with_weights: bool,
                                save: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`depth_attention` with the fused output norm (C17): out_normed comes from the kernel's
    own pass; weights `[N, ...]` (not differentiable, C11) with `with_weights`, else `[0]`."""
    with autocast_off(query.device):
        out, normed, lse, w = dispatch.kernel(impl).out_norm_forward(
            list(sources), query, norm_weight, out_norm_weight, eps, scale, out_norm_eps,
            with_weights)
    return out, normed, lse, lse.new_empty((0,)) if w is None else w


@depth_attention_out_norm_op.register_fake
def _(sources, query, norm_weight, out_norm_weight, eps, scale, out_norm_eps, impl, with_weights,
      save):
    x0 = sources[0]
    w_shape = (len(sources),) + tuple(x0.shape[:-1]) if with_weights else (0,)
    return (x0.new_empty(x0.shape), x0.new_empty(x0.shape),
            x0.new_empty(x0.shape[:-1], dtype=torch.float32), x0.new_empty(w_shape, dtype=torch.float32))


@torch.library.custom_op("attnres::depth_attention_out_norm_backward", mutates_args=())
def depth_attention_out_norm_backward_op(
        sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor], out_norm_weight: Tensor,
        out: Optional[Tensor], lse: Tensor, d_out: Tensor, d_out_normed: Tensor, d_lse: Optional[Tensor],
        eps: float, scale: float, out_norm_eps: float, impl: str) -> List[Tensor]:
    with autocast_off(query.device):
        return dispatch.kernel(impl).out_norm_backward(
            list(sources), query, norm_weight, out_norm_weight, out, lse, d_out, d_out_normed,
            d_lse, eps, scale, out_norm_eps)


@depth_attention_out_norm_backward_op.register_fake
def _(sources, query, norm_weight, out_norm_weight, out, lse, d_out, d_out_normed, d_lse, eps,
      scale, out_norm_eps, impl):
    dim = query.shape[-1]
    return ([s.new_empty(s.shape) for s in sources]
            + [query.new_empty(query.shape, dtype=torch.float32),
               query.new_empty((dim,), dtype=torch.float32),
               query.new_empty((dim,), dtype=torch.float32)])


def _setup_out_norm(ctx, inputs, output):
    """References to the inputs and lse, and out only with save="out": no kernel's backward
    reads it (they recompute y and rho from the sources)."""
    sources, query, norm_weight, out_norm_weight, eps, scale, out_norm_eps, impl, _, save = inputs
    out, _, lse, _ = output
    keep = _keeps_out(save, impl, sources[0].dtype, out_norm=True)
    ctx.save_for_backward(*sources, query, norm_weight, out if keep else None, lse, out_norm_weight)
    ctx.num_sources, ctx.has_gain = len(sources), norm_weight is not None
    ctx.eps, ctx.scale, ctx.impl, ctx.out_norm_eps = eps, scale, impl, out_norm_eps


def _backward_out_norm(ctx, d_out, d_normed, d_lse, d_weights):
    """Absent cotangents are zeros; the weights' is dropped (C11)."""
    n = ctx.num_sources
    sources, query, norm_weight, out, lse = _saved(ctx)
    out_norm_weight = ctx.saved_tensors[n + 4]
    d_out = _zero_cotangent(sources) if d_out is None else d_out
    d_normed = _zero_cotangent(sources) if d_normed is None else d_normed
    grads = depth_attention_out_norm_backward_op(
        sources, query, norm_weight, out_norm_weight, out, lse, d_out, d_normed, d_lse, ctx.eps,
        ctx.scale, ctx.out_norm_eps, ctx.impl)
    d_gain = grads[n + 1].to(norm_weight.dtype) if ctx.has_gain else None
    return (grads[:n], grads[n].to(query.dtype), d_gain, grads[n + 2].to(out_norm_weight.dtype),
            None, None, None, None, None, None)


depth_attention_out_norm_op.register_autograd(_backward_out_norm, setup_context=_setup_out_norm)
