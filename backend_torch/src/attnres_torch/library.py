"""Registration of the kernel implementations' `torch.library` custom ops (namespace `attnres`).

Each kernel implementation module ("triton": `kernels/triton_depth.py`, "cpu_c": `kernels/cpu_c.py`,
"chunked": `kernels/chunked.py`) writes the bodies of its ops and calls `define(name, bodies, reads_out)`
once, at its import.  `define` registers every body as the custom op `attnres::<name>_<kind>`
with a shape-only fake implementation, explicit autograd and the DTensor sharding strategies of
`dtensor.py`, so `torch.compile(fullgraph=True)` treats each op as one graph node.  Nothing here
runs between an op call and its kernel: the forward op runs the implementation's own body, and
autograd runs the backward formula below, which calls the implementation's backward op.

Op kinds (`KINDS`) and their schemas (a kernel without the fused output norm defines the first
four only):
  depth_attention(sources N x [..., D], query [D] | [..., D], norm_weight [D]?, eps, scale, save)
      -> (out [..., D] sources' dtype, lse [...] fp32)
  depth_attention_weights(same arguments) -> (out, lse, weights [N, ...] fp32 of that lse)
  depth_attention_backward(sources, query, norm_weight, out?, lse, d_out, d_lse?, eps, scale)
      -> [d_source_0 .. d_source_{N-1}, d_query (fp32, query's shape), d_norm_weight (fp32 [D])]
  depth_attention_multi(sources, queries [S, D], norm_weights [S, D]?, eps, scale, save)
      -> (out [S, ..., D] sources' dtype, lse [S, ...] fp32)
  depth_attention_out_norm(sources, query, norm_weight?, out_norm_weight [D], eps, scale,
                           out_norm_eps, with_weights, save)
      -> (out, out_normed [..., D] sources' dtype, lse [...] fp32, weights [N, ...] fp32 or [0])
      the fused output norm (C17); depth_attention_out_norm_backward (out? as above) returns
      depth_attention_backward's list plus d_out_norm_weight (fp32 [D]).

The backward saves only references to the inputs, the fp32 lse and, depending on `save`
(`SAVE_MODES`), the output (no stacked or normalized copy of the sources); the kernels recompute
the rms inverses.  `reads_out(dtype, out_norm)` says where an implementation's backward reads
`out` (only Triton's, for fp32 sources without the fused norm); every other kernel backward
recomputes what it needs from the sources and takes out=None:
  "auto"  (`ops`' default) saves `out` exactly where the backward reads it;
  "out"   saves `out` on every kernel (kept alive, read only where "auto" saves it);
  "stats" saves the lse alone; where the backward reads `out` it reruns the forward op first
          (the same kernel on the same inputs: bitwise the saved `out`).
`save` has no default: a custom op's autograd drops an argument passed at its default.

Every body computes with autocast disabled (C3a, C10: the chunked kernel's fp32 matmuls must stay
fp32 inside a `torch.autocast` region, in the forward, the backward and inside compiled graphs);
mixed source dtypes are promoted before the ops, in `ops.py` (`torch.library.register_autocast`
casts every input to one fixed dtype, which would round fp32 sources to bf16).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Callable, Dict

import torch

from . import dtensor

#: The values of the forward ops' `save` argument (see above; `ops.depth_attention(save=...)`).
SAVE_MODES = ("auto", "out", "stats")

#: The op kinds an implementation may define (the DTensor strategies cover each).
KINDS = dtensor.OPS


def check_save(save) -> None:
    """ValueError unless `save` is one of `SAVE_MODES`."""
    if not isinstance(save, str) or save not in SAVE_MODES:
        raise ValueError(f"save: expected one of {SAVE_MODES}, got {save!r}")


# -- fake (meta) implementations: shapes only -----------------------------------------------------

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


# -- autograd --------------------------------------------------------------------------------------

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


def define(name: str, bodies: Dict[str, Callable],
           reads_out: Callable[[torch.dtype, bool], bool]) -> SimpleNamespace:
    """Register implementation `name`'s op bodies (kind -> annotated function, see the module
    docstring) as the custom ops `attnres::<name>_<kind>`, with fakes, autograd and DTensor
    strategies; called once per implementation, at its import.  Returns the ops by kind."""
    unknown = set(bodies) - set(_FAKES)
    if unknown or "depth_attention_backward" not in bodies:
        raise ValueError(f"bodies: expected kinds among {KINDS} with a backward, got {sorted(bodies)}")
    ops = SimpleNamespace()
    for kind, body in bodies.items():
        op = torch.library.custom_op(f"attnres::{name}_{kind}", body, mutates_args=())
        op.register_fake(_FAKES[kind])
        setattr(ops, kind, op)
    for kind in bodies:
        if kind in _AUTOGRAD:
            backward, setup = _AUTOGRAD[kind]
            getattr(ops, kind).register_autograd(
                backward, setup_context=functools.partial(setup, ops, reads_out))
    dtensor.register({f"{name}_{kind}": kind for kind in bodies})
    return ops

