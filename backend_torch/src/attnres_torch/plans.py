"""Repeated calls: the checks and the dispatch Choice kept per call signature, and the
implementations' eager hook.

`key` names what a call's checks and `Choice` depend on (plain CPU tensors in eager mode: their
types, shapes, strides, dtypes, devices and view bits, the options, merge_partial's gradient need,
`use_impl`'s forcing).  The first call of a signature takes the full path in `ops`; once it passed,
`keep_sources` / `keep_merge` store its Plan.  A later call (`depth_attention`, `multi`, `merge`:
key, plan and run in one call from `ops`) records the same Choice (`last_choice`, `impl_counts`)
and runs on the same implementation.  A call that raises gets no plan: every bad input still
raises the checks' message.

The eager hook (cpu_c's): `layout` / `merge_layout` give a signature's constants (None: no hook);
`forward_eager` / `multi_eager` / `merge_eager` run the op bodies on them (the same kernel on the
same pointers: the same bits) in place of the custom op, whose dispatch costs more than the kernel
at T = 1 (batch-1 decode), for a kept call that needs no gradient, outside any trace or mode.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import torch.autograd.forward_ad as forward_ad
from attnres_core import validation
from torch.autograd import profiler

from . import dispatch
from ._args import autocast_off

#: Whether calls take the kept plans (False: every call validates, chooses and runs as the first
#: call of a signature does; the baseline of bench/bench_torch_small.py).
MEMO = True
#: key -> Plan; emptied when it reaches _MAX_PLANS entries.
_PLANS: dict = {}
_MAX_PLANS = 4096
#: The tensor types a plan is kept for (a subclass may override what the ops do with it).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NOT_PLAIN = object()  # stands for an argument of any other type: no key
_CPU = torch.device("cpu")
_forced = dispatch.forcing_state  # `use_impl`'s forcing, read without a frame of dispatch.py


class Plan(NamedTuple):
    """What the first call of a signature learned."""

    geo: Optional[validation.DepthAttentionGeometry]  # None for merge_partial
    impl: object  # the implementation module
    choice: dispatch.Choice
    record: object  # records `choice` (dispatch.recorder: no frame of dispatch.py per call)
    stacked: bool  # the sources came as one stacked tensor
    layout: object  # the eager hook's constants (`impl.layout` / `merge_layout`), or None


def _meta(t):
    """What a plan depends on of one plain tensor: shape, strides, dtype, device, view bits."""
    return (t.shape, t.stride(), t.dtype, t.is_cpu, t.is_neg(), t._is_zerotensor())


def key(op: str, sources, tensors, options) -> Optional[tuple]:
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
        sig = (op, listed, src, args, options, _forced())
        hash(sig)
    except Exception:  # noqa: BLE001 -- the full path raises the checks' message for these
        return None
    return sig


def _keepable(choice, tensors, promoted: bool) -> bool:
    """Whether a plan is kept for a call that passed: plain CPU tensors, not promoted by
    autocast (the key holds the dtypes given), not Triton's (its support check reads more)."""
    return not (promoted or choice.impl == "triton" or _forced() == "triton"
                or not all(type(t) in _PLAIN and t.is_cpu for t in tensors))


def _view_bits(tensors) -> bool:
    """A negative or zero-tensor view bit, which the host code's raw pointers would not see."""
    return any(t.is_neg() or t._is_zerotensor() for t in tensors)


def _store(sig, plan) -> None:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[sig] = plan


def keep_sources(sig, sources, xs, tensors, geo, impl, choice) -> None:
    """Keep the plan of a depth_attention(_multi) call that passed (`tensors`: the sources as
    unbound `xs`, the query(ies), the gains); nothing when `sig` is None."""
    if sig is None:
        return
    listed = not isinstance(sources, torch.Tensor)
    every = list(tensors) + ([] if listed else [sources])
    if not _keepable(choice, every, listed and any(a is not b for a, b in zip(xs, sources))):
        return
    hook = getattr(impl, "layout", None)
    lay = None if hook is None or _view_bits(every) else hook(xs, None if listed else sources)
    _store(sig, Plan(geo, impl, choice, dispatch.recorder(choice), not listed, lay))


def keep_merge(sig, given, tensors, impl, choice, needs_grad: bool) -> None:
    """Keep the plan of a merge_partial call that passed (`given`: its arguments as passed,
    `tensors`: after autocast's promotion, out1, lse1, partial first); nothing when `sig` is
    None or the call's gradient need differs from the one its signature was taken with."""
    if sig is None or sig[4][-1] != needs_grad:
        return
    out1, _, partial = tensors[:3]
    if not _keepable(choice, tensors, out1 is not given[0] or partial is not given[2]):
        return
    hook = getattr(impl, "merge_layout", None)
    lay = None if hook is None or _view_bits(tensors) else hook(out1, partial)
    _store(sig, Plan(None, impl, choice, dispatch.recorder(choice), False, lay))


