"""The spec's ops for MLX with explicit VJPs (spec sections 2-3, constraints C1-C14).

`depth_attention`, `depth_attention_multi` and `merge_partial` validate with the shared
`attnres_numpy.validation` checks, then run one `mx.custom_function` per static configuration
whose forward and backward are either the Metal kernels (`metal.py`, only where
`mx.metal.is_available()`) or the `mx.compile`d twin (`compiled.py`, everywhere else).  They work
under `mx.compile`, `mx.grad`/`mx.vjp` and `mx.vmap`.

Dtypes (C10): sources float16/bfloat16/float32, and float64 on the CPU device; every
intermediate in float32 (float64 for float64 sources), one final cast of `out` to the sources'
dtype; lse and weights stay in the compute dtype; gradients come back in each input's dtype.
Sources are a list/tuple of N arrays `[..., D]` (never stacked internally) or one stacked
`[N, ..., D]` array (told apart by type).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from attnres_numpy import validation

from . import compiled, metal

Sources = Union[mx.array, Sequence[mx.array]]

_DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32",
                mx.float64: "float64"}


def dtype_name(dtype) -> str:
    """Canonical dtype name for the shared checks ("float32", ...; "int32" etc. otherwise)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).rsplit(".", 1)[-1])


#: The logistic function with the precision rule of the ops (float64 stays float64): the gated
#: residual scheme's gate uses it.
sigmoid = compiled.sigmoid


def compute_dtype(source_dtype) -> mx.Dtype:
    """C10: float64 for float64 sources, else float32."""
    return mx.float64 if source_dtype == mx.float64 else mx.float32


def _require_array(name: str, a) -> mx.array:
    if not isinstance(a, mx.array):
        raise TypeError(f"{name}: expected an mlx.core.array, got {type(a).__name__}")
    return a


def _source_meta(sources: Sources):
    """(shapes, dtype names, stacked) of the sources for the shared checks."""
    if isinstance(sources, mx.array):
        if sources.ndim < 2:
            n = sources.shape[0] if sources.ndim else 0
            return [()] * n, [dtype_name(sources.dtype)] * n, True
        n = sources.shape[0]
        return [tuple(sources.shape[1:])] * n, [dtype_name(sources.dtype)] * n, True
    if not isinstance(sources, (list, tuple)):
        raise TypeError(
            f"sources: expected a list/tuple of arrays [..., D] or one stacked array [N, ..., D], "
            f"got {type(sources).__name__}")
    arrays = [_require_array(f"sources[{i}]", s) for i, s in enumerate(sources)]
    return [tuple(a.shape) for a in arrays], [dtype_name(a.dtype) for a in arrays], False


def _meta(name: str, a) -> Tuple[Optional[tuple], Optional[str]]:
    if a is None:
        return None, None
    a = _require_array(name, a)
    return tuple(a.shape), dtype_name(a.dtype)


@dataclass(frozen=True)
class Static:
    """Everything the traced forward/backward depend on besides array shapes and dtypes.

    mode: "single" (depth_attention) or "multi" (depth_attention_multi: S queries `[S, D]`).
    cached: per source, whether its inverse RMS is passed in (router reuse of sealed blocks).
    """

    mode: str
    num_sources: int
    stacked: bool
    num_heads: int
    eps: float
    scale: float
    activation: str
    key_norm: bool
    cached: Tuple[bool, ...]


def _split(xs, static: Static) -> List[mx.array]:
    return [xs[i] for i in range(static.num_sources)] if static.stacked else list(xs)


def _broadcast_inputs(st: Static, xs, q, g, rs):
    """Compute-dtype broadcast forms (see `compiled`): sources, qg, per-source r, q, g."""
    srcs = _split(xs, st)
    c = compute_dtype(srcs[0].dtype)
    batch = srcs[0].shape[:-1]
    if st.mode == "multi":
        lead = (q.shape[0],) + (1,) * len(batch) + (1,)
        xb = [compiled.heads(x.astype(c)[None], 1) for x in srcs]
        qb = q.astype(c).reshape(*lead, q.shape[-1])
        gb = g.astype(c).reshape(*lead, g.shape[-1])
        rb_given = [r.astype(c)[None] for r in rs]
    else:
        xb = [compiled.heads(x.astype(c), st.num_heads) for x in srcs]
        qb = compiled.heads(q.astype(c), st.num_heads)
        gb = compiled.heads(g.astype(c), st.num_heads)
        rb_given = [r.astype(c) for r in rs]
    it = iter(rb_given)
    rb = [next(it) if cached else None for cached in st.cached]
    return srcs, xb, qb * gb, rb, qb, gb


