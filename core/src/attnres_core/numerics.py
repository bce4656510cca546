"""The numerics every implementation shares (spec C10): the compute-dtype rule and exact rounding.

One small module, numpy only, imported by the reference, the golden-vector generator, the
conformance suite and every backend (which map the canonical dtype names onto their own dtypes).

Canonical dtype names: "float64", "float32", "float16", "bfloat16".
"""

from __future__ import annotations

import numpy as np

#: The floating dtypes of the spec, widest first.
DTYPES = ("float64", "float32", "float16", "bfloat16")


def sum_to_axes(shape, target) -> tuple:
    """How to sum a broadcast result of `shape` back to `target` (the reverse of broadcasting,
    as every VJP of a broadcast operand needs): returns `(lead, keep)`: first sum over the
    `lead` leading axes, then over the `keep` axes with keepdims (target has size 1 there)."""
    shape, target = tuple(shape), tuple(target)
    lead = tuple(range(len(shape) - len(target)))
    rest = shape[len(lead):]
    keep = tuple(i for i, n in enumerate(target) if n == 1 and rest[i] != 1)
    return lead, keep


def compute_dtype_for(source_dtype: str) -> str:
    """C10: every intermediate is float32, or float64 when the sources are float64."""
    return "float64" if source_dtype == "float64" else "float32"


#: IEEE-style binary formats: (significand bits incl. the implicit one, min normal exponent, max finite).
_FORMATS = {
    "float16": (11, -14, 65504.0),
    "bfloat16": (8, -126, float.fromhex("0x1.fep127")),
    "float32": (24, -126, float.fromhex("0x1.fffffep127")),
}

def round_to_dtype(x, dtype: str) -> np.ndarray:
    """A float64 copy of `x` rounded to the nearest `dtype` value, ties to even.

    dtype: "float64" (copy), "float32", "float16" or "bfloat16".  Rounds once, directly from
    float64 (no double rounding), with subnormals; beyond the largest finite value -> +-inf;
    NaN and +-inf pass through.  Ports and the conformance suite use this to build inputs.
    """
    x = np.array(x, dtype=np.float64)
    if dtype == "float64":
        return x
    if dtype not in _FORMATS:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    bits, min_exp, max_finite = _FORMATS[dtype]
    finite = np.isfinite(x)
    safe = np.where(finite, x, 0.0)
    _, e = np.frexp(safe)  # safe = m * 2**e with 0.5 <= |m| < 1: leading bit 2**(e-1)
    ulp_exp = np.maximum(e - 1, min_exp) - (bits - 1)  # subnormals share the min exponent's ulp
    y = np.ldexp(np.rint(np.ldexp(safe, -ulp_exp)), ulp_exp)  # both scalings are exact
    y = np.where(np.abs(y) > max_finite, np.copysign(np.inf, safe), y)
    return np.where(finite, y, x)
