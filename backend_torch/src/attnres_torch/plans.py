"""Repeated calls: the checks and the dispatch Choice kept per call signature, and the
implementations' eager hook.

A call's checks (`validation`, the tensor and device checks) and its dispatch `Choice` depend only
on its tensors' types, shapes, strides, dtypes and devices, its options, whether it needs a
gradient (merge_partial) and the forcing (`use_impl`).  For plain CPU tensors in eager mode `key`
names exactly that; the first call of a signature takes the full path in `ops` and, once it passed
the checks and the choice, `keep_sources` / `keep_merge` store what it learned; every later call
of the signature (`depth_attention`, `multi`, `merge` here) records the same Choice
(`dispatch.record`: `last_choice` and `impl_counts` count it) and runs on the same implementation.
A call that raises never gets a plan, so every bad input still takes the checks and raises their
message.

The eager hook (today "cpu_c"'s): `layout(xs, stacked)` / `merge_layout(out1, partial)` give the
constants of a signature (None: no hook), `forward_eager` / `multi_eager` / `merge_eager` run the
op bodies on them (the same kernel on the same pointers: the same bits).  A kept call that needs
no gradient, outside any trace, mode or transform, runs the hook instead of the custom op, whose
dispatch costs more than the kernel at T = 1 (the batch-1 decode read).
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


class Plan(NamedTuple):
    """What the first call of a signature learned."""

    geo: Optional[validation.DepthAttentionGeometry]  # None for merge_partial
    impl: object  # the implementation module
    choice: dispatch.Choice
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
        sig = (op, listed, src, args, options, dispatch.forced())
        hash(sig)
    except Exception:  # noqa: BLE001 -- the full path raises the checks' message for these
        return None
    return sig


def get(sig: Optional[tuple]) -> Optional[Plan]:
    """The plan kept for signature `sig` (None: none, or no signature)."""
    return None if sig is None else _PLANS.get(sig)


def _keepable(choice, tensors, promoted: bool) -> bool:
    """Whether a plan is kept for a call that passed: plain CPU tensors, not promoted by
    autocast (the key holds the dtypes given), not Triton's (its support check reads more)."""
    return not (promoted or choice.impl == "triton" or dispatch.forced() == "triton"
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
    _store(sig, Plan(geo, impl, choice, not listed, lay))


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
    _store(sig, Plan(None, impl, choice, False, lay))


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


def depth_attention(plan: Plan, sources, query, norm_weight, out_norm_weight, eps: float,
                    scale: float, activation, key_norm, return_weights, save):
    """A depth_attention call of a kept signature: its Choice recorded, then the run: (out,
    out_normed or None, lse, weights `[N, ..., H]` or None), as `dispatch.run_depth_attention`."""
    dispatch.record(plan.choice)
    geo = plan.geo
    if plan.layout is not None and _eager_no_grad(sources, plan.stacked,
                                                  (query, norm_weight, out_norm_weight)):
        fused = out_norm_weight is not None
        op = ("depth_attention_out_norm" if fused
              else "depth_attention_weights" if return_weights else "depth_attention")
        with _eager_context(plan, op):
            out, normed, lse, weights = plan.impl.forward_eager(
                plan.layout, sources, query, norm_weight, eps, scale, return_weights,
                (out_norm_weight, geo.out_norm_eps) if fused else None)
        return out, normed, lse, None if weights is None else weights.unsqueeze(-1)
    xs = list(sources.unbind(0)) if plan.stacked else list(sources)
    with autocast_off(xs[0].device):  # C3a
        return dispatch.run_depth_attention(plan.impl, xs, query, norm_weight, out_norm_weight,
                                            geo, eps, scale, activation, key_norm, return_weights,
                                            save)


def multi(plan: Plan, sources, queries, norm_weights, eps: float, scale: float, save):
    """A depth_attention_multi call of a kept signature: (out, lse)."""
    dispatch.record(plan.choice)
    if plan.layout is not None and _eager_no_grad(sources, plan.stacked, (queries, norm_weights)):
        with _eager_context(plan, "depth_attention_multi"):
            return plan.impl.multi_eager(plan.layout, sources, queries, norm_weights, eps, scale)
    xs = list(sources.unbind(0)) if plan.stacked else list(sources)
    with autocast_off(xs[0].device):  # C3a
        return dispatch.run_multi(plan.impl, xs, queries, norm_weights, eps, scale, save)


def merge(plan: Plan, out1, lse1, partial, query, norm_weight, eps: float, scale: float):
    """A merge_partial call of a kept signature: (out, lse)."""
    dispatch.record(plan.choice)
    if plan.layout is not None and _eager_only():
        with _eager_context(plan, None):
            return plan.impl.merge_eager(plan.layout, out1, lse1, partial, query, norm_weight,
                                         eps, scale)
    with autocast_off(partial.device):  # C3a
        return dispatch.run_merge(plan.impl, out1, lse1, partial, query, norm_weight, eps, scale)