def _squeeze_heads(a: mx.array, st: Static) -> mx.array:
    return a[..., 0] if st.mode == "multi" or st.num_heads == 1 else a


def _twin_forward_core(st: Static, srcs, xb, qg, rb, q, g, rs):
    """(out `[..(S).., H, Dh]`, p `[N, ..., H]`, lse `[..., H]` | None) in broadcast form."""
    return compiled.attend_forward(xb, qg, rb, eps=st.eps, scale=st.scale,
                                activation=st.activation, key_norm=st.key_norm)


def _twin_backward_core(st: Static, srcs, xb, qg, rb, q, g, rs, d_out, d_lse):
    """(dxs, dqg, drs) in broadcast form (see `compiled.attend_backward`)."""
    g_out = compiled.heads(d_out.astype(qg.dtype), 1 if st.mode == "multi" else st.num_heads)
    if d_lse is not None:
        d_lse = d_lse.astype(qg.dtype)
        d_lse = d_lse[..., None] if st.mode == "multi" or st.num_heads == 1 else d_lse
    return compiled.attend_backward(xb, qg, rb, g_out, d_lse, eps=st.eps, scale=st.scale,
                                 activation=st.activation, key_norm=st.key_norm)


def _forward(core, st: Static, xs, q, g, rs):
    """Outputs of the op from a forward core: out (sources' dtype), lse, weights (single)."""
    srcs, xb, qg, rb, _, _ = _broadcast_inputs(st, xs, q, g, rs)
    out, p, lse = core(st, srcs, xb, qg, rb, q, g, rs)
    shape = srcs[0].shape if st.mode == "single" else (q.shape[0], *srcs[0].shape)
    outs = [out.reshape(shape).astype(srcs[0].dtype)]
    if lse is not None:
        outs.append(_squeeze_heads(lse, st))
    if st.mode == "single":
        outs.append(_squeeze_heads(p, st))
    return tuple(outs)


def _backward(core, st: Static, xs, q, g, rs, d_out, d_lse):
    """Gradients (sources as given, query, gain, cached rs) from a backward core's broadcast
    forms, each summed back to its input's shape and cast to its dtype."""
    srcs, xb, qg, rb, qb, gb = _broadcast_inputs(st, xs, q, g, rs)
    dxs, dqg, drs = core(st, srcs, xb, qg, rb, q, g, rs, d_out, d_lse)
    dxs = [compiled.sum_to(dx, x.shape).reshape(s.shape).astype(s.dtype)
           for dx, x, s in zip(dxs, xb, srcs)]
    d_sources = mx.stack(dxs) if st.stacked else dxs
    dq = compiled.sum_to(dqg * gb, qb.shape).reshape(q.shape).astype(q.dtype)
    dg = compiled.sum_to(dqg * qb, gb.shape).reshape(g.shape).astype(g.dtype)
    d_rs = [compiled.sum_to(dr, r.shape).reshape(given.shape).astype(given.dtype)
            for dr, r, given in zip((d for d in drs if d is not None),
                                    (r for r in rb if r is not None), rs)]
    return d_sources, dq, dg, d_rs


@functools.lru_cache(maxsize=None)
def _attend_fn(st: Static):
    """The custom-VJP function `f(sources, query, norm_weight, cached_rs) -> outputs` of `st`."""
    kernels = (functools.partial(_forward, metal.attend_forward_core, st),
               functools.partial(_backward, metal.attend_backward_core, st))
    twin = (mx.compile(functools.partial(_forward, _twin_forward_core, st)),
            mx.compile(functools.partial(_backward, _twin_backward_core, st)))
    has_lse = st.activation == "softmax"

    def path(xs):
        return kernels if metal.usable((xs if st.stacked else xs[0]).dtype) else twin

    @mx.custom_function
    def f(xs, q, g, rs):
        return path(xs)[0](xs, q, g, rs)

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        xs, q, g, rs = primals
        # Depth weights are not differentiable (C11): their cotangent is ignored.
        return path(xs)[1](xs, q, g, rs, cotangents[0], cotangents[1] if has_lse else None)

    return f


