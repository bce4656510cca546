"""The spec's ops for torch tensors (spec sections 2-3): `depth_attention`,
`depth_attention_multi`, `merge_partial`.

Each call is validated with `attnres_core.validation` (same messages as every backend), then
`dispatch.choose` picks its implementation module: a kernel ("triton": `kernels/triton_depth.py`,
"cpu_c": `cpu_c.py`, "chunked": `chunked.py`), whose custom ops (`module.OPS`, explicit backward,
see `library.py`) run the call, or the differentiable composition (`composite.py`).
`merge_partial` without gradients calls the kernel's `merge` directly.  Inputs are never
modified; nothing is capped (C16).

Repeated calls of one signature (plain CPU tensors of the same shapes, strides and dtypes, the
same options and forcing) reuse the checks and the Choice of the first one (still recorded per
call), and where the C kernel serves a call that needs no gradient, outside traces, modes and
transforms, run its host code without the custom op: the same bits (see "repeated calls" below).

Under `torch.autocast` (any device type) sources of different floating dtypes (`merge_partial`:
out1 and partial) are first cast to the widest of them, as autocast does for `torch.cat`, and the
call then computes with autocast disabled, so C10 holds as outside autocast (C3a).  Outside
autocast sources of different dtypes raise the C3 `TypeError`.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import torch.autograd.forward_ad as forward_ad
from attnres_core import validation
from torch.autograd import profiler

from . import composite, cpu_c, dispatch, library
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
    key = _key("depth_attention", sources, (query, norm_weight, out_norm_weight), options)
    plan = None if key is None else _PLANS.get(key)
    if plan is not None:
        return _planned(plan, sources, query, norm_weight, out_norm_weight, float(eps),
                        float(scale), activation, key_norm, return_lse, return_weights, save)
    xs, stacked, shapes, dtypes = split_sources(sources)
    query = require_tensor("query", query)
    norm_weight = optional_tensor("norm_weight", norm_weight)
    library.check_save(save)
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
        if key is not None:
            _keep_sources(key, sources, xs, tensors, geo, impl, choice)
        out, normed, lse, weights = _depth_attention(impl, xs, query, norm_weight, out_norm_weight,
                                                     geo, eps, scale, activation, key_norm,
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


def _depth_attention(impl, xs, query, norm_weight, out_norm_weight, geo, eps, scale, activation,
                     key_norm, return_weights, save):
    """The validated call on its implementation `impl`: (out, out_normed or None, lse, weights
    `[N, ..., H]` or None)."""
    fused = out_norm_weight is not None  # C17
    normed = None
    if impl is composite:
        if fused:
            out, normed, lse, weights = composite.depth_attention_out_norm(
                xs, query, norm_weight, out_norm_weight, eps=eps, scale=scale,
                num_heads=geo.num_heads, activation=activation, key_norm=key_norm,
                out_norm_eps=geo.out_norm_eps)
        else:
            out, lse, weights = composite.depth_attention(
                xs, query, norm_weight, eps=eps, scale=scale, num_heads=geo.num_heads,
                activation=activation, key_norm=key_norm)
        if lse is not None and geo.num_heads == 1:
            lse = lse[..., 0]
    elif fused:  # the kernel writes out_normed in its forward pass (C17)
        out, normed, lse, weights = impl.OPS.depth_attention_out_norm(
            xs, query, norm_weight, out_norm_weight, eps, scale, geo.out_norm_eps, return_weights,
            save)
        weights = weights.unsqueeze(-1) if return_weights else None
    elif return_weights:  # the kernel's own weights: the p of its lse (same logits, max, sum)
        out, lse, weights = impl.OPS.depth_attention_weights(xs, query, norm_weight, eps, scale,
                                                             save)
        weights = weights.unsqueeze(-1)
    else:
        out, lse = impl.OPS.depth_attention(xs, query, norm_weight, eps, scale, save)
        weights = None
    return out, normed, lse, weights


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
    key = _key("depth_attention_multi", sources, (queries, norm_weights),
               (eps, type(eps), scale, type(scale), save, type(save)))
    plan = None if key is None else _PLANS.get(key)
    if plan is not None:
        dispatch.record(plan.choice)
        eps, scale = float(eps), float(scale)
        if plan.layout is not None and _eager_no_grad(sources, plan.stacked, (queries, norm_weights)):
            with _eager_context("depth_attention_multi"):
                return cpu_c.multi_eager(plan.layout, sources, queries, norm_weights, eps, scale)
        xs = list(sources.unbind(0)) if plan.stacked else list(sources)
        with autocast_off(xs[0].device):  # C3a
            return _multi(plan.impl, xs, queries, norm_weights, eps, scale, save)
    xs, stacked, shapes, dtypes = split_sources(sources)
    queries = require_tensor("queries", queries)
    norm_weights = optional_tensor("norm_weights", norm_weights)
    library.check_save(save)
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
        if key is not None:
            _keep_sources(key, sources, xs, tensors, geo, impl, choice)
        return _multi(impl, xs, queries, norm_weights, eps, scale, save)


def _multi(impl, xs, queries, norm_weights, eps, scale, save):
    """The validated phase 1 on its implementation `impl`: (out, lse)."""
    if impl is not composite:
        return impl.OPS.depth_attention_multi(xs, queries, norm_weights, eps, scale, save)
    outs, lses = [], []
    for s in range(queries.shape[0]):
        out, lse, _ = composite.depth_attention(
            xs, queries[s], None if norm_weights is None else norm_weights[s], eps=eps,
            scale=scale, num_heads=1, activation="softmax", key_norm=True)
        outs.append(out)
        lses.append(lse[..., 0])
    return torch.stack(outs), torch.stack(lses)


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
    key = _key("merge_partial", (out1, lse1, partial), (query, norm_weight),
               (eps, type(eps), scale, type(scale), torch.is_grad_enabled() and any(
                   getattr(t, "requires_grad", False) for t in given if t is not None)))
    plan = None if key is None else _PLANS.get(key)
    if plan is not None:
        dispatch.record(plan.choice)
        eps, scale = float(eps), float(scale)
        if plan.layout is not None and _eager_only():
            with _eager_context(None):
                out, lse = cpu_c.merge_eager(plan.layout, out1, lse1, partial, query, norm_weight,
                                             eps, scale)
        else:
            with autocast_off(partial.device):  # C3a
                out, lse = _merge(plan.impl, out1, lse1, partial, query, norm_weight, eps, scale)
        return (out, lse) if return_lse else out
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
        if key is not None and key[4][-1] == needs_grad and _keepable(
                choice, tensors, out1 is not given[0] or partial is not given[2]):
            lay = (cpu_c.merge_layout(out1, partial)
                   if impl is cpu_c and not _view_bits(tensors) else None)
            _store(key, _Plan(None, impl, choice, False, lay))
        out, lse = _merge(impl, out1, lse1, partial, query, norm_weight, eps, scale)
    return (out, lse) if return_lse else out


def _merge(impl, out1, lse1, partial, query, norm_weight, eps, scale):
    if impl is composite:
        return composite.merge_partial(out1, lse1, partial, query, norm_weight, eps=eps, scale=scale)
    return impl.merge(out1, lse1, partial, query, norm_weight, eps, scale)


# -- repeated calls: the checks and the choice kept per call signature ----------------------------
#
# A call's checks (`validation`, the tensor and device checks) and its dispatch `Choice` depend
# only on its tensors' types, shapes, strides, dtypes and devices, its options, whether it needs
# a gradient (merge_partial) and the forcing (`use_impl`).  For plain CPU tensors in eager mode
# `_key` names exactly that; the first call of a signature takes the full path and, once it passed
# the checks and the choice, stores what it learned (`_store`); every later call of the signature
# records the same Choice (`dispatch.record`: `last_choice` and `impl_counts` count it) and runs
# on the same implementation.  A call that raises never gets a plan, so every bad input still
# takes the checks and raises their message.  Where the C kernel serves a call that needs no
# gradient, outside any trace, mode or transform, the op runs its host code directly
# (`cpu_c.forward_eager`, `multi_eager`, `merge_eager`: the same kernel on the same pointers, so
# the same bits) instead of the custom op, whose dispatch costs more than the kernel at T = 1.

#: Whether calls take the kept plans (False: every call validates, chooses and runs as the first
#: call of a signature does; the baseline of bench/bench_torch_small.py).
MEMO = True
#: key -> _Plan; emptied when it reaches _MAX_PLANS entries.
_PLANS: dict = {}
_MAX_PLANS = 4096
#: The tensor types a plan is kept for (a subclass may override what the ops do with it).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NOT_PLAIN = object()  # stands for an argument of any other type: no key
_CPU = torch.device("cpu")


class _Plan(NamedTuple):
    geo: Optional[validation.DepthAttentionGeometry]  # None for merge_partial
    impl: object  # the implementation module
    choice: dispatch.Choice
    stacked: bool
    layout: object  # cpu_c.Layout / MergeLayout where the C kernel's host code serves the call


def _meta(t):
    """What a plan depends on of one plain tensor: shape, strides, dtype, device, view bits."""
    return (t.shape, t.stride(), t.dtype, t.is_cpu, t.is_neg(), t._is_zerotensor())


def _key(op, sources, tensors, options):
    """The signature of a call (None: not one that plans are kept for: a trace, a functorch
    transform, `MEMO` off, an argument that is no plain tensor (a subclass may override what the
    ops do with it; a non-tensor raises in the checks), or metadata that cannot be read)."""
    if (not MEMO or torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return None
    kind = type(sources)
    listed = kind is list or kind is tuple
    if not listed and kind not in _PLAIN:
        return None
    try:  # with the view bits, which the custom op's dispatch resolves before the kernel reads
        src = (tuple([_meta(s) if type(s) in _PLAIN else _NOT_PLAIN for s in sources]) if listed
               else _meta(sources))
        args = tuple([t if t is None else _meta(t) if type(t) in _PLAIN else _NOT_PLAIN
                      for t in tensors])
        if listed and _NOT_PLAIN in src or _NOT_PLAIN in args:
            return None
        key = (op, listed, src, args, options, dispatch.forced())
        hash(key)
    except Exception:  # noqa: BLE001 -- the full path raises the checks' message for these
        return None
    return key


def _keepable(choice, tensors, promoted: bool) -> bool:
    """Whether a plan is kept for a call that passed: plain CPU tensors, not promoted by
    autocast (the key holds the dtypes given), not Triton's (its support check reads more)."""
    return not (promoted or choice.impl == "triton" or dispatch.forced() == "triton"
                or not all(type(t) in _PLAIN and t.is_cpu for t in tensors))


