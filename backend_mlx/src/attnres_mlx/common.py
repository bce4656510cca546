"""What the two implementations (`kernels/compiled.py`, `kernels/metal.py`) and `ops.py` share:
dtype names, the compute-dtype rule (C10), and the reductions that bring broadcast gradients back
to their inputs.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import mlx.core as mx
from attnres_core import validation
from attnres_core.numerics import sum_to_axes

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32,
           "float64": mx.float64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype) -> str:
    """Canonical dtype name for the shared checks ("float32", ...; "int32" etc. otherwise)."""
    return _NAMES.get(dtype, str(dtype).rsplit(".", 1)[-1])


def compute_dtype(source_dtype) -> mx.Dtype:
    """C10: the dtype of every intermediate for sources of `source_dtype` (the shared rule in
    `attnres_core.validation.compute_dtype_for`: float64 stays float64, else float32)."""
    return _DTYPES[validation.compute_dtype_for(dtype_name(source_dtype))]


def sum_to(a: mx.array, shape: Sequence[int]) -> mx.array:
    """Sum a broadcast result back to `shape` (`attnres_core.numerics.sum_to_axes`)."""
    lead, keep = sum_to_axes(a.shape, shape)
    if lead:
        a = a.sum(axis=lead)
    return a.sum(axis=keep, keepdims=True) if keep else a


def query_grads(dqg: mx.array, q: mx.array, g: mx.array, *,
                multi: bool) -> Tuple[mx.array, mx.array]:
    """Chain rule through qg = query * gain (spec 2.3): (d query, d gain), each summed back to
    its input's shape and cast to its dtype.

    dqg: the cotangent of qg in the compute dtype, `[..., D]`; or `[S, ..., D]` with `multi`
      (queries and gains `[S, D]`, phase 1).
    q: `[D]` or `[..., D]` (`[S, D]` with `multi`); g: `[D]` (`[S, D]` with `multi`).
    """
    c = dqg.dtype
    if multi:  # [S, D] -> [S, 1.., D] against dqg [S, ..., D]
        lead = (q.shape[0],) + (1,) * (dqg.ndim - 2) + (q.shape[-1],)
        qb, gb = q.astype(c).reshape(lead), g.astype(c).reshape(lead)
    else:
        qb, gb = q.astype(c), g.astype(c)
    return (sum_to(dqg * gb, qb.shape).reshape(q.shape).astype(q.dtype),
            sum_to(dqg * qb, gb.shape).reshape(g.shape).astype(g.dtype))
