"""Dtype facts the suite needs, and rounding float64 values to a low-precision dtype.

Rounding is `attnres_core.numerics.round_to_dtype` (one piece of code per idea: the golden
vectors and the suite round identically); it returns float64 arrays holding values exactly
representable in the dtype.
"""

from __future__ import annotations

import numpy as np
from attnres_core.numerics import DTYPES, round_to_dtype

__all__ = ["DTYPES", "ULP", "round_to"]

#: Machine epsilon: the size of one ulp at 1.0 (fp16 has 10 stored mantissa bits, bf16 7).
#: Rounding to nearest errs by at most half of it, relatively.
ULP = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def round_to(x, dtype: str) -> np.ndarray:
    """float64 copy of `x` rounded (to nearest even) to `dtype`; float64 is a plain copy."""
    return np.asarray(round_to_dtype(np.asarray(x, dtype=np.float64), dtype), dtype=np.float64)