def _view_bits(tensors) -> bool:
    """A negative or zero-tensor view bit, which the host code's raw pointers would not see."""
    return any(t.is_neg() or t._is_zerotensor() for t in tensors)


def _store(key, plan) -> None:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def _keep_sources(key, sources, xs, tensors, geo, impl, choice) -> None:
    """The plan of a depth_attention(_multi) call that passed (`tensors`: the sources as
    unbound, the query(ies), the gains)."""
    listed = not isinstance(sources, torch.Tensor)
    every = list(tensors) + ([] if listed else [sources])
    if not _keepable(choice, every, listed and any(a is not b for a, b in zip(xs, sources))):
        return
    lay = None
    if impl is cpu_c and not _view_bits(every):
        lay = cpu_c.layout(xs, None if listed else sources)
    _store(key, _Plan(geo, impl, choice, not listed, lay))


def _eager_only() -> bool:
    """No torch function or dispatch mode and no forward-mode AD level: nothing that a custom op
    would let see the call."""
    return (not torch._C._is_torch_function_mode_enabled()
            and torch._C._len_torch_dispatch_stack() == 0 and forward_ad._current_level < 0)


def _eager_no_grad(sources, stacked: bool, tensors) -> bool:
    """`_eager_only` and no gradient needed by any tensor argument."""
    if not _eager_only():
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(t is not None and t.requires_grad
                   for t in (*((sources,) if stacked else sources), *tensors))


