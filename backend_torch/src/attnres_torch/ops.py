"""The spec's ops for torch tensors (spec sections 2-3): `depth_attention`,
`depth_attention_multi`, `merge_partial`.

Each call is validated with `attnres_core.validation` (same messages as every backend), then
`dispatch.decide` picks the implementation that serves it and `dispatch.run_*` runs it there (a
kernel's custom ops, or the differentiable composition).  Inputs are never modified; nothing is
capped (C16).

Repeated calls of one signature reuse the checks and the Choice of the first one, and may run an
implementation's eager hook without the custom op (the same bits): `plans.py`.

Under `torch.autocast` (any device type) sources of different floating dtypes (`merge_partial`:
out1 and partial) are first cast to the widest of them, as autocast does for `torch.cat`, and the
call then computes with autocast disabled, so C10 holds as outside autocast (C3a).  Outside
autocast sources of different dtypes raise the C3 `TypeError`.
"""

from __future__ import annotations

import torch
from attnres_core import validation

from . import dispatch, plans
from ._args import (
    Sources,
    autocast_off,
    autocast_promote,
    check_same_device,
    dtype_name,
    optional_tensor,
    require_tensor,
    split_sources,
)


def _name(t):
    return None if t is None else dtype_name(t)


def _shape(t):
    return None if t is None else tuple(t.shape)


def depth_attention(sources: Sources, query: torch.Tensor, norm_weight=None, *, eps: float = 1e-6,
                    scale: float = 1.0, num_heads: int = 1, activation: str = "softmax",
                    key_norm: bool = True, return_lse: bool = False, return_weights: bool = False,
                    out_norm_weight=None, out_norm_eps=None, save: str = "auto"):
    """Depth attention over N sources (spec section 2, C1-C12, C17).

    Args:
      sources: a list/tuple of N tensors `[..., D]` (never stacked on a fast path) or one stacked
        tensor `[N, ..., D]`.
      query: pseudo-query `[D]` or per-token query `[..., D]`, any floating dtype.
      norm_weight: key RMSNorm gain `[D]` or None.
      eps, scale, num_heads, activation, key_norm: spec options.
      return_lse / return_weights: also return lse `[...]` (`[..., H]` if H > 1; compute dtype,
        differentiable) and the depth weights `[N, ...]` (`[N, ..., H]`; not differentiable).
      out_norm_weight: the fused output norm's gain `[D]` (C17, spec 2.6) or None: also return
        out_normed `[..., D]` = rmsnorm(out) * out_norm_weight over all D channels, from out before
        its rounding, in the sources' dtype (differentiable, d_out_norm_weight included).
      out_norm_eps: that norm's eps (None: `eps`).
      save: what a kernel path keeps for the backward besides the inputs and lse `[...]` fp32:
        "auto" keeps `out` where its backward reads it (Triton, float32 sources, no fused output
        norm), "out" keeps it always, "stats" never (that Triton backward then reruns the
        forward).  Values and gradients are the same, bitwise; the composition (float64, heads,
        sigmoid, no key norm) saves what torch autograd saves.

    Returns:
      out `[..., D]` in the sources' dtype, or `(out, out_normed?, lse?, weights?)`.
    """
    options = (eps, type(eps), scale, type(scale), num_heads, type(num_heads), activation,
               type(activation), key_norm, type(key_norm), return_lse, return_weights,
               out_norm_eps, type(out_norm_eps), save, type(save))
    sig, kept = plans.depth_attention(sources, query, norm_weight, out_norm_weight, options, eps,
                                      scale, activation, key_norm, return_weights, save)
    if kept is not None:
        return _results(*kept, return_lse, return_weights)
    xs, stacked, shapes, dtypes = split_sources(sources)
    query = require_tensor("query", query)
    norm_weight = optional_tensor("norm_weight", norm_weight)
    dispatch.check_save(save)
    out_norm_weight = optional_tensor("out_norm_weight", out_norm_weight)
    geo = validation.check_depth_attention(
        shapes, dtypes, tuple(query.shape), dtype_name(query), _shape(norm_weight), _name(norm_weight),
        stacked=stacked, eps=eps, scale=scale, num_heads=num_heads, activation=activation,
        key_norm=key_norm, return_lse=return_lse, out_norm_weight_shape=_shape(out_norm_weight),
        out_norm_weight_dtype=_name(out_norm_weight), out_norm_eps=out_norm_eps)
    tensors = xs + [query] + [t for t in (norm_weight, out_norm_weight) if t is not None]
    check_same_device([(f"sources[{i}]", s) for i, s in enumerate(xs)]
                      + [("query", query), ("norm_weight", norm_weight),
                         ("out_norm_weight", out_norm_weight)])
    eps, scale = float(eps), float(scale)
    with autocast_off(xs[0].device):  # C3a: the kernels and the composition compute as C10 says
        impl, choice = dispatch.decide(dispatch.Call(
            "depth_attention", xs, query, norm_weight, tensors, num_heads=geo.num_heads,
            activation=activation, key_norm=key_norm, out_norm=out_norm_weight is not None))
        dispatch.record(choice)
        plans.keep_sources(sig, sources, xs, tensors, geo, impl, choice)
        out, normed, lse, weights = dispatch.run_depth_attention(
            impl, xs, query, norm_weight, out_norm_weight, geo, eps, scale, activation, key_norm,
            return_weights, save)
    return _results(geo, out, normed, lse, weights, return_lse, return_weights)


