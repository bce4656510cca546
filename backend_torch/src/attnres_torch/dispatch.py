"""The registry of implementations (which one serves an op call, forcing one, the record) and the
registration of the kernels' `torch.library` custom ops with their autograd.

The backend contract (the same names in `attnres_jax.dispatch` and `attnres_mlx.dispatch`;
docs/architecture.md, "Dispatch"): `IMPLEMENTATIONS`, `availability()`, `use_impl()`, `Choice`,
`last_choice()`, `impl_counts()`, `capabilities()`.  The bookkeeping (`Choice`, the forcing, the
record, the refusal rule) is `attnres_core.dispatch`; this module supplies the implementations,
their support checks, availability and capabilities.

`IMPLEMENTATIONS`, in the order of the automatic choice, are one module each under `kernels/`
(what each serves: `kernels/__init__.py`) owning its support check (`refusal(call)`) and host
code; "triton" is imported on the first CUDA call.  `decide` says which serves a call, under
`use_impl`'s forcing (a ContextVar); the record is kept under a lock and skipped while
torch.compile traces; `plans.py` keeps a signature's Choice and its `recorder` for repeats.

Custom ops.  At registration (`_define`: cpu_c and chunked at import, triton when first loaded)
each kernel module's functions named after `KINDS` become `attnres::<impl>_<kind>` (`OPS[impl]`)
with a shape-only fake, the autograd below and the DTensor strategies of `dtensor.py`, so
`torch.compile(fullgraph=True)` sees each as one node.  Schemas (without the fused output norm a
kernel has the first four only):
  depth_attention(sources N x [..., D], query [D] | [..., D], norm_weight [D]?, eps, scale, save)
      -> (out [..., D] sources' dtype, lse [...] fp32)
  depth_attention_weights(same) -> (out, lse, weights [N, ...] fp32 of that lse)
  depth_attention_backward(sources, query, norm_weight, out?, lse, d_out, d_lse?, eps, scale)
      -> [d_source_0 .. d_source_{N-1}, d_query (fp32, query's shape), d_norm_weight (fp32 [D])]
  depth_attention_multi(sources, queries [S, D], norm_weights [S, D]?, eps, scale, save)
      -> (out [S, ..., D] sources' dtype, lse [S, ...] fp32)
  depth_attention_out_norm(sources, query, norm_weight?, out_norm_weight [D], eps, scale,
                           out_norm_eps, with_weights, save)
      -> (out, out_normed [..., D], lse [...] fp32, weights [N, ...] fp32 or [0]) (C17);
      its _backward returns depth_attention_backward's list plus d_out_norm_weight (fp32 [D]).
The backward saves references to the inputs, the fp32 lse and, by `save` (`SAVE_MODES`), `out`:
"auto" where the module's `reads_out(dtype, out_norm)` says its backward reads it (Triton, fp32,
no fused norm), "out" always, "stats" never (where it is read, the forward reruns: the same
bits).  `save` has no default (a custom op's autograd drops an argument passed at its default).
Every body computes with autocast disabled (C3a, C10); mixed source dtypes are promoted in `ops`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
from attnres_core import dispatch as contract
from attnres_core.dispatch import Choice
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import dtensor
from .kernels import chunked, composite, cpu_c

#: Implementation names, in the order of the automatic choice.
IMPLEMENTATIONS = ("triton", "cpu_c", "chunked", "composite")
#: Source dtypes of the kernels (the compute dtype is fp32 for all three, C10).
FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MERGE = "merge_partial"


#: The contract's bookkeeping (`attnres_core.dispatch`): the forcing and the record.
_REGISTRY = contract.Registry("attnres_torch", IMPLEMENTATIONS)

@dataclass(frozen=True)
class Call:
    """One op call as the registry sees it (arguments already validated); plain data, so an
    implementation's support check reads it without calling back into this module.

    op: "depth_attention", "depth_attention_multi" or "merge_partial".
    sources: N x `[..., D]` (merge_partial: `[out1, partial]`).
    query: `[D]` or `[..., D]` (depth_attention_multi: the first of the `[S, D]` queries).
    norm_weight: `[D]` or None (depth_attention_multi: the first of the `[S, D]` gains).
    tensors: every tensor argument (for the device of the call).
    needs_grad: a gradient will flow (only merge_partial asks: its kernels have no backward).
    out_norm: depth_attention with the fused output norm (C17, `out_norm_weight` given).
    default_op (set from the rest): softmax, key norm, one head, float16/bfloat16/float32
      sources (merge: partial) -- the calls every kernel covers.
    device_types: the device types of `tensors` (set from them).
    """

    op: str
    sources: Sequence[Tensor]
    query: Tensor
    norm_weight: Optional[Tensor]
    tensors: Sequence[Tensor]
    num_heads: int = 1
    activation: str = "softmax"
    key_norm: bool = True
    needs_grad: bool = False
    out_norm: bool = False
    default_op: bool = field(init=False)
    device_types: frozenset = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "default_op", self.activation == "softmax" and self.key_norm
                           and self.num_heads == 1 and self.sources[-1].dtype in FAST_DTYPES)
        object.__setattr__(self, "device_types", frozenset(t.device.type for t in self.tensors))

    def on(self, device_type: str) -> bool:
        """Whether every tensor of the call is on a device of `device_type`."""
        return self.device_types == {device_type}


#: The values of the forward ops' `save` argument (see above; `ops.depth_attention(save=...)`).
SAVE_MODES = ("auto", "out", "stats")

#: The op kinds an implementation may define (the DTensor strategies cover each).
KINDS = dtensor.OPS


def check_save(save) -> None:
    """ValueError unless `save` is one of `SAVE_MODES`."""
    if not isinstance(save, str) or save not in SAVE_MODES:
        raise ValueError(f"save: expected one of {SAVE_MODES}, got {save!r}")


# -- the custom ops: fake (meta) implementations, shapes only -----------------------------------------------------

def _f32(t, shape):
    return t.new_empty(shape, dtype=torch.float32)


def _fake_forward(sources, query, norm_weight, eps, scale, save):
    x0 = sources[0]
    return x0.new_empty(x0.shape), _f32(x0, x0.shape[:-1])


def _fake_weights(sources, query, norm_weight, eps, scale, save):
    x0 = sources[0]
    return (x0.new_empty(x0.shape), _f32(x0, x0.shape[:-1]),
            _f32(x0, (len(sources),) + tuple(x0.shape[:-1])))


def _fake_backward(sources, query, norm_weight, out, lse, d_out, d_lse, eps, scale):
    return ([s.new_empty(s.shape) for s in sources]
            + [_f32(query, query.shape), _f32(query, (query.shape[-1],))])


def _fake_multi(sources, queries, norm_weights, eps, scale, save):
    x0 = sources[0]
    num_q = queries.shape[0]
    return x0.new_empty((num_q,) + tuple(x0.shape)), _f32(x0, (num_q,) + tuple(x0.shape[:-1]))


def _fake_out_norm(sources, query, norm_weight, out_norm_weight, eps, scale, out_norm_eps,
                   with_weights, save):
    x0 = sources[0]
    w_shape = (len(sources),) + tuple(x0.shape[:-1]) if with_weights else (0,)
    return x0.new_empty(x0.shape), x0.new_empty(x0.shape), _f32(x0, x0.shape[:-1]), _f32(x0, w_shape)


def _fake_out_norm_backward(sources, query, norm_weight, out_norm_weight, out, lse, d_out,
                            d_out_normed, d_lse, eps, scale, out_norm_eps):
    dim = query.shape[-1]
    return ([s.new_empty(s.shape) for s in sources]
            + [_f32(query, query.shape), _f32(query, (dim,)), _f32(query, (dim,))])


_FAKES = {"depth_attention": _fake_forward, "depth_attention_weights": _fake_weights,
          "depth_attention_backward": _fake_backward, "depth_attention_multi": _fake_multi,
          "depth_attention_out_norm": _fake_out_norm,
          "depth_attention_out_norm_backward": _fake_out_norm_backward}


# -- the custom ops' autograd --------------------------------------------------------------------------------------

def _keeps_out(save: str, reads: bool) -> bool:
    """Whether the forward saves `out` for the backward under `save`."""
    check_save(save)
    return save == "out" or (save == "auto" and reads)


def _setup(ops, reads_out, ctx, inputs, output):
    """Saved for depth_attention(_weights) and _multi: references to the inputs, lse, and `out`
    where `save` keeps it (else None)."""
    sources, query, norm_weight, eps, scale, save = inputs
    out, lse = output[:2]
    reads = reads_out(sources[0].dtype, False)
    keep = _keeps_out(save, reads)
    ctx.save_for_backward(*sources, query, norm_weight, out if keep else None, lse)
    ctx.num_sources, ctx.has_gain = len(sources), norm_weight is not None
    ctx.eps, ctx.scale, ctx.ops = eps, scale, ops
    ctx.recompute = not keep and reads


def _saved(ctx):
    """What `_setup` saved: (sources list, query(ies), norm weight(s) or None, out, lse)."""
    saved, n = ctx.saved_tensors, ctx.num_sources
    return list(saved[:n]), saved[n], saved[n + 1], saved[n + 2], saved[n + 3]


def _zero_cotangent(sources):
    """The cotangent of an unused `out` `[..., D]` (shaped, typed and placed like a source)."""
    return torch.zeros_like(sources[0])


def _backward(ctx, d_out, d_lse, d_weights=None):
    """depth_attention(_weights)'s VJP; the weights' cotangent is dropped (not differentiable,
    C11)."""
    n, ops = ctx.num_sources, ctx.ops
    sources, query, norm_weight, out, lse = _saved(ctx)
    if ctx.recompute:  # save="stats" where the backward reads out: the same forward again
        out = ops.depth_attention(sources, query, norm_weight, ctx.eps, ctx.scale, "stats")[0]
    if d_out is None:
        d_out = _zero_cotangent(sources)
    grads = ops.depth_attention_backward(sources, query, norm_weight, out, lse, d_out, d_lse,
                                         ctx.eps, ctx.scale)
    d_gain = grads[n + 1].to(norm_weight.dtype) if ctx.has_gain else None
    return grads[:n], grads[n].to(query.dtype), d_gain, None, None, None


def _backward_multi(ctx, d_out, d_lse):
    """Sum over the S queries of the single-query backward (phase 1 is the inference path)."""
    n, ops = ctx.num_sources, ctx.ops
    sources, queries, norm_weights, out, lse = _saved(ctx)
    if ctx.recompute:  # save="stats" where the backward reads out: phase 1 again, all S at once
        out = ops.depth_attention_multi(sources, queries, norm_weights, ctx.eps, ctx.scale,
                                        "stats")[0]
    zero = _zero_cotangent(sources) if d_out is None else None
    d_src, d_q, d_g = None, [], []
    for s in range(queries.shape[0]):
        grads = ops.depth_attention_backward(
            sources, queries[s], None if norm_weights is None else norm_weights[s],
            None if out is None else out[s], lse[s], zero if d_out is None else d_out[s],
            None if d_lse is None else d_lse[s], ctx.eps, ctx.scale)
        d_src = grads[:n] if d_src is None else [a + b for a, b in zip(d_src, grads[:n])]
        d_q.append(grads[n])
        d_g.append(grads[n + 1])
    d_gains = torch.stack(d_g).to(norm_weights.dtype) if ctx.has_gain else None
    return d_src, torch.stack(d_q).to(queries.dtype), d_gains, None, None, None


def _setup_out_norm(ops, reads_out, ctx, inputs, output):
    """References to the inputs and lse, and out where `save` keeps it."""
    sources, query, norm_weight, out_norm_weight, eps, scale, out_norm_eps, _, save = inputs
    out, _, lse, _ = output
    keep = _keeps_out(save, reads_out(sources[0].dtype, True))
    ctx.save_for_backward(*sources, query, norm_weight, out if keep else None, lse, out_norm_weight)
    ctx.num_sources, ctx.has_gain = len(sources), norm_weight is not None
    ctx.eps, ctx.scale, ctx.out_norm_eps, ctx.ops = eps, scale, out_norm_eps, ops


def _backward_out_norm(ctx, d_out, d_normed, d_lse, d_weights):
    """Absent cotangents are zeros; the weights' is dropped (C11)."""
    n = ctx.num_sources
    sources, query, norm_weight, out, lse = _saved(ctx)
    out_norm_weight = ctx.saved_tensors[n + 4]
    d_out = _zero_cotangent(sources) if d_out is None else d_out
    d_normed = _zero_cotangent(sources) if d_normed is None else d_normed
    grads = ctx.ops.depth_attention_out_norm_backward(
        sources, query, norm_weight, out_norm_weight, out, lse, d_out, d_normed, d_lse, ctx.eps,
        ctx.scale, ctx.out_norm_eps)
    d_gain = grads[n + 1].to(norm_weight.dtype) if ctx.has_gain else None
    return (grads[:n], grads[n].to(query.dtype), d_gain, grads[n + 2].to(out_norm_weight.dtype),
            None, None, None, None, None)