def _eager(stacked: bool, sources, *tensors) -> bool:
    """No torch function or dispatch mode and no forward-mode AD level (nothing that a custom op
    would let see the call), and no gradient needed by `sources` or `tensors` (None: skipped)."""
    if (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()
            or forward_ad._current_level >= 0):
        return False
    return not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in (*((sources,) if stacked else sources), *tensors))


def _eager_context(plan: Plan, op: Optional[str]):
    """Autocast off (C3a, as around the custom op) and, under the profiler, the name of the
    custom op `op` replaces (`attnres::<impl>_<op>`) around a hook call."""
    if not torch._C._is_any_autocast_enabled() and not profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(autocast_off(_CPU))
    if op is not None and profiler._is_profiler_enabled:
        stack.enter_context(profiler.record_function(f"attnres::{plan.choice.impl}_{op}"))
    return stack


def _find(op: str, sources, tensors, options):
    """(the call's signature or None, its kept Plan or None); a found plan records its Choice."""
    sig = key(op, sources, tensors, options)
    plan = None if sig is None else _PLANS.get(sig)
    if plan is not None:
        plan.record()
    return sig, plan


def depth_attention(sources, query, norm_weight, out_norm_weight, options: tuple, eps, scale,
                    activation, key_norm, return_weights, save):
    """A depth_attention call through the plan kept for its signature: (sig, None) when none is
    kept (sig: the signature to keep one under, or None), else (sig, (geo, out, out_normed or
    None, lse, weights `[N, ..., H]` or None)), as `dispatch.run_depth_attention` runs it."""
    sig, plan = _find("depth_attention", sources, (query, norm_weight, out_norm_weight), options)
    if plan is None:
        return sig, None
    geo, eps, scale = plan.geo, float(eps), float(scale)
    if plan.layout is not None and _eager(plan.stacked, sources, query, norm_weight,
                                          out_norm_weight):
        fused = out_norm_weight is not None
        op = ("depth_attention_out_norm" if fused
              else "depth_attention_weights" if return_weights else "depth_attention")
        with _eager_context(plan, op):
            out, normed, lse, weights = plan.impl.forward_eager(
                plan.layout, sources, query, norm_weight, eps, scale, return_weights,
                (out_norm_weight, geo.out_norm_eps) if fused else None)
        return sig, (geo, out, normed, lse, None if weights is None else weights.unsqueeze(-1))
    xs = list(sources.unbind(0)) if plan.stacked else list(sources)
    with autocast_off(xs[0].device):  # C3a
        return sig, (geo, *dispatch.run_depth_attention(
            plan.impl, xs, query, norm_weight, out_norm_weight, geo, eps, scale, activation,
            key_norm, return_weights, save))


def multi(sources, queries, norm_weights, options: tuple, eps, scale, save):
    """A depth_attention_multi call through its kept plan: (sig, None) as `depth_attention`, or
    (sig, (out, lse))."""
    sig, plan = _find("depth_attention_multi", sources, (queries, norm_weights), options)
    if plan is None:
        return sig, None
    if plan.layout is not None and _eager(plan.stacked, sources, queries, norm_weights):
        with _eager_context(plan, "depth_attention_multi"):
            return sig, plan.impl.multi_eager(plan.layout, sources, queries, norm_weights,
                                              float(eps), float(scale))
    xs = list(sources.unbind(0)) if plan.stacked else list(sources)
    with autocast_off(xs[0].device):  # C3a
        return sig, dispatch.run_multi(plan.impl, xs, queries, norm_weights, float(eps),
                                       float(scale), save)


def merge(out1, lse1, partial, query, norm_weight, eps, scale):
    """A merge_partial call through its kept plan: (sig, None) as `depth_attention`, or (sig,
    (out, lse)).  The signature holds whether the call needs a gradient."""
    needs_grad = torch.is_grad_enabled() and any(
        getattr(t, "requires_grad", False) for t in (out1, lse1, partial, query, norm_weight)
        if t is not None)
    sig, plan = _find("merge_partial", (out1, lse1, partial), (query, norm_weight),
                      (eps, type(eps), scale, type(scale), needs_grad))
    if plan is None:
        return sig, None
    eps, scale = float(eps), float(scale)
    if plan.layout is not None and _eager(False, ()):  # merge_partial's key holds its grad need
        with _eager_context(plan, None):
            return sig, plan.impl.merge_eager(plan.layout, out1, lse1, partial, query,
                                              norm_weight, eps, scale)
    with autocast_off(partial.device):  # C3a
        return sig, dispatch.run_merge(plan.impl, out1, lse1, partial, query, norm_weight, eps,
                                       scale)