def _gain(norm_weight, dim: int, dtype) -> mx.array:
    return mx.ones((dim,), dtype=dtype) if norm_weight is None else norm_weight


def _check_inv_rms(inv_rms, num_sources: int, batch, num_heads: int, key_norm: bool):
    if inv_rms is None:
        return (False,) * num_sources, []
    if not isinstance(inv_rms, (list, tuple)) or len(inv_rms) != num_sources:
        raise ValueError(f"inv_rms: expected a list of {num_sources} entries (array or None), "
                         f"got {type(inv_rms).__name__}")
    if not key_norm:
        raise ValueError("inv_rms: cached inverse RMS needs key_norm=True")
    expect = tuple(batch) + (num_heads,)
    given = []
    for i, r in enumerate(inv_rms):
        if r is not None:
            shape, dt = _meta(f"inv_rms[{i}]", r)
            if shape != expect or dt not in validation.FLOATING_DTYPES:
                raise ValueError(f"inv_rms[{i}]: expected a floating array of shape {expect}, "
                                 f"got {dt} shape {shape}")
            given.append(r)
    return tuple(r is not None for r in inv_rms), given


def depth_attention(sources: Sources, query: mx.array, norm_weight: Optional[mx.array] = None, *,
                    eps: float = 1e-6, scale: float = 1.0, num_heads: int = 1,
                    activation: str = "softmax", key_norm: bool = True, return_lse: bool = False,
                    return_weights: bool = False, inv_rms=None):
    """Depth attention over N sources (spec section 2).

    Args:
      sources: list/tuple of N arrays `[..., D]` or one stacked array `[N, ..., D]`.
      query: pseudo-query `[D]` or per-token query `[..., D]`; norm_weight: gain `[D]` or None.
      eps, scale, num_heads, activation, key_norm: spec options (C8, C9).
      return_lse, return_weights: also return lse `[...]` (`[..., H]`) and weights `[N, ...]`
        (`[N, ..., H]`), both in the compute dtype; weights are not differentiable.
      inv_rms: optional list with one entry per source, None or that source's inverse RMS
        `[..., H]` (from `inverse_rms`) to reuse instead of recomputing it (key_norm only).
    Returns out `[..., D]` in the sources' dtype, or `(out, lse?, weights?)`.
    """
    shapes, dtypes, stacked = _source_meta(sources)
    q_shape, q_dtype = _meta("query", query)
    g_shape, g_dtype = _meta("norm_weight", norm_weight)
    geo = validation.check_depth_attention(
        shapes, dtypes, q_shape, q_dtype, g_shape, g_dtype, stacked=stacked, eps=eps,
        scale=scale, num_heads=num_heads, activation=activation, key_norm=key_norm,
        return_lse=return_lse)
    cached, given = _check_inv_rms(inv_rms, geo.num_sources, geo.batch_shape, geo.num_heads,
                                   key_norm)
    st = Static("single", geo.num_sources, stacked, geo.num_heads, float(eps), float(scale),
                activation, key_norm, cached)
    outs = _attend_fn(st)(sources if stacked else list(sources), query,
                          _gain(norm_weight, geo.dim, query.dtype), given)
    out, extra = outs[0], []
    if return_lse:
        extra.append(outs[1])
    if return_weights:
        extra.append(mx.stop_gradient(outs[-1]))
    return (out, *extra) if extra else out


def depth_attention_multi(sources: Sources, queries: mx.array,
                          norm_weights: Optional[mx.array] = None, *, eps: float = 1e-6,
                          scale: float = 1.0, inv_rms=None):
    """Phase 1 of the two-phase schedule (spec 3.1): S pseudo-queries over N sources.

    Args: sources `N x [..., D]` or `[N, ..., D]`; queries `[S, D]`; norm_weights `[S, D]` or
      None; inv_rms: as in `depth_attention` (entries `[..., 1]`).
    Returns (out `[S, ..., D]` in the sources' dtype, lse `[S, ...]` in the compute dtype).
    """
    shapes, dtypes, stacked = _source_meta(sources)
    q_shape, q_dtype = _meta("queries", queries)
    g_shape, g_dtype = _meta("norm_weights", norm_weights)
    geo = validation.check_multi(shapes, dtypes, q_shape, q_dtype, g_shape, g_dtype,
                                 stacked=stacked, eps=eps, scale=scale)
    cached, given = _check_inv_rms(inv_rms, geo.num_sources, geo.batch_shape, 1, True)
    st = Static("multi", geo.num_sources, stacked, 1, float(eps), float(scale), "softmax", True,
                cached)
    gains = mx.ones(queries.shape, dtype=queries.dtype) if norm_weights is None else norm_weights
    out, lse = _attend_fn(st)(sources if stacked else list(sources), queries, gains, given)
    return out, lse