#: (backward, setup) of each differentiable kind.
_AUTOGRAD = {"depth_attention": (_backward, _setup), "depth_attention_weights": (_backward, _setup),
             "depth_attention_multi": (_backward_multi, _setup),
             "depth_attention_out_norm": (_backward_out_norm, _setup_out_norm)}


def _define(module) -> SimpleNamespace:
    """Register `module`'s op bodies (its functions named after `KINDS`, annotated) as the custom
    ops `attnres::<module.NAME>_<kind>` with fakes, autograd (reading `module.reads_out`) and
    DTensor strategies; once per implementation.  Returns the ops by kind."""
    bodies = {kind: getattr(module, kind) for kind in KINDS if hasattr(module, kind)}
    if "depth_attention_backward" not in bodies:
        raise ValueError(f"{module.NAME}: expected op bodies among {KINDS} with a backward, got "
                         f"{sorted(bodies)}")
    ops = SimpleNamespace()
    for kind, body in bodies.items():
        op = torch.library.custom_op(f"attnres::{module.NAME}_{kind}", body, mutates_args=())
        op.register_fake(_FAKES[kind])
        setattr(ops, kind, op)
        if kind in _AUTOGRAD:
            backward, setup = _AUTOGRAD[kind]
            op.register_autograd(backward, setup_context=functools.partial(setup, ops,
                                                                           module.reads_out))
    dtensor.register({f"{module.NAME}_{kind}": kind for kind in bodies})
    return ops


