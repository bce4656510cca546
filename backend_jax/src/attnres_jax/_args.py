"""Argument handling and call metadata of the ops: canonical inputs, the compute dtype (C10), the
static options of one call and the `Request` an implementation is chosen from (public as
`attnres_jax.dispatch.Request`).

A leaf module: nothing here computes the op or calls the rest of the package.  `ops` holds the
public functions, `dispatch` the registry, the choice and the custom VJPs, `kernels.xla` and
`kernels.pallas` the two implementations, `_math` what both share.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from attnres_core.numerics import compute_dtype_for, sum_to_axes


def dtype_name(x) -> str:
    """Canonical dtype name of an array ("float32", "bfloat16", ...)."""
    return jnp.dtype(x.dtype).name


def compute_dtype(dtype) -> jnp.dtype:
    """C10: the compute dtype (kappa) of sources of `dtype`: float64 stays float64, every other
    dtype computes in float32.  The one place this package reads the rule
    (`attnres_core.numerics.compute_dtype_for`, shared by every backend)."""
    return jnp.dtype(compute_dtype_for(jnp.dtype(dtype).name))


def as_array(x, name: str = "argument"):
    """x as a JAX array (`jnp.asarray`); a missing one (None) is a TypeError naming `name`."""
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def optional(x):
    return None if x is None else as_array(x)


def meta(x):
    """(shape, dtype name) of an optional array, for the shared checks."""
    return (None, None) if x is None else (x.shape, dtype_name(x))


def canonical_sources(sources):
    """A list/tuple stays a list/tuple of arrays `[..., D]`; any array is a stacked `[N, ..., D]`.

    Returns (sources, shapes, dtype names, stacked) for `validation.check_sources`.
    """
    if isinstance(sources, (list, tuple)):
        arrays = type(sources)(as_array(s, f"sources[{i}]") for i, s in enumerate(sources))
        return arrays, [a.shape for a in arrays], [dtype_name(a) for a in arrays], False
    if not hasattr(sources, "shape") or not hasattr(sources, "dtype"):
        raise TypeError(
            "sources: expected a sequence of arrays [..., D] or one stacked array [N, ..., D], "
            f"got {type(sources).__name__}"
        )
    stack = as_array(sources)
    n = stack.shape[0] if stack.ndim else 0
    return stack, [stack.shape[1:]] * n, [dtype_name(stack)] * n, True


def unstack(sources) -> list:
    """The N sources as a list of `[..., D]` arrays (slices of a stacked array, never a copy)."""
    if isinstance(sources, (list, tuple)):
        return list(sources)
    # lax, not `sources[i]`: the same slice, without jnp's indexing machinery at trace time
    return [jax.lax.index_in_dim(sources, i, 0, keepdims=False) for i in range(sources.shape[0])]


def restack(grads: list, like):
    """Source gradients N x `[..., D]` in the form the sources were given (list, tuple or stacked)."""
    if isinstance(like, (list, tuple)):
        return type(like)(grads)
    return jnp.stack(grads)


def sum_to(x, shape):
    """Sum a broadcast result x back to `shape` (`attnres_core.numerics.sum_to_axes`)."""
    lead, keep = sum_to_axes(x.shape, shape)
    if lead:  # no reduce over no axes: one op less to trace and compile per call
        x = jnp.sum(x, axis=lead)
    return jnp.sum(x, axis=keep, keepdims=True) if keep else x


class Options(NamedTuple):
    """Static options of one `depth_attention` / `depth_attention_multi` call (hashable: a
    nondiff argument of the custom VJP)."""

    eps: float
    scale: float
    num_heads: int
    activation: str
    key_norm: bool
    multi: bool  # query is a set of S pseudo-queries [S, D] (depth_attention_multi)
    out_norm_eps: Optional[float] = None  # C17: the fused output norm's eps; None: no output norm


class MergeOptions(NamedTuple):
    """Static options of one `merge_partial` call."""

    eps: float
    scale: float


class Request(NamedTuple):
    """What the choice of an implementation depends on, fixed once per public call."""

    op: str  # "depth_attention", "depth_attention_multi" or "merge_partial"
    platform: str  # jax.default_backend() when the public op is called
    dtype: str  # the sources' (partial's) dtype name
    dim: int  # D
    num_heads: int  # H
    num_sources: int  # N (2 for merge_partial: phase 1's result and the partial sum)
    num_sets: int  # S query sets (1 unless depth_attention_multi)
    per_token: bool  # per-token query `[..., D]`
    out_norm: bool = False  # C17: the fused output norm (out_norm_weight given)
    masked: bool = False  # a masked read of stacked sources (`num_valid` given)
