"""The JAX backend's one implementation registry: which implementation serves each op call, the
custom VJPs that run it, and the public backend contract.

The public backend contract, the same names in `attnres_torch.dispatch` and `attnres_mlx.dispatch`
(`IMPLEMENTATIONS`, `availability()`, `use_impl()`, `Choice`, `last_choice()`, `impl_counts()`,
`capabilities()`; written out in `attnres_core.dispatch`, whose bookkeeping this module uses:
the forcing, the record, the refusal rule).  Here:

  IMPLEMENTATIONS   "pallas" (`kernels/pallas.py`: `Pallas`, one head; compiled on gpu/tpu, not
                    float64, on GPU D a power of two up to 8192; in an interpreter on any
                    platform), then "xla" (`kernels/xla.py`: every call).
  use_impl(name, **options)
                    options configure the Pallas implementation (see `use_impl`); the ops'
                    `impl=` keyword forces one call ("not forced (impl='xla')" in `refused`).

This module supplies the implementations, their support checks, the Pallas options,
availability and capabilities.

Everything is read and recorded when a public op is called, i.e. when it is traced: a function
jitted inside a `use_impl` block keeps its choice when the cached trace is called outside it (jit
keys its cache by its arguments, not by this context), and a cached trace records nothing.  To
make the choice part of a jit key, pass the ops' `impl=` keyword as a static argument instead;
an explicit `impl=` wins over the block.

Path of a call (no file entered twice): `ops.py` (validation, the `Request`) -> this module
(`attend` / `merge`: the choice, then the custom VJP, which calls the chosen implementation's
entry points) -> `kernels/pallas.py` (`Pallas.forward` -> the kernel) or `kernels/xla.py` (the
formulas).  The chosen implementation is a static (nondiff) argument of the custom VJP, so the
forward and its backward run the same implementation and a trace is keyed by it.  An
implementation without a backward entry point (Pallas: phase 1, merge) saves XLA's residuals, and
its backward runs XLA's rule.  `_math` (query side, column layout) and `_args` (arguments) are
leaf helpers.

Implementations (`REGISTRY`) are hashable objects with `unavailable(platform)`,
`supports(request)` (None, or why not), `resolve(request)` (the object with everything fixed for
the call, e.g. the tile) and the entry points `forward`, `backward`, `forward_normed`,
`backward_normed`, `phase1`, `phase1_backward`, `merge`, `merge_backward`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Dict, Iterator, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from attnres_core import dispatch as contract
from attnres_core.dispatch import Choice

from . import _mesh
from ._args import MergeOptions, Options, Request, compute_dtype, restack, sum_to, unstack
from ._math import join_columns, query_side, split_columns
from .kernels.pallas import Pallas
from .kernels.xla import XLA, Xla

__all__ = ["IMPLEMENTATIONS", "REGISTRY", "Choice", "Request", "availability", "capabilities", "impl_counts",
           "last_choice", "select", "use_impl"]

#: The implementations by name, in preference order for the automatic choice.
REGISTRY: Dict[str, Union[Pallas, Xla]] = {"pallas": Pallas(), "xla": XLA}
IMPLEMENTATIONS: Tuple[str, ...] = tuple(REGISTRY)

#: Source dtypes the ops accept (float64 under `jax_enable_x64`).
DTYPES = ("float64", "float32", "float16", "bfloat16")

#: `use_impl` options of the Pallas implementation and their defaults.
PALLAS_OPTIONS = {"interpret": False, "tile": None, "poison": False}
_INTERPRET = {False: "off", True: "generic", "tpu": "tpu"}


class _Forced(NamedTuple):
    name: str  # "auto" or one of IMPLEMENTATIONS
    pallas: Optional[Pallas]  # the Pallas implementation configured by the block's options


#: The contract's bookkeeping (`attnres_core.dispatch`): the forcing (a `_Forced`) and the record.
_REGISTRY = contract.Registry("attnres_jax", IMPLEMENTATIONS)


# -- the contract ------------------------------------------------------------------------------------


def availability() -> Dict[str, Optional[str]]:
    """Every implementation name -> None where it can serve calls on this machine (JAX's default
    platform), else a one-line reason (pallas on a CPU: compiled for gpu/tpu only)."""
    platform = jax.default_backend()
    return {name: impl.unavailable(platform) for name, impl in REGISTRY.items()}


def _pallas_from(options: dict) -> Pallas:
    unknown = sorted(set(options) - set(PALLAS_OPTIONS))
    if unknown:
        raise TypeError(f"use_impl: unknown option(s) {', '.join(unknown)}; the Pallas options are "
                        f"{', '.join(PALLAS_OPTIONS)}")
    opts = dict(PALLAS_OPTIONS, **options)
    interpret, tile, poison = opts["interpret"], opts["tile"], opts["poison"]
    if not (interpret is False or interpret is True or interpret == "tpu"):
        raise ValueError(f"interpret: expected False, True or 'tpu', got {interpret!r}")
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile: expected an int >= 1 or None, got {tile!r}")
    if not isinstance(poison, bool):
        raise ValueError(f"poison: expected a bool, got {poison!r}")
    return Pallas(interpret=_INTERPRET[interpret], tile=tile, poison=poison)


@contextlib.contextmanager
def use_impl(name: str, **options) -> Iterator[None]:
    """Force implementation `name` for the op calls made in the block ("auto": the automatic
    choice).  Scoped to the current context (thread, asyncio task); nests; read when an op is
    called (traced), see the module docstring.

    options (for "pallas", and for "auto", where they configure the Pallas implementation the
    automatic choice may take): interpret=False | True (Pallas interpret mode, any platform) |
    "tpu" (JAX's TPU interpreter, `pltpu.InterpretParams`), tile=None | TB token rows per
    program, poison=False | True (every kernel output starts NaN: tests).  Under
    `use_impl("auto", interpret=True)` every single-head call runs the interpreted kernels and
    the others run on XLA.  "xla" takes no options (TypeError).  An unknown name raises
    ValueError listing `IMPLEMENTATIONS`.  A call the forced implementation cannot take raises
    ValueError naming the implementation, the op and the reason: no exception here (Pallas
    forced on a CPU without interpret=, or with several heads, or with num_valid, raises).
    """
    if name != "auto" and name not in REGISTRY:
        raise ValueError(f"use_impl: expected 'auto' or one of {IMPLEMENTATIONS}, got {name!r}")
    if name == "xla" and options:
        raise TypeError(f"use_impl: implementation 'xla' takes no options, got {', '.join(sorted(options))}")
    pallas = None if name == "xla" else _pallas_from(options)
    with _REGISTRY.forcing(_Forced(name, pallas)):
        yield


def last_choice() -> Optional[Choice]:
    """The Choice of the most recent op call (traced) in this process, or None before the first."""
    return _REGISTRY.last_choice()


def impl_counts() -> collections.Counter:
    """Op calls (traced) served per implementation name since import (a copy)."""
    return _REGISTRY.impl_counts()


def capabilities() -> dict:
    """{"dtypes": the source dtype names the ops accept, "devices": the platforms the ops run on
    here (JAX's default one first), "fused_kernel": whether the Pallas kernels serve the default
    op (softmax, key norm, one head) on the default platform, "deterministic": True (no atomics:
    every reduction has a fixed order, C15)}."""
    platform = jax.default_backend()
    devices = tuple(dict.fromkeys((platform, "cpu")))
    return {"dtypes": DTYPES, "devices": devices, "fused_kernel": REGISTRY["pallas"].unavailable(platform) is None,
            "deterministic": True}


# -- the choice --------------------------------------------------------------------------------------


def _configured(name: str, forced: Optional[_Forced]):
    """REGISTRY[name], with the kernel options of the enclosing `use_impl` block for Pallas."""
    if name == "pallas" and forced is not None and forced.pallas is not None:
        return forced.pallas
    return REGISTRY[name]


def select(impl: Optional[str], request: Request):
    """The implementation that runs one public call, resolved for it (hashable), recorded as the
    call's `Choice`.

    impl: the op's `impl=` keyword: None (the `use_impl` block if any, else the first of
    `REGISTRY` that supports the call), "xla" or "pallas" (forced; ValueError naming the
    implementation, the op and the reason if it cannot run the call).
    """
    forced = _REGISTRY.forced()
    if impl is not None:
        if impl not in REGISTRY:
            raise ValueError(f"impl: expected None or one of {IMPLEMENTATIONS}, got {impl!r}")
        name, how = impl, f"impl={impl!r}"
    elif forced is not None and forced.name != "auto":
        name, how = forced.name, f"use_impl({forced.name!r})"
    else:
        name = how = None
    if name is not None:
        chosen = _configured(name, forced)
        reason = chosen.supports(request)
        if reason is not None:
            raise ValueError(f"{how} cannot run this {request.op} call: {reason}")
        refused = _REGISTRY.refused_before(name, how)
    else:
        name, refused = _REGISTRY.auto(lambda n: _configured(n, forced).supports(request))
        if name is None:  # pragma: no cover
            raise AssertionError("XLA supports every call")
        chosen = _configured(name, forced)
    _REGISTRY.record(Choice(request.op, name, refused))
    return chosen.resolve(request)


# -- the ops' call side: choose, then run the custom VJP ----------------------------------------------


def attend(impl: Optional[str], request: Request, opts: Options, sources, query, norm_weight,
           out_norm_weight=None, num_valid=None):
    """`depth_attention` / `depth_attention_multi` after validation: the implementation chosen
    for `request` (`select`) runs `_attend`.  Shapes as `_attend`'s.  Under Explicit mesh axes
    the call runs with them made Auto (`_mesh`), forward and backward; out and out_normed are
    then typed as the sources are, lse and the weights over the sources' token axes."""
    chosen = select(impl, request)
    args = (sources, query, norm_weight, out_norm_weight, num_valid)
    mesh = _mesh.explicit_mesh(*jax.tree_util.tree_leaves(args))
    if mesh is None:
        return _attend(chosen, opts, *args)
    stacked = not isinstance(sources, (list, tuple))
    tok, channels = _mesh.token_specs(sources if stacked else sources[0], stacked)
    out, stat = _mesh.P(None, *tok, channels), _mesh.P(None, *tok, None)
    specs = (out, None if out_norm_weight is None else out, stat if opts.activation == "softmax" else None,
             _mesh.P(None, None, *tok, None))
    return _mesh.auto(lambda *a: _attend(chosen, opts, *a), args, specs, mesh)


def merge(impl: Optional[str], request: Request, opts: MergeOptions, out1, lse1, partial, query, norm_weight):
    """`merge_partial` after validation: the implementation chosen for `request` runs `_merge`
    (under Explicit mesh axes made Auto: out typed as partial, lse over its token axes)."""
    chosen = select(impl, request)
    args = (out1, lse1, partial, query, norm_weight)
    mesh = _mesh.explicit_mesh(*jax.tree_util.tree_leaves(args))
    if mesh is None:
        return _merge(chosen, opts, *args)
    tok, channels = _mesh.token_specs(partial)
    return _mesh.auto(lambda *a: _merge(chosen, opts, *a), args, (_mesh.P(*tok, channels), _mesh.P(*tok)), mesh)


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


# The residuals of the custom VJPs are the inputs themselves plus per-token statistics in the
# compute dtype (C10; with the fused output norm, C17, the XLA path also keeps out in the compute
# dtype and its rho, the Pallas backward kernel recomputes out); gradients are cast once to their
# inputs' dtypes, and under `shard_map` given their primals' types (`_like_primals`).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(impl, opts: Options, sources, query, norm_weight, out_norm_weight=None, num_valid=None):
    """sources N x `[..., D]` or `[N, ..., D]`; query `[D]`, `[..., D]` or `[S, D]` (multi);
    out_norm_weight `[D]` or None (C17: needs `opts.out_norm_eps`); num_valid: None or a 0-d
    integer array, the sources attended (the others masked: XLA only, `kernels.xla.forward`).
    Returns out `[S, ..., D]` (sources' dtype), out_normed `[S, ..., D]` (sources' dtype) or None,
    lse `[S, ..., H]` (compute dtype) or None, weights `[N, S, ..., H]` (compute dtype)."""
    return _attend_fwd(impl, opts, sources, query, norm_weight, out_norm_weight, num_valid)[0]


def _attend_fwd(impl, opts: Options, sources, query, norm_weight, out_norm_weight=None, num_valid=None):
    xs = unstack(sources)
    ct = compute_dtype(xs[0].dtype)  # C10
    qs = query_side(query, norm_weight, opts, xs[0].shape[-1], ct)
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
    lse = None if lse is None else split_columns(lse, sets)
    weights = jnp.moveaxis(split_columns(p, sets), 0, 1)  # [N, S, ..., H]
    return (out, normed, lse, weights), (sources, query, norm_weight, out_norm_weight, p, r, s, saved)


def _attend_bwd(impl, opts: Options, res, cotangents):
    sources, query, norm_weight, out_norm_weight, p, r, s, saved = res
    d_out, d_normed, d_lse, _ = cotangents  # depth weights are not differentiable (C11)
    xs = unstack(sources)
    ct = p.dtype
    qs = query_side(query, norm_weight, opts, xs[0].shape[-1], ct)
    d_lse = None if d_lse is None else join_columns(d_lse.astype(ct))  # [..., K]
    d_onw = None
    if opts.out_norm_eps is None:
        run = (impl.phase1_backward or XLA.phase1_backward) if opts.multi else impl.backward
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


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _merge(impl, opts: MergeOptions, out1, lse1, partial, query, norm_weight):
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
    run = impl.merge_backward or XLA.merge_backward
    return _like_primals(run(opts, *res, d_out, d_lse), primals)


_merge.defvjp(_merge_fwd, _merge_bwd)
