"""Argument checks shared by every implementation (spec section "Errors", constraints C1-C12).

One piece of code per idea: the NumPy reference and every backend call these checks with the
*shapes* and *canonical dtype names* of their own arrays, so every framework raises the same
`ValueError` / `TypeError` with the same message for the same bad input.  Nothing here imports a
framework; nothing here looks at array values (NaN/Inf propagate, C12).

Canonical dtype names: "float16", "bfloat16", "float32", "float64" (anything else is
non-floating for the purposes of these checks, e.g. "int32", "bool", "complex64").
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .numerics import compute_dtype_for  # noqa: F401  (C10; re-exported for the backends)

FLOATING_DTYPES = ("float16", "bfloat16", "float32", "float64")
ACTIVATIONS = ("softmax", "sigmoid")

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class DepthAttentionGeometry:
    """What the checks learned about a valid call.

    num_sources: N >= 1.  batch_shape: the token axes `...` of every source.  dim: D.
    head_dim: D // num_heads.  per_token_query: query is `[..., D]` rather than `[D]`.
    compute_dtype: "float64" for float64 sources, else "float32" (C10).
    out_norm_eps: the fused output norm's eps in effect (C17), None when out_norm_weight is None.
    """

    num_sources: int
    batch_shape: Shape
    dim: int
    num_heads: int
    head_dim: int
    per_token_query: bool
    source_dtype: str
    compute_dtype: str
    out_norm_eps: Optional[float] = None


def check_floating(name: str, dtype: str) -> None:
    """C3-C5: `dtype` (a canonical name) must be floating; the message names the argument."""
    if dtype not in FLOATING_DTYPES:
        raise TypeError(
            f"{name}: expected a floating dtype (one of {', '.join(FLOATING_DTYPES)}), got {dtype}"
        )


def _check_finite_real(name: str, value) -> None:
    """C8: `value` is a finite real number (a bool is not a real)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")


def check_eps_scale(eps, scale) -> None:
    """C8: eps is a finite real number > 0; scale is a finite real number."""
    for name, value in (("eps", eps), ("scale", scale)):
        _check_finite_real(name, value)
    if float(eps) <= 0.0:
        raise ValueError(f"eps: expected eps > 0, got {eps!r}")


def check_out_norm(weight_shape: Optional[Shape], weight_dtype: Optional[str], out_norm_eps,
                   dim: int) -> None:
    """C17 (with C5, C8): out_norm_weight is None or a floating `[D]`; out_norm_eps is None or a
    finite real > 0, and only given together with out_norm_weight."""
    if weight_shape is None:
        if out_norm_eps is not None:
            raise ValueError(f"out_norm_eps: given ({out_norm_eps!r}) while out_norm_weight is None; "
                             "out_norm_eps applies only with out_norm_weight")
        return
    check_vector("out_norm_weight", weight_shape, weight_dtype, dim)
    if out_norm_eps is not None:
        _check_finite_real("out_norm_eps", out_norm_eps)
        if float(out_norm_eps) <= 0.0:
            raise ValueError(f"out_norm_eps: expected out_norm_eps > 0, got {out_norm_eps!r}")