#: Implementation name -> its custom ops by kind (triton's added when it is first loaded).
OPS: Dict[str, SimpleNamespace] = {module.NAME: _define(module) for module in (cpu_c, chunked)}


# -- the implementation modules -------------------------------------------------------------------

_triton: list = []  # [module] or [reason it cannot be imported], filled on first use
_triton_lock = threading.Lock()


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _load_triton():
    """The Triton implementation module, or the reason (str) it cannot be imported.  Imported on
    first use only: importing Triton takes a while and CPU calls never need it."""
    if not _triton:
        with _triton_lock:
            if not _triton:
                try:
                    from .kernels import triton_depth
                except ImportError as err:
                    _triton.append(f"Triton cannot be imported ({err})")
                else:
                    OPS["triton"] = _define(triton_depth)
                    _triton.append(triton_depth)
    return _triton[0]


def _check_name(name) -> str:
    if not isinstance(name, str) or name not in IMPLEMENTATIONS:
        raise ValueError(f"impl: expected one of {IMPLEMENTATIONS}, got {name!r}")
    return name


def implementation(name: str):
    """The module of implementation `name` ("triton" imports Triton); ValueError for an unknown
    name or a Triton that cannot be imported."""
    name = _check_name(name)
    if name == "triton":
        module = _load_triton()
        if isinstance(module, str):
            raise ValueError(f"impl: 'triton' is unavailable: {module}")
        return module
    return composite if name == "composite" else _CPU[name]


