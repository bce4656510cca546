"""The spec's ops for MLX with explicit VJPs, the whole of C1-C17: `depth_attention` (spec
section 2, with the fused output norm C17), `depth_attention_multi` and `merge_partial`
(section 3, C13-C14), deterministic (C15) and without limits on N or D (C16); and
`inverse_rms`, the per-source statistic the router caches.

Each op validates with the shared `attnres_core.validation` checks, asks the registry
(`dispatch.choose`) once per call which implementation serves it, and runs one
`mx.custom_function` per static configuration and implementation, whose forward and backward
are that implementation's entry points (`kernels/metal.py` or `kernels/compiled.py`).  They work
under `mx.compile`, `mx.grad`/`mx.vjp` and `mx.vmap`.  Forcing an implementation, and finding
out which one ran, is `dispatch`'s (`use_impl`, `last_choice`, `impl_counts`).

Dtypes (C10): sources float16/bfloat16/float32, and float64 on the CPU device; every
intermediate in the compute dtype (`compute_dtype`: float32, or float64 for float64 sources),
one final cast of `out` (and of `out_normed`, the fused output norm of C17, computed from `out`
in the compute dtype) to the sources' dtype; lse and weights stay in the compute dtype;
gradients come back in each input's dtype.  Sources are a list/tuple of N arrays `[..., D]`
(never stacked internally) or one stacked `[N, ..., D]` array (told apart by type; never split
into a list), passed to the implementation as given.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx
from attnres_core import validation

from . import dispatch
from .common import compute_dtype, dtype_name
from .dispatch import Implementation
from .kernels import compiled

Sources = Union[mx.array, Sequence[mx.array]]

#: The logistic function with the precision rule of the ops (float64 stays float64): the gated
#: residual scheme's gate uses it.
sigmoid = compiled.sigmoid


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
    stacked: sources are one `[N, ..., D]` array (else a list of N `[..., D]`).
    cached: per source, whether its inverse RMS is passed in (router reuse of sealed blocks).
    out_norm_eps: the fused output norm's epsilon (C17), or None when it is off.
    vectorized: the compiled forward reduces over all sources at once (a small call, see
      `compiled.VECTOR_MAX_ELEMENTS`) instead of source by source.
    stacked_rms: the cached inverse RMS is one stacked `[N, ..., H]` array (every source's).
    with_lse, with_weights: the single-query op also returns lse (softmax) / the weights (the
      caller asked for them; phase 1 always returns lse).
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
    out_norm_eps: Optional[float] = None
    vectorized: bool = False
    stacked_rms: bool = False
    with_lse: bool = True
    with_weights: bool = True


@functools.lru_cache(maxsize=None)
def _attend_fn(st: Static, impl: Implementation):
    """The custom-VJP function `f(sources, query, norm_weight, cached_rs, [out_norm_weight]) ->
    outputs` of `st`, forward and backward both on `impl` (the choice made for the call)."""
    has_lse = st.activation == "softmax" and (st.mode == "multi" or st.with_lse)
    has_normed = st.out_norm_eps is not None

    @mx.custom_function
    def f(xs, q, g, rs, ws):
        return impl.attend_forward(st, xs, q, g, rs, ws)

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        # Outputs (out, out_normed?, lse?, weights?); depth weights are not differentiable
        # (C11): their cotangent is ignored.
        d_normed = cotangents[1] if has_normed else None
        d_lse = cotangents[1 + has_normed] if has_lse else None
        return impl.attend_backward(st, *primals, cotangents[0], d_normed, d_lse)

    return f


#: `validation.check_depth_attention` memoized on its (hashable) arguments: a decode step calls
#: the op with the same few signatures on every token.
_checked_depth_attention = functools.lru_cache(maxsize=4096)(validation.check_depth_attention)


def _source_dtype(sources: Sources, stacked: bool):
    return sources.dtype if stacked else sources[0].dtype


def _gain(norm_weight, dim: int, dtype) -> mx.array:
    return mx.ones((dim,), dtype=dtype) if norm_weight is None else norm_weight


def _check_inv_rms(inv_rms, num_sources: int, batch, num_heads: int, key_norm: bool,
                   stacked: bool):
    """(cached per source, the given arrays, whether they are one stacked array)."""
    if inv_rms is None:
        return (False,) * num_sources, [], False
    if isinstance(inv_rms, mx.array):
        expect = (num_sources,) + tuple(batch) + (num_heads,)
        if not stacked:
            raise ValueError(f"inv_rms: one stacked array {expect} needs stacked sources "
                             f"[N, ..., D]; pass a list with one entry per listed source")
        if not key_norm:
            raise ValueError("inv_rms: cached inverse RMS needs key_norm=True")
        dt = dtype_name(inv_rms.dtype)
        if tuple(inv_rms.shape) != expect or dt not in validation.FLOATING_DTYPES:
            raise ValueError(f"inv_rms: expected a floating array of shape {expect}, got {dt} "
                             f"shape {tuple(inv_rms.shape)}")
        return (True,) * num_sources, [inv_rms], True
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
    return tuple(r is not None for r in inv_rms), given, False


def depth_attention(sources: Sources, query: mx.array, norm_weight: Optional[mx.array] = None, *,
                    eps: float = 1e-6, scale: float = 1.0, num_heads: int = 1,
                    activation: str = "softmax", key_norm: bool = True, return_lse: bool = False,
                    return_weights: bool = False, out_norm_weight: Optional[mx.array] = None,
                    out_norm_eps: Optional[float] = None, inv_rms=None):
    """Depth attention over N sources (spec section 2).

    Args:
      sources: list/tuple of N arrays `[..., D]` or one stacked array `[N, ..., D]`.
      query: pseudo-query `[D]` or per-token query `[..., D]`; norm_weight: gain `[D]` or None.
      eps, scale, num_heads, activation, key_norm: spec options (C8, C9).
      return_lse, return_weights: also return lse `[...]` (`[..., H]`) and weights `[N, ...]`
        (`[N, ..., H]`), both in the compute dtype; weights are not differentiable.
      out_norm_weight: None, or `[D]` (any floating dtype): also return out_normed `[..., D]`
        = rmsnorm(out) * out_norm_weight over all D channels, in the sources' dtype, computed
        from out in the compute dtype in the same pass (C17, the next sublayer's pre-norm);
        out_norm_eps: its epsilon (None: eps).
      inv_rms: optional list with one entry per source, None or that source's inverse RMS
        `[..., H]` (from `inverse_rms`) to reuse instead of recomputing it (key_norm only); for
        stacked sources also one stacked array `[N, ..., H]`, every source's inverse RMS.
    Returns:
      out `[..., D]` in the sources' dtype, or `(out, out_normed?, lse?, weights?)`.
    """
    shapes, dtypes, stacked = _source_meta(sources)
    q_shape, q_dtype = _meta("query", query)
    g_shape, g_dtype = _meta("norm_weight", norm_weight)
    w_shape, w_dtype = _meta("out_norm_weight", out_norm_weight)
    args = (tuple(shapes), tuple(dtypes), q_shape, q_dtype, g_shape, g_dtype)
    kw = dict(stacked=stacked, eps=eps, scale=scale, num_heads=num_heads, activation=activation,
              key_norm=key_norm, return_lse=return_lse, out_norm_weight_shape=w_shape,
              out_norm_weight_dtype=w_dtype, out_norm_eps=out_norm_eps)
    try:  # the checks are a pure function of shapes, dtypes and options: once per signature
        geo = _checked_depth_attention(*args, **kw)
    except TypeError:  # an unhashable option: check uncached (and raise its own error)
        geo = validation.check_depth_attention(*args, **kw)
    cached, given, stacked_rms = _check_inv_rms(inv_rms, geo.num_sources, geo.batch_shape,
                                                geo.num_heads, key_norm, stacked)
    normed = out_norm_weight is not None
    impl = dispatch.choose("depth_attention", _source_dtype(sources, stacked))
    if stacked_rms and not impl.stacked_inv_rms:  # e.g. the kernels: one r per source
        given, stacked_rms = [given[0][i] for i in range(geo.num_sources)], False
    elements = geo.num_sources * math.prod(geo.batch_shape) * geo.dim
    st = Static("single", geo.num_sources, stacked, geo.num_heads, float(eps), float(scale),
                activation, key_norm, cached, geo.out_norm_eps,
                vectorized=elements <= compiled.VECTOR_MAX_ELEMENTS, stacked_rms=stacked_rms,
                with_lse=return_lse, with_weights=return_weights)
    outs = _attend_fn(st, impl)(sources if stacked else list(sources), query,
                                _gain(norm_weight, geo.dim, query.dtype), given,
                                [out_norm_weight] if normed else [])
    out, extra = outs[0], list(outs[1:1 + normed])
    if return_lse:
        extra.append(outs[1 + normed])
    if return_weights:
        extra.append(mx.stop_gradient(outs[-1]))
    return (out, *extra) if extra else out


def depth_attention_multi(sources: Sources, queries: mx.array,
                          norm_weights: Optional[mx.array] = None, *, eps: float = 1e-6,
                          scale: float = 1.0, inv_rms=None):
    """Phase 1 of the two-phase schedule (spec 3.1): S pseudo-queries over N sources.

    Args:
      sources: `N x [..., D]` or `[N, ..., D]`.
      queries: `[S, D]`.
      norm_weights: `[S, D]` or None.
      eps, scale: spec options.
      inv_rms: as in `depth_attention` (entries `[..., 1]`).

    Returns:
      (out `[S, ..., D]` in the sources' dtype, lse `[S, ...]` in the compute dtype).
    """
    shapes, dtypes, stacked = _source_meta(sources)
    q_shape, q_dtype = _meta("queries", queries)
    g_shape, g_dtype = _meta("norm_weights", norm_weights)
    geo = validation.check_multi(shapes, dtypes, q_shape, q_dtype, g_shape, g_dtype,
                                 stacked=stacked, eps=eps, scale=scale)
    if isinstance(inv_rms, mx.array):
        raise ValueError("inv_rms: depth_attention_multi takes a list with one entry per source "
                         "(None or `[..., 1]`), not one stacked array")
    cached, given, _ = _check_inv_rms(inv_rms, geo.num_sources, geo.batch_shape, 1, True,
                                      stacked)
    st = Static("multi", geo.num_sources, stacked, 1, float(eps), float(scale), "softmax", True,
                cached)
    gains = mx.ones(queries.shape, dtype=queries.dtype) if norm_weights is None else norm_weights
    impl = dispatch.choose("depth_attention_multi", _source_dtype(sources, stacked))
    out, lse = _attend_fn(st, impl)(sources if stacked else list(sources), queries, gains, given,
                                    [])
    return out, lse


@functools.lru_cache(maxsize=None)
def _merge_fn(eps: float, scale: float, impl: Implementation):
    """The custom-VJP `f(out1, lse1, partial, query, norm_weight) -> (out, lse)` on `impl`."""

    @mx.custom_function
    def f(o1, l1, x, q, g):
        return impl.merge_forward(eps, scale, o1, l1, x, q, g)

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        return impl.merge_backward(eps, scale, *primals, *cotangents)

    return f


def merge_partial(out1: mx.array, lse1: mx.array, partial: mx.array, query: mx.array,
                  norm_weight: Optional[mx.array] = None, *, eps: float = 1e-6,
                  scale: float = 1.0, return_lse: bool = False):
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
      out `[..., D]` in partial's dtype and, with return_lse, the merged lse `[...]` (compute
      dtype).
    """
    for name, a in (("out1", out1), ("lse1", lse1), ("partial", partial), ("query", query)):
        _require_array(name, a)  # None included: a TypeError naming it (norm_weight may be None)
    metas = [_meta(n, a) for n, a in (("out1", out1), ("lse1", lse1), ("partial", partial),
                                      ("query", query), ("norm_weight", norm_weight))]
    geo = validation.check_merge(*(v for m in metas for v in m), eps=eps, scale=scale)
    out, lse = _merge_fn(float(eps), float(scale), dispatch.choose("merge_partial", partial.dtype))(
        out1, lse1, partial, query, _gain(norm_weight, geo.dim, query.dtype))
    return (out, lse) if return_lse else out


def inverse_rms(x: mx.array, *, eps: float = 1e-6, num_heads: int = 1) -> mx.array:
    """Per-head inverse RMS of a source `[..., D]` -> `[..., H]` in the compute dtype.

    Differentiable (plain MLX autodiff); pass it to `depth_attention(..., inv_rms=...)`.
    """
    x = _require_array("x", x)
    return _inverse_rms_fn(float(eps), int(num_heads))(x)


@functools.lru_cache(maxsize=None)
def _inverse_rms_fn(eps: float, num_heads: int):
    """`inverse_rms` of one (eps, heads) as one compiled function (a few fused graph nodes
    instead of a dozen eager ones: the router calls it on every sealed source)."""
    def f(x):
        return compiled.inverse_rms(compiled.heads(x.astype(compute_dtype(x.dtype)), num_heads),
                                    eps)
    return mx.compile(f)