def check_options(num_heads, activation, key_norm, return_lse) -> None:
    """C9: num_heads is an int >= 1; activation is 'softmax' or 'sigmoid'; lse needs softmax."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral):
        raise TypeError(f"num_heads: expected an int, got {type(num_heads).__name__} {num_heads!r}")
    if num_heads < 1:
        raise ValueError(f"num_heads: expected num_heads >= 1, got {num_heads}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(key_norm, bool):
        raise TypeError(f"key_norm: expected a bool, got {type(key_norm).__name__} {key_norm!r}")
    if return_lse and activation != "softmax":
        raise ValueError("return_lse: the log-sum-exp exists only for activation='softmax'")


def check_sources(source_shapes: Sequence[Shape], source_dtypes: Sequence[str], stacked: bool):
    """C1-C3: N >= 1 sources of one floating dtype and identical shape `[..., D]`, D >= 1.

    For a stacked array pass its leading-axis slices' shapes (all equal) and `stacked=True`;
    the message then names the stacked shape.  Returns (N, batch_shape, D, dtype).
    """
    n = len(source_shapes)
    if n == 0:
        what = "stacked array with a leading axis of length 0" if stacked else "empty sequence"
        raise ValueError(f"sources: expected N >= 1 sources, got an {what}")
    first = tuple(source_shapes[0])
    if len(first) < 1:
        if stacked:
            raise ValueError(
                f"sources: a stacked array must have shape [N, ..., D] (ndim >= 2), got shape {(n,)}"
            )
        raise ValueError(f"sources[0]: expected shape [..., D] with ndim >= 1, got shape {first}")
    for i, shape in enumerate(source_shapes):
        if tuple(shape) != first:
            raise ValueError(
                f"sources[{i}]: shape {tuple(shape)} differs from sources[0] shape {first}; "
                "every source must have the same shape [..., D]"
            )
    if first[-1] < 1:
        raise ValueError(f"sources: expected D >= 1, got source shape {first}")
    dtypes = [str(d) for d in source_dtypes]
    for i, d in enumerate(dtypes):
        check_floating(f"sources[{i}]", d)
    if len(set(dtypes)) > 1:
        raise TypeError(
            f"sources: all sources must share one dtype, got {sorted(set(dtypes))} "
            f"(dtypes by index: {dtypes})"
        )
    return n, first[:-1], first[-1], dtypes[0]


def check_vector(name: str, shape: Shape, dtype: str, dim: int) -> None:
    """A `[D]` parameter (norm weight, pseudo-query) must match the sources' D (C5)."""
    check_floating(name, str(dtype))
    if tuple(shape) != (dim,):
        raise ValueError(f"{name}: expected shape [D] = ({dim},) to match the sources, got shape {tuple(shape)}")


def check_query(query_shape: Shape, query_dtype: str, source_shape: Shape) -> bool:
    """C4: query is `[D]` (pseudo-query) or `[..., D]` equal to a source's shape (per token).

    Returns True for a per-token query.
    """
    check_floating("query", str(query_dtype))
    query_shape = tuple(query_shape)
    dim = source_shape[-1]
    if len(query_shape) == 1 and query_shape[0] == dim:
        return False
    if query_shape == tuple(source_shape):
        return len(query_shape) > 1
    raise ValueError(
        f"query: expected shape [D] = ({dim},) or the sources' shape {tuple(source_shape)}, "
        f"got shape {query_shape}"
    )


def check_depth_attention(
    source_shapes: Sequence[Shape],
    source_dtypes: Sequence[str],
    query_shape: Shape,
    query_dtype: str,
    norm_weight_shape: Optional[Shape],
    norm_weight_dtype: Optional[str],
    *,
    stacked: bool = False,
    eps=1e-6,
    scale=1.0,
    num_heads=1,
    activation="softmax",
    key_norm=True,
    return_lse=False,
    out_norm_weight_shape: Optional[Shape] = None,
    out_norm_weight_dtype: Optional[str] = None,
    out_norm_eps=None,
) -> DepthAttentionGeometry:
    """All checks of `depth_attention` (C1-C9, C17) in the spec's order; returns the geometry.

    out_norm_weight_shape / _dtype: the fused output norm's gain `[D]` (None: off); out_norm_eps:
    its eps (None: `eps`).  The geometry's `out_norm_eps` is the eps in effect (None when off).
    """
    n, batch, dim, dtype = check_sources(source_shapes, source_dtypes, stacked)
    per_token = check_query(query_shape, query_dtype, tuple(batch) + (dim,))
    if norm_weight_shape is not None:
        check_vector("norm_weight", norm_weight_shape, norm_weight_dtype, dim)
    check_eps_scale(eps, scale)
    check_options(num_heads, activation, key_norm, return_lse)
    if dim % num_heads:
        raise ValueError(f"num_heads: D = {dim} is not divisible by num_heads = {num_heads}")
    check_out_norm(out_norm_weight_shape, out_norm_weight_dtype, out_norm_eps, dim)
    return DepthAttentionGeometry(
        num_sources=n,
        batch_shape=tuple(batch),
        dim=dim,
        num_heads=int(num_heads),
        head_dim=dim // int(num_heads),
        per_token_query=per_token,
        source_dtype=dtype,
        compute_dtype=compute_dtype_for(dtype),
        out_norm_eps=None if out_norm_weight_shape is None else float(
            eps if out_norm_eps is None else out_norm_eps),
    )