def availability() -> Dict[str, Optional[str]]:
    """Every implementation name -> None when it can serve calls on this machine and install,
    else a one-line reason."""
    triton = None
    if not torch.cuda.is_available() and not _interpret():
        triton = "no CUDA device"
    elif isinstance(_load_triton(), str):
        triton = _load_triton()
    c_reason = cpu_c.unavailable_reason()  # a compiler's error may span lines: one line here
    return {"triton": triton, "cpu_c": c_reason and " ".join(c_reason.split()), "chunked": None,
            "composite": None}


def capabilities() -> dict:
    """{"dtypes", "devices", "fused_kernel", "deterministic"} of the ops here: the source dtypes
    they accept, the devices they run on, whether a fused kernel (not a composition) serves the
    default op on a device here (the C kernel on the CPU, the Triton kernels on CUDA), and that
    every result is bitwise the same from run to run (C15)."""
    cuda = torch.cuda.is_available()
    fused = cpu_c.available() or (cuda and not isinstance(_load_triton(), str))
    return {"dtypes": ("float64", "float32", "float16", "bfloat16"),
            "devices": ("cpu", "cuda") if cuda else ("cpu",), "fused_kernel": fused,
            "deterministic": True}


# -- forcing and the record -----------------------------------------------------------------------

@contextlib.contextmanager
def use_impl(name: str, **options) -> Iterator[None]:
    """Force every op call inside the block (in this thread / task) onto implementation `name`
    (one of `IMPLEMENTATIONS`, or "auto": the automatic choice).  The torch implementations take no options.  Used by tests, and
    by the Triton tests on CPU tensors under TRITON_INTERPRET=1."""
    if name != "auto":
        _check_name(name)
    if options:
        raise TypeError(f"use_impl: the torch implementations take no options, got {sorted(options)}")
    with _REGISTRY.forcing(None if name == "auto" else name):
        yield


