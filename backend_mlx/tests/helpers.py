"""Shared test helpers: exact low-precision inputs and comparisons against the float64 reference."""

import mlx.core as mx
import numpy as np
from attnres_conformance.numerics import round_to
from attnres_conformance.tolerances import compare

DTYPES = ("float32", "float16", "bfloat16", "float64")
MX = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32,
      "float64": mx.float64}


def rand(rng, shape, dtype, scale=1.0):
    """float64 values exactly representable in `dtype`."""
    return round_to(rng.standard_normal(shape) * scale, dtype)


def to_mx(a, dtype):
    return mx.array(np.asarray(a, dtype=np.float64), dtype=mx.float64).astype(MX[dtype])


def to_np(a):
    return np.array(a.astype(mx.float64))


def dtype_of(a):
    return {v: k for k, v in MX.items()}[a.dtype]


def assert_close(name, actual, reference, *, grad, override=None):
    """`actual` (an mx.array, compared in its own dtype's row) against the float64 reference."""
    c = compare(name, to_np(actual), reference, dtype_of(actual), grad=grad, override=override)
    assert c.ok, f"{name}: rel_err {c.err:.3g} > rtol {c.rtol:.3g}; {c.message}"
