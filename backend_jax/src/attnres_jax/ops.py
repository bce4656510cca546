"""The spec's operators in JAX (spec sections 2-3): `depth_attention`, `depth_attention_multi`,
`merge_partial`.

Pure functions: they work under `jax.jit`, `jax.grad`, `jax.vjp`, `jax.vmap`, `jax.checkpoint`
and `shard_map`, and validate shapes and dtypes at trace time with the shared checks of
`attnres_core.validation`.  Each call checks its arguments and hands them, with the `Request`
an implementation is chosen from, to the registry (`dispatch.attend` / `dispatch.merge`), which
chooses the implementation (from the `impl` keyword, a `dispatch.use_impl` block, the platform
and the shapes) and runs the custom VJP with it as a static argument.

Layout of the package (a call: ops -> dispatch -> one implementation):
  ops               the public functions (this module)
  dispatch          the registry, the per-call choice, the custom VJPs, the public contract
  kernels/xla       the `xla` implementation: the XLA formulas and VJP rules
  kernels/pallas    the `pallas` implementation: `Pallas` and the Pallas kernels
  _math             what both implementations share (query side, column layout, numerics)
  _args             argument handling, static options, the compute dtype (C10), `Request`

Numerics (C10): every intermediate in the compute dtype (float32, float64 for float64 sources),
one final cast to the sources' dtype.  float64 needs `jax_enable_x64` (e.g.
`with jax.enable_x64(True):`); inputs are converted with `jnp.asarray`, so JAX's usual dtype
canonicalization applies.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
from attnres_core import validation

from . import dispatch
from ._args import (
    MergeOptions,
    Options,
    Request,
    as_array,
    canonical_sources,
    compute_dtype,
    dtype_name,
    meta,
    optional,
)
from ._math import HIGHEST

__all__ = ["depth_attention", "depth_attention_multi", "merge_partial", "dtype_name", "canonical_sources",
           "compute_dtype", "HIGHEST", "Sources"]

Sources = Union[jax.Array, Sequence[jax.Array]]


def _request(op: str, shape, dtype: str, *, num_heads: int = 1, num_sources: int = 2, num_sets: int = 1,
             per_token: bool = False, out_norm: bool = False, masked: bool = False) -> Request:
    return Request(op, jax.default_backend(), dtype, shape[-1], num_heads, num_sources, num_sets, per_token,
                   out_norm, masked)


def depth_attention(
    sources: Sources,
    query,
    norm_weight=None,
    *,
    eps: float = 1e-6,
    scale: float = 1.0,
    num_heads: int = 1,
    activation: str = "softmax",
    key_norm: bool = True,
    return_lse: bool = False,
    return_weights: bool = False,
    out_norm_weight=None,
    out_norm_eps: Optional[float] = None,
    num_valid=None,
    impl: Optional[str] = None,
):
    """Depth attention over N sources (spec section 2, C1-C12; the fused output norm C17, 2.6).

    Args:
      sources: a list/tuple of N >= 1 arrays `[..., D]` or one stacked array `[N, ..., D]`.
      query: pseudo-query `[D]` or per-token query `[..., D]` (any floating dtype).
      norm_weight: key RMSNorm gain `[D]`, or None.
      eps, scale, num_heads, activation, key_norm: the spec's options (static Python values).
      return_lse / return_weights: also return lse `[...]` (`[..., H]` if H > 1, compute dtype,
        differentiable) and the depth weights `[N, ...]` (`[N, ..., H]`, not differentiable).
      out_norm_weight: gain `[D]` (any floating dtype) of the fused output norm (C17), or None;
        then also return out_normed `[..., D]` = rmsnorm(out) * out_norm_weight over all D
        channels, from out in the compute dtype in the same pass (differentiable, also in
        out_norm_weight).
      out_norm_eps: that norm's eps (None: `eps`); only with out_norm_weight.
      num_valid: None, or an int / 0-d integer array n (traced under `jit` or `scan`, 1 <= n <= N;
        the value is not checked) for stacked sources `[N, ..., D]`: only the first n rows are
        attended, the others are masked (logit -inf: weight and gradient exact zeros, so the
        result is that of the n rows alone when the masked rows are finite).  XLA only.
      impl: None (automatic: Pallas kernels where they apply on GPU/TPU, else XLA), "xla" or
        "pallas" (ValueError if the kernels cannot run the call); see `attnres_jax.dispatch`.

    Returns: out `[..., D]` in the sources' dtype, or `(out, out_normed?, lse?, weights?)` in that
    order (out_normed `[..., D]` in the sources' dtype).
    """
    sources, shapes, dtypes, stacked = canonical_sources(sources)
    query, norm_weight, out_norm_weight = as_array(query, "query"), optional(norm_weight), optional(out_norm_weight)
    onw_shape, onw_dtype = meta(out_norm_weight)
    geo = validation.check_depth_attention(
        shapes, dtypes, query.shape, dtype_name(query), *meta(norm_weight), stacked=stacked,
        eps=eps, scale=scale, num_heads=num_heads, activation=activation, key_norm=key_norm,
        return_lse=return_lse, out_norm_weight_shape=onw_shape, out_norm_weight_dtype=onw_dtype,
        out_norm_eps=out_norm_eps,
    )
    normed = out_norm_weight is not None
    if num_valid is not None:
        if not stacked:
            raise ValueError("num_valid: needs the sources stacked as one array [N, ..., D], "
                             "got a list of arrays")
        if impl == "pallas":
            raise ValueError("impl='pallas' cannot run a masked read (num_valid); use impl=None or 'xla'")
        num_valid = as_array(num_valid)
        if num_valid.shape != () or not jax.numpy.issubdtype(num_valid.dtype, jax.numpy.integer):
            raise ValueError(f"num_valid: expected an int or a 0-d integer array, got shape "
                             f"{num_valid.shape} dtype {num_valid.dtype}")
    opts = Options(float(eps), float(scale), geo.num_heads, activation, key_norm, multi=False,
                   out_norm_eps=float(geo.out_norm_eps) if normed else None)
    request = _request("depth_attention", shapes[0], dtypes[0], num_heads=geo.num_heads, num_sources=len(shapes),
                       per_token=query.ndim > 1, out_norm=normed, masked=num_valid is not None)
    out, out_normed, lse, p = dispatch.attend(impl, request, opts, sources, query, norm_weight, out_norm_weight,
                                              num_valid)
    extra = [out_normed[0]] if normed else []
    if return_lse:
        extra.append(lse[0] if geo.num_heads > 1 else lse[0, ..., 0])
    if return_weights:
        p = jax.lax.stop_gradient(p[:, 0])  # C11
        extra.append(p if geo.num_heads > 1 else p[..., 0])
    return (out[0], *extra) if extra else out[0]


def depth_attention_multi(sources: Sources, queries, norm_weights=None, *, eps: float = 1e-6,
                          scale: float = 1.0, impl: Optional[str] = None):
    """Phase 1 of the two-phase schedule (spec 3.1): S pseudo-queries over N sources.

    Args:
      sources: `N x [..., D]` or `[N, ..., D]`.
      queries: `[S, D]`.
      norm_weights: `[S, D]` or None.
      eps, scale: spec options.
      impl: as in `depth_attention`.

    Returns:
      (out `[S, ..., D]` in the sources' dtype, lse `[S, ...]` in the compute dtype); row s
      equals `depth_attention(sources, queries[s], norm_weights[s], return_lse=True)`.
    """
    sources, shapes, dtypes, stacked = canonical_sources(sources)
    queries, norm_weights = as_array(queries, "queries"), optional(norm_weights)
    validation.check_multi(shapes, dtypes, queries.shape, dtype_name(queries),
                           *meta(norm_weights), stacked=stacked, eps=eps, scale=scale)
    opts = Options(float(eps), float(scale), 1, "softmax", True, multi=True)
    request = _request("depth_attention_multi", shapes[0], dtypes[0], num_sources=len(shapes),
                       num_sets=queries.shape[0])
    out, _, lse, _ = dispatch.attend(impl, request, opts, sources, queries, norm_weights, None)
    return out, lse[..., 0]


def merge_partial(out1, lse1, partial, query, norm_weight=None, *, eps: float = 1e-6,
                  scale: float = 1.0, return_lse: bool = False, impl: Optional[str] = None):
    """Phase 2 (spec 3.2): online-softmax merge of phase 1 with the intra-block partial sum.

    Args:
      out1: phase 1's output `[..., D]` for this query.
      lse1: phase 1's lse `[...]`.
      partial: the intra-block partial sum `[..., D]`.
      query: `[D]` or `[..., D]`.
      norm_weight: the key norm's gain `[D]` or None.
      eps, scale: spec options.
      return_lse: also return the merged lse.
      impl: as in `depth_attention`.

    Returns:
      out `[..., D]` in partial's dtype (and lse `[...]` in the compute dtype if return_lse),
      equal to `depth_attention(phase1_sources + [partial], query, norm_weight)`.
    """
    out1, lse1, partial, query = (as_array(a, name) for a, name in zip((out1, lse1, partial, query),
                                                                       ("out1", "lse1", "partial", "query")))
    norm_weight = optional(norm_weight)
    validation.check_merge(out1.shape, dtype_name(out1), lse1.shape, dtype_name(lse1), partial.shape,
                           dtype_name(partial), query.shape, dtype_name(query), *meta(norm_weight),
                           eps=eps, scale=scale)
    request = _request("merge_partial", partial.shape, dtype_name(partial), per_token=query.ndim > 1)
    out, lse = dispatch.merge(impl, request, MergeOptions(float(eps), float(scale)), out1, lse1, partial, query,
                              norm_weight)
    return (out, lse) if return_lse else out