def _results(geo, out, normed, lse, weights, return_lse, return_weights):
    """`depth_attention`'s return value from (out, out_normed or None, lse, weights `[N, ...,
    H]` or None)."""
    extra = [] if normed is None else [normed]
    if return_lse:
        extra.append(lse)
    if return_weights:
        weights = weights.detach()
        extra.append(weights[..., 0] if geo.num_heads == 1 else weights)
    return (out, *extra) if extra else out


def depth_attention_multi(sources: Sources, queries: torch.Tensor, norm_weights=None, *,
                          eps: float = 1e-6, scale: float = 1.0, save: str = "auto"):
    """Phase 1 of the two-phase schedule (spec 3.1): S pseudo-queries over N sources, every
    source read once for all S (softmax, key norm, one head).

    Args:
      sources: N x `[..., D]` or `[N, ..., D]`.
      queries: `[S, D]`.
      norm_weights: `[S, D]` or None.
      eps, scale: spec options.
      save: as `depth_attention`'s (`out` is `[S, ..., D]` here).

    Returns:
      (out `[S, ..., D]` in the sources' dtype, lse `[S, ...]` in the compute dtype).
    """
    sig, kept = plans.multi(sources, queries, norm_weights,
                            (eps, type(eps), scale, type(scale), save, type(save)), eps, scale, save)
    if kept is not None:
        return kept
    xs, stacked, shapes, dtypes = split_sources(sources)
    queries = require_tensor("queries", queries)
    norm_weights = optional_tensor("norm_weights", norm_weights)
    dispatch.check_save(save)
    geo = validation.check_multi(shapes, dtypes, tuple(queries.shape), dtype_name(queries),
                                 _shape(norm_weights), _name(norm_weights), stacked=stacked,
                                 eps=eps, scale=scale)
    check_same_device([(f"sources[{i}]", s) for i, s in enumerate(xs)]
                      + [("queries", queries), ("norm_weights", norm_weights)])
    tensors = xs + [queries] + ([] if norm_weights is None else [norm_weights])
    eps, scale = float(eps), float(scale)
    with autocast_off(xs[0].device):  # C3a
        impl, choice = dispatch.decide(dispatch.Call(
            "depth_attention_multi", xs, queries[0],
            None if norm_weights is None else norm_weights[0], tensors))
        dispatch.record(choice)
        plans.keep_sources(sig, sources, xs, tensors, geo, impl, choice)
        return dispatch.run_multi(impl, xs, queries, norm_weights, eps, scale, save)


def merge_partial(out1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor, query: torch.Tensor,
                  norm_weight=None, *, eps: float = 1e-6, scale: float = 1.0,
                  return_lse: bool = False):
    """Phase 2 (spec 3.2): merge phase 1 with the intra-block partial sum.

    Args:
      out1: phase 1's output `[..., D]` for this query.
      lse1: phase 1's lse `[...]`.
      partial: the intra-block partial sum `[..., D]`.
      query: `[D]` or `[..., D]`.
      norm_weight: the key norm's gain `[D]` or None.
      eps, scale: spec options.
      return_lse: also return the merged lse.

    Returns:
      out `[..., D]` in partial's dtype (and lse `[...]` in the compute dtype), equal to
      `depth_attention(phase1_sources + [partial], query, norm_weight)`.

    When no gradient is needed a fused kernel serves it (Triton on CUDA, the C kernel on the CPU:
    one pass over out1 and partial); otherwise, and for float64, the differentiable composition.
    """
    given = (out1, lse1, partial, query, norm_weight)
    sig, kept = plans.merge(out1, lse1, partial, query, norm_weight, eps, scale)
    if kept is not None:
        return kept if return_lse else kept[0]
    names = ("out1", "lse1", "partial", "query")
    out1, lse1, partial, query = (require_tensor(n, t) for n, t in zip(names, (out1, lse1, partial, query)))
    out1, partial = autocast_promote([out1, partial])  # C3a
    norm_weight = optional_tensor("norm_weight", norm_weight)
    validation.check_merge(tuple(out1.shape), dtype_name(out1), tuple(lse1.shape), dtype_name(lse1),
                           tuple(partial.shape), dtype_name(partial), tuple(query.shape),
                           dtype_name(query), _shape(norm_weight), _name(norm_weight), eps=eps,
                           scale=scale)
    check_same_device(list(zip(names, (out1, lse1, partial, query))) + [("norm_weight", norm_weight)])
    eps, scale = float(eps), float(scale)
    tensors = [out1, lse1, partial, query] + ([] if norm_weight is None else [norm_weight])
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    with autocast_off(partial.device):  # C3a
        impl, choice = dispatch.decide(dispatch.Call("merge_partial", [out1, partial], query,
                                                     norm_weight, tensors, needs_grad=needs_grad))
        dispatch.record(choice)
        plans.keep_merge(sig, given, tensors, impl, choice, needs_grad)
        out, lse = dispatch.run_merge(impl, out1, lse1, partial, query, norm_weight, eps, scale)
    return (out, lse) if return_lse else out