@torch.compiler.assume_constant_result
def forced() -> Optional[str]:
    """The name forced by the innermost `use_impl`, or None.  A constant to torch.compile (it
    cannot trace a ContextVar): a trace keeps the forcing in effect while it was traced."""
    return _REGISTRY.forced()


def record(choice: Choice) -> None:
    """Note that `choice` serves one more call (`last_choice`, `impl_counts`); skipped while
    torch.compile traces (a side effect)."""
    if not torch.compiler.is_compiling():
        _REGISTRY.record(choice)


def last_choice() -> Optional[Choice]:
    """The `Choice` of the most recent op call in this process (any thread), or None."""
    return _REGISTRY.last_choice()


def last_impl() -> Optional[str]:
    """The name of the implementation of the last call (any thread): `last_choice().impl`."""
    return _REGISTRY.last_impl()


def impl_counts() -> Counter:
    """A copy of how many op calls each implementation served since import."""
    return _REGISTRY.impl_counts()


# -- the choice -----------------------------------------------------------------------------------

#: The CPU kernel modules by name (imported with this module: they are cheap to import).
_CPU = {"cpu_c": cpu_c, "chunked": chunked}
#: Under torch.compile, CPU calls without gradient of at most this many token rows (batch-1
#: decode) take the composition, which inductor fuses into the graph: a CPU kernel's custom op
#: there runs its Python per call (docs/benchmarks.md, "A compiled decode step").  Within the
#: tolerances of eager's kernel, not its bits; calls with gradient keep the kernel.
COMPILED_ROWS_MAX = 4


def _compiled_small(call: Call) -> Optional[str]:
    """Why a CPU kernel leaves a call traced by torch.compile to the composition
    (`COMPILED_ROWS_MAX`), or None (not compiling: nothing is read)."""
    if not torch.compiler.is_compiling():
        return None
    rows = call.sources[-1].numel() // max(1, call.sources[-1].shape[-1])
    if type(rows) is not int or rows > COMPILED_ROWS_MAX:  # a symbolic count: no guard on it
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in call.tensors):
        return None
    return (f"torch.compile traces a call of {rows} token rows without gradient (at most "
            f"COMPILED_ROWS_MAX = {COMPILED_ROWS_MAX}): the composition, fused into the graph, costs less")


def _merge_fallback(name: str, call: Call) -> Optional[str]:
    """Why no kernel of implementation `name` merges `call` (None: one may): no merge kernel, or
    gradients / float64.  A forced implementation falls back to the composition for these."""
    if name in _CPU and _CPU[name].merge is None:
        return "it has no merge_partial kernel"
    if call.needs_grad or not call.default_op:
        return "its merge runs only without gradients and for float16/bfloat16/float32 sources"
    return None


def _refusal(name: str, call: Call, forced_call: bool) -> Tuple[Optional[str], object]:
    """(None, module) when implementation `name` takes `call`, else (reason, None)."""
    if name == "composite":
        return None, composite
    if call.op == MERGE:
        reason = _merge_fallback(name, call)
        if reason is None and torch.compiler.is_compiling():  # before the view bits: no graph break
            reason = "its merge is a ctypes call that torch.compile cannot trace"
        elif reason is None and any(is_traceable_wrapper_subclass(t) for t in call.tensors):
            reason = ("its merge takes plain tensors only (a DTensor or other subclass takes the "
                      "composition)")  # the merge is no custom op: it reads raw storage
        elif reason is None and any(t.is_neg() or t.is_conj() for t in call.tensors):
            reason = ("its merge reads raw storage: a tensor with the negative or conjugate view "
                      "bit (torch._neg_view) takes the composition")
        if reason is not None:
            return reason, None
    if name == "triton":
        if not forced_call and not call.on("cuda"):
            return "not every tensor is on a CUDA device", None
        module = _load_triton()
        if isinstance(module, str):
            return module, None
    else:
        module = _CPU[name]
        if not forced_call and not call.on(module.DEVICE_TYPE):
            return f"not every tensor is on the {module.DEVICE_TYPE}", None
        reason = None if forced_call else _compiled_small(call)
        if reason is not None:
            return reason, None
    reason = module.refusal(call)
    return (reason, None) if reason is not None else (None, module)


