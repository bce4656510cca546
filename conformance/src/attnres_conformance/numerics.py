"""Dtype facts the suite needs, and rounding float64 values to a low-precision dtype.

Rounding is `attnres_numpy.vectors.round_to_dtype` (one piece of code per idea: the golden
vectors and the suite round identically); it returns float64 arrays holding values exactly
representable in the dtype.
"""

from __future__ import annotations

import numpy as np

DTYPES = ("float64", "float32", "float16", "bfloat16")

#: Machine epsilon: the size of one ulp at 1.0 (fp16 has 10 stored mantissa bits, bf16 7).
#: Rounding to nearest errs by at most half of it, relatively.
ULP = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10,
                 "bfloat16": 2.0 ** -7}


def round_to(x, dtype: str) -> np.ndarray:
    """float64 copy of `x` rounded (to nearest even) to `dtype`; float64 is a plain copy."""
    try:
        from attnres_numpy.vectors import round_to_dtype
    except ImportError as exc:  # the vectors module ships with attnres-numpy >= 0.1.0
        raise ImportError(
            "attnres_conformance needs attnres_numpy.vectors.round_to_dtype (attnres-numpy with "
            "golden-vector support); upgrade attnres-numpy"
        ) from exc
    return np.asarray(round_to_dtype(np.asarray(x, dtype=np.float64), dtype), dtype=np.float64)
