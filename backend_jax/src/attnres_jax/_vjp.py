"""The custom VJPs of the ops: `attend` (depth attention and phase 1) and `merge` (phase 2).

Each takes the implementation chosen by `pallas.dispatch.select` and the call's static options as
nondiff arguments (hashable), so the forward and its backward run the same implementation and a
trace is keyed by both.  The residuals are the inputs themselves plus per-token statistics in the
compute dtype (C10; with the fused output norm, C17, the XLA path also keeps out in the compute
dtype and its rho, the Pallas backward kernel recomputes out); gradients are cast once to their
inputs' dtypes, and under `shard_map` given their primals' types (`_like_primals`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _xla
from ._args import MergeOptions, Options, compute_dtype, restack, sum_to, unstack


def _varying_axes(x) -> frozenset:
    """Mesh axes over which x varies inside `shard_map` (empty outside it)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older JAX


def _like_primals(cotangents, primals):
    """Give every cotangent its primal's type under `shard_map`: a gradient built from
    token-sharded data varies over mesh axes that a replicated primal (a pseudo-query, a gain)
    does not, and the gradient of a replicated input is the sum over those axes (what JAX's own
    autodiff inserts for replicated inputs).  A no-op outside `shard_map`."""

    def one(ct, primal):
        if ct is None:
            return None
        extra = _varying_axes(ct) - _varying_axes(primal)
        return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct

    return jax.tree_util.tree_map(one, cotangents, primals, is_leaf=lambda x: x is None)


# -- depth attention and phase 1 ---------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attend(impl, opts: Options, sources, query, norm_weight, out_norm_weight=None, num_valid=None):
    """sources N x `[..., D]` or `[N, ..., D]`; query `[D]`, `[..., D]` or `[S, D]` (multi);
    out_norm_weight `[D]` or None (C17: needs `opts.out_norm_eps`); num_valid: None or a 0-d
    integer array, the sources attended (the others masked: XLA only, `_xla.forward`).
    Returns out `[S, ..., D]` (sources' dtype), out_normed `[S, ..., D]` (sources' dtype) or None,
    lse `[S, ..., H]` (compute dtype) or None, weights `[N, S, ..., H]` (compute dtype)."""
    return _attend_fwd(impl, opts, sources, query, norm_weight, out_norm_weight, num_valid)[0]


def _attend_fwd(impl, opts: Options, sources, query, norm_weight, out_norm_weight=None, num_valid=None):
    xs = unstack(sources)
    ct = compute_dtype(xs[0].dtype)  # C10
    qs = _xla.query_side(query, norm_weight, opts, xs[0].shape[-1], ct)
    normed, saved = None, None
    mask = {} if num_valid is None else {"num_valid": num_valid}  # masked rows: p = 0, no backward change
    if opts.out_norm_eps is None:
        run = impl.phase1 if opts.multi else impl.forward
        out, lse, p, r, s = run(xs, qs, opts, ct, **mask)
    else:  # C17: out_normed from out in the compute dtype, in the same pass
        out, lse, p, r, s, normed, saved = impl.forward_normed(xs, qs, opts, ct, out_norm_weight.astype(ct),
                                                               **mask)
        normed = normed.astype(xs[0].dtype)  # C10: its one final cast
    sets = qs.num_sets
    out = out.astype(xs[0].dtype)  # C10: the one final cast
    lse = None if lse is None else _xla.split_columns(lse, sets)
    weights = jnp.moveaxis(_xla.split_columns(p, sets), 0, 1)  # [N, S, ..., H]
    return (out, normed, lse, weights), (sources, query, norm_weight, out_norm_weight, p, r, s, saved)


def _attend_bwd(impl, opts: Options, res, cotangents):
    sources, query, norm_weight, out_norm_weight, p, r, s, saved = res
    d_out, d_normed, d_lse, _ = cotangents  # depth weights are not differentiable (C11)
    xs = unstack(sources)
    ct = p.dtype
    qs = _xla.query_side(query, norm_weight, opts, xs[0].shape[-1], ct)
    d_lse = None if d_lse is None else _xla.join_columns(d_lse.astype(ct))  # [..., K]
    d_onw = None
    if opts.out_norm_eps is None:
        run = impl.phase1_backward if opts.multi else impl.backward
        d_sources, dqg = run(xs, qs, opts, ct, d_out, d_lse, p, r, s)
    else:  # C17: the d_y prologue, then section 2.3 with g_total
        d_sources, dqg, d_onw = impl.backward_normed(xs, qs, opts, ct, d_out, d_lse, p, r, s,
                                                     out_norm_weight.astype(ct), d_normed, saved)
        d_onw = d_onw.reshape(out_norm_weight.shape).astype(out_norm_weight.dtype)
    d_sources = [dx.astype(x.dtype) for dx, x in zip(d_sources, xs)]
    d_query = sum_to(dqg * qs.g, qs.q.shape).reshape(query.shape).astype(query.dtype)
    d_norm = None
    if norm_weight is not None:
        d_norm = sum_to(dqg * qs.q, qs.g.shape).reshape(norm_weight.shape).astype(norm_weight.dtype)
    return _like_primals((restack(d_sources, sources), d_query, d_norm, d_onw),
                         (sources, query, norm_weight, out_norm_weight)) + (None,)


attend.defvjp(_attend_fwd, _attend_bwd)


# -- phase 2: merge ------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def merge(impl, opts: MergeOptions, out1, lse1, partial, query, norm_weight):
    """out1, partial `[..., D]`; lse1 `[...]`; query `[D]` or `[..., D]`; norm_weight `[D]` or
    None.  Returns out `[..., D]` (partial's dtype) and lse `[...]` (compute dtype)."""
    return _merge_fwd(impl, opts, out1, lse1, partial, query, norm_weight)[0]


def _merge_fwd(impl, opts: MergeOptions, out1, lse1, partial, query, norm_weight):
    out, lse, r, s, w1 = impl.merge(opts, out1, lse1, partial, query, norm_weight,
                                    compute_dtype(partial.dtype))  # C10
    return (out, lse), (out1, lse1, partial, query, norm_weight, r, s, w1)


def _merge_bwd(impl, opts: MergeOptions, res, cotangents):
    d_out, d_lse = cotangents
    primals = res[:5]  # out1, lse1, partial, query, norm_weight
    return _like_primals(impl.merge_backward(opts, *res, d_out, d_lse), primals)


merge.defvjp(_merge_fwd, _merge_bwd)