def decide(call: Call) -> Tuple[object, Choice]:
    """(the module that serves `call`, its `Choice`), nothing recorded.

    Forced: that implementation, or a ValueError naming it, the op and its reason; merge_partial
    under a forced implementation without a merge kernel, or with gradients or float64, is the
    composition's.  Otherwise: the first of `IMPLEMENTATIONS` that takes the call.  The Choice's
    refusals follow `attnres_core.dispatch`'s rule (every implementation before the one that
    served, the unforced ones "not forced").  For plain CPU tensors the answer depends only on
    the call's shapes, dtypes, strides and options and on the forcing, which is what lets `ops`
    keep it per call signature and `record` it again for each repeated call.
    """
    name = forced()
    if name is not None:
        how = f"use_impl({name!r})"
        reason, module = _refusal(name, call, True)
        if reason is None:
            return module, Choice(call.op, name, _REGISTRY.refused_before(name, how))
        if call.op == MERGE and _merge_fallback(name, call) is not None:
            return composite, Choice(call.op, "composite",
                                     _REGISTRY.refused_before("composite", how, {name: reason}))
        raise ValueError(f"impl: {name!r} was forced but cannot take this {call.op} call: {reason}")
    modules = {}

    def reason_of(name):
        reason, modules[name] = _refusal(name, call, False)
        return reason

    name, refused = _REGISTRY.auto(reason_of)
    if name is None:
        raise AssertionError("unreachable: the composition takes every call")
    return modules[name], Choice(call.op, name, refused)


def recorder(choice: Choice):
    """`record(choice)` as a function of no arguments, for a kept plan (`plans.py`: no trace)."""
    return functools.partial(_REGISTRY.record, choice)


forcing_state = _REGISTRY.forced  # `forced` outside any trace (`plans.py`)


# -- running a validated call on the implementation that serves it ---------------------------------
#
# `ops` checks a call and `decide`s; these run it: a kernel through its custom ops (`OPS`) or its
# merge, the composition through `composite`'s functions.


def run_depth_attention(impl, xs, query, norm_weight, out_norm_weight, geo, eps, scale, activation,
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
        out, normed, lse, weights = OPS[impl.NAME].depth_attention_out_norm(
            xs, query, norm_weight, out_norm_weight, eps, scale, geo.out_norm_eps, return_weights,
            save)
        weights = weights.unsqueeze(-1) if return_weights else None
    elif return_weights:  # the kernel's own weights: the p of its lse (same logits, max, sum)
        out, lse, weights = OPS[impl.NAME].depth_attention_weights(xs, query, norm_weight, eps, scale,
                                                             save)
        weights = weights.unsqueeze(-1)
    else:
        out, lse = OPS[impl.NAME].depth_attention(xs, query, norm_weight, eps, scale, save)
        weights = None
    return out, normed, lse, weights


def run_multi(impl, xs, queries, norm_weights, eps, scale, save):
    """The validated phase 1 on its implementation `impl`: (out, lse)."""
    if impl is not composite:
        return OPS[impl.NAME].depth_attention_multi(xs, queries, norm_weights, eps, scale, save)
    outs, lses = [], []
    for s in range(queries.shape[0]):
        out, lse, _ = composite.depth_attention(
            xs, queries[s], None if norm_weights is None else norm_weights[s], eps=eps,
            scale=scale, num_heads=1, activation="softmax", key_norm=True)
        outs.append(out)
        lses.append(lse[..., 0])
    return torch.stack(outs), torch.stack(lses)


def run_merge(impl, out1, lse1, partial, query, norm_weight, eps, scale):
    """The validated merge_partial on its implementation `impl`: (out, lse)."""
    if impl is composite:
        return composite.merge_partial(out1, lse1, partial, query, norm_weight, eps=eps, scale=scale)
    return impl.merge(out1, lse1, partial, query, norm_weight, eps, scale)