def check_multi(
    source_shapes: Sequence[Shape],
    source_dtypes: Sequence[str],
    queries_shape: Shape,
    queries_dtype: str,
    norm_weights_shape: Optional[Shape],
    norm_weights_dtype: Optional[str],
    *,
    stacked: bool = False,
    eps=1e-6,
    scale=1.0,
) -> DepthAttentionGeometry:
    """Checks of `depth_attention_multi` (C1-C3, C8, C13): queries `[S, D]`, norm_weights `[S, D]`."""
    n, batch, dim, dtype = check_sources(source_shapes, source_dtypes, stacked)
    check_floating("queries", str(queries_dtype))
    queries_shape = tuple(queries_shape)
    if len(queries_shape) != 2 or queries_shape[1] != dim or queries_shape[0] < 1:
        raise ValueError(f"queries: expected shape [S, D] with S >= 1 and D = {dim}, got shape {queries_shape}")
    if norm_weights_shape is not None:
        check_floating("norm_weights", str(norm_weights_dtype))
        if tuple(norm_weights_shape) != queries_shape:
            raise ValueError(
                f"norm_weights: expected shape {queries_shape} to match queries [S, D], "
                f"got shape {tuple(norm_weights_shape)}"
            )
    check_eps_scale(eps, scale)
    return DepthAttentionGeometry(
        num_sources=n, batch_shape=tuple(batch), dim=dim, num_heads=1, head_dim=dim,
        per_token_query=False, source_dtype=dtype, compute_dtype=compute_dtype_for(dtype),
    )


def check_merge(
    out1_shape: Shape,
    out1_dtype: str,
    lse1_shape: Shape,
    lse1_dtype: str,
    partial_shape: Shape,
    partial_dtype: str,
    query_shape: Shape,
    query_dtype: str,
    norm_weight_shape: Optional[Shape],
    norm_weight_dtype: Optional[str],
    *,
    eps=1e-6,
    scale=1.0,
) -> DepthAttentionGeometry:
    """Checks of `merge_partial` (C14): out1 and partial `[..., D]`, lse1 `[...]`."""
    out1_shape, lse1_shape, partial_shape = tuple(out1_shape), tuple(lse1_shape), tuple(partial_shape)
    check_floating("out1", str(out1_dtype))
    check_floating("lse1", str(lse1_dtype))
    check_floating("partial", str(partial_dtype))
    if len(partial_shape) < 1 or partial_shape[-1] < 1:
        raise ValueError(f"partial: expected shape [..., D] with D >= 1, got shape {partial_shape}")
    if out1_shape != partial_shape:
        raise ValueError(f"out1: shape {out1_shape} differs from partial shape {partial_shape}")
    if str(out1_dtype) != str(partial_dtype):
        raise TypeError(f"out1: dtype {out1_dtype} differs from partial dtype {partial_dtype}")
    if lse1_shape != partial_shape[:-1]:
        raise ValueError(
            f"lse1: expected shape {partial_shape[:-1]} (partial's shape without D), got shape {lse1_shape}"
        )
    per_token = check_query(query_shape, query_dtype, partial_shape)
    dim = partial_shape[-1]
    if norm_weight_shape is not None:
        check_vector("norm_weight", norm_weight_shape, norm_weight_dtype, dim)
    check_eps_scale(eps, scale)
    dtype = str(partial_dtype)
    return DepthAttentionGeometry(
        num_sources=2, batch_shape=partial_shape[:-1], dim=dim, num_heads=1, head_dim=dim,
        per_token_query=per_token, source_dtype=dtype, compute_dtype=compute_dtype_for(dtype),
    )


def check_cotangent(name: str, shape: Shape, expected: Shape) -> None:
    """A VJP's cotangent must have exactly its primal output's shape (no broadcasting)."""
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name}: expected the output's shape {tuple(expected)}, got shape {tuple(shape)}")