def _twin_merge_forward_core(eps, scale, o1, l1, x, q, g):
    c = compute_dtype(x.dtype)
    out, lse = compiled.merge_forward(o1.astype(c), l1.astype(c), x.astype(c),
                                   q.astype(c) * g.astype(c), eps=eps, scale=scale)
    return out.astype(x.dtype), lse


def _twin_merge_backward_core(eps, scale, o1, l1, x, q, g, d_out, d_lse):
    c = compute_dtype(x.dtype)
    return compiled.merge_backward(o1.astype(c), l1.astype(c), x.astype(c),
                                q.astype(c) * g.astype(c), d_out.astype(c), d_lse.astype(c),
                                eps=eps, scale=scale)


def _merge_backward(core, eps, scale, o1, l1, x, q, g, d_out, d_lse):
    """Gradients of (out1, lse1, partial, query, gain) in their own dtypes and shapes."""
    d_o1, d_l1, d_x, dqg = core(eps, scale, o1, l1, x, q, g, d_out, d_lse)
    qc, gc = q.astype(dqg.dtype), g.astype(dqg.dtype)
    return (d_o1.astype(o1.dtype), d_l1.astype(l1.dtype), d_x.astype(x.dtype),
            compiled.sum_to(dqg * gc, q.shape).astype(q.dtype),
            compiled.sum_to(dqg * qc, g.shape).astype(g.dtype))


@functools.lru_cache(maxsize=None)
def _merge_fn(eps: float, scale: float):
    """The custom-VJP `f(out1, lse1, partial, query, norm_weight) -> (out, lse)`."""
    kernels = (functools.partial(metal.merge_forward_core, eps, scale),
               functools.partial(_merge_backward, metal.merge_backward_core, eps, scale))
    twin = (mx.compile(functools.partial(_twin_merge_forward_core, eps, scale)),
            mx.compile(functools.partial(_merge_backward, _twin_merge_backward_core, eps, scale)))

    def path(x):
        return kernels if metal.usable(x.dtype) else twin

    @mx.custom_function
    def f(o1, l1, x, q, g):
        return path(x)[0](o1, l1, x, q, g)

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        return path(primals[2])[1](*primals, *cotangents)

    return f


def merge_partial(out1: mx.array, lse1: mx.array, partial: mx.array, query: mx.array,
                  norm_weight: Optional[mx.array] = None, *, eps: float = 1e-6,
                  scale: float = 1.0, return_lse: bool = False):
    """Phase 2 (spec 3.2): merge phase-1 `(out1 [..., D], lse1 [...])` with `partial [..., D]`.

    query `[D]` or `[..., D]`; norm_weight `[D]` or None.  Returns out `[..., D]` (partial's
    dtype) and, with return_lse, the merged lse `[...]` (compute dtype).
    """
    metas = [_meta(n, a) for n, a in (("out1", out1), ("lse1", lse1), ("partial", partial),
                                      ("query", query), ("norm_weight", norm_weight))]
    geo = validation.check_merge(*(v for m in metas for v in m), eps=eps, scale=scale)
    out, lse = _merge_fn(float(eps), float(scale))(
        out1, lse1, partial, query, _gain(norm_weight, geo.dim, query.dtype))
    return (out, lse) if return_lse else out


def inverse_rms(x: mx.array, *, eps: float = 1e-6, num_heads: int = 1) -> mx.array:
    """Per-head inverse RMS of a source `[..., D]` -> `[..., H]` in the compute dtype.

    Differentiable (plain MLX autodiff); pass it to `depth_attention(..., inv_rms=...)`.
    """
    x = _require_array("x", x)
    c = compute_dtype(x.dtype)
    return compiled.inverse_rms(compiled.heads(x.astype(c), num_heads), eps)