def _planned(plan, sources, query, norm_weight, out_norm_weight, eps, scale, activation, key_norm,
             return_lse, return_weights, save):
    """A depth_attention call of a kept signature: its Choice recorded, then the run."""
    dispatch.record(plan.choice)
    geo = plan.geo
    if plan.layout is not None and _eager_no_grad(sources, plan.stacked,
                                                  (query, norm_weight, out_norm_weight)):
        fused = out_norm_weight is not None
        op = ("depth_attention_out_norm" if fused
              else "depth_attention_weights" if return_weights else "depth_attention")
        with _eager_context(op):
            out, normed, lse, weights = cpu_c.forward_eager(
                plan.layout, sources, query, norm_weight, eps, scale, return_weights,
                (out_norm_weight, geo.out_norm_eps) if fused else None)
        if weights is not None:
            weights = weights.unsqueeze(-1)  # as the custom-op path returns them
        return _results(geo, out, normed, lse, weights, return_lse, return_weights)
    xs = list(sources.unbind(0)) if plan.stacked else list(sources)
    with autocast_off(xs[0].device):  # C3a
        out, normed, lse, weights = _depth_attention(plan.impl, xs, query, norm_weight,
                                                     out_norm_weight, geo, eps, scale, activation,
                                                     key_norm, return_weights, save)
    return _results(geo, out, normed, lse, weights, return_lse, return_weights)


def _eager_context(op: Optional[str]):
    """Autocast off (C3a, as around the custom op) and, under the profiler, the name of the
    custom op `op` replaces (`attnres::cpu_c_<op>`) around a direct call."""
    if not torch._C._is_any_autocast_enabled() and not profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(autocast_off(_CPU))
    if op is not None and profiler._is_profiler_enabled:
        stack.enter_context(profiler.record_function(f"attnres::cpu_c_{op}"))
    return stack
