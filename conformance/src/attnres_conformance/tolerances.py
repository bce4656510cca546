"""The one tolerance table of the suite, its error metric, and FlashAttention's adaptive rule.

Error metric (one number per compared array, shown in every report cell):

    rel_err(a, r) = max_i |a_i - r_i| / (|r_i| + floor),   floor = max(rms(r), atol)

`r` is the float64 reference on the same (upcast) low-precision inputs.  It is an elementwise
relative error whose denominator never drops below the array's RMS, so elements that are tiny
only through cancellation (gradients!) are measured against the array's scale rather than
their own; `atol` (the dtype's smallest normal) only matters for an all-zero reference.  A
comparison passes when `rel_err <= rtol` of the table row for the array's dtype.  Non-finite
values must sit at the same positions with the same value in both (C12), else it fails.

FlashAttention's rule (fp16 / bf16 only): besides the table, an op's error must be
`<= 2 * rel_err(naive, r) + floor` where `naive` is the same op composed from elementary
steps in the low precision itself (`naive.py`: rounding after every step).  A port that keeps
every intermediate in fp32 (C10) is far more accurate than the naive composition.

Probe networks in fp16 / bf16 run L sublayers in the dtype (C10 is per op), so their attainable
accuracy depends on the case (a per-token query feeds rounding errors back into the logits):
there the same adaptive bound *replaces* the table when it is looser, `naive` being the
reference's probe with every primitive rounded (`attainable`).  A real bug (a missing source, a
wrong scale) is an O(1) error, far outside either bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .numerics import ULP


@dataclass(frozen=True)
class Tolerance:
    """rtol for values (outputs) and for gradients; atol is the all-zero-reference floor."""

    value: float
    grad: float
    atol: float


#: Keyed by the dtype of the compared array (an output's or gradient's own dtype: lse and
#: weights are in the compute dtype, so they use the float32 / float64 row).
TOLERANCES = {
    # Same math as the reference in the same precision: only summation order differs
    # (D = 4096 reductions: ~sqrt(D) * 1.1e-16 ~ 1e-14); grads add the VJP's cancellations.
    "float64": Tolerance(value=1e-10, grad=1e-9, atol=np.finfo(np.float64).tiny),
    # fp32 intermediates: reductions over D <= 4096 accumulate ~sqrt(D) * 6e-8 ~ 4e-6 in the
    # logits, which the softmax passes on; grads ~5x looser (two more reductions) like JAX's.
    "float32": Tolerance(value=2e-5, grad=1e-4, atol=np.finfo(np.float32).tiny),
    # One final cast (C10): half an ulp is 2^-11 = 4.9e-4; 2x that for value, 8x for grads
    # (grads are also cast once, but accumulate more fp32 work before it).
    "float16": Tolerance(value=1e-3, grad=4e-3, atol=float(np.finfo(np.float16).tiny)),
    # Half an ulp is 2^-8 = 3.9e-3; same multiples as fp16.
    "bfloat16": Tolerance(value=8e-3, grad=3e-2, atol=np.finfo(np.float32).tiny),
}

#: Per-case overrides: factor on the table, with the reason (ONNX `test_kwargs` style).
OVERRIDES = {
    "probe": (4.0, "the probe network chains L sublayers, each op rounding to the dtype once "
                   "(C10 is per op), so errors compound over depth"),
    "sweep": (2.0, "random options combine large |scale| with peaky softmax, which amplifies "
                   "the one-ulp logit error"),
    "two_phase": (2.0, "phase 1 casts out1 to the source dtype before the merge casts again: "
                       "two roundings instead of one"),
    "two_phase_vs_direct": (3.0, "a backend's two-phase result against its own direct call: "
                                 "two roundings on one side, one on the other"),
    "large_logits": (10.0, "logits of ~120 carry an absolute error ~|z| sqrt(D) eps from their "
                           "fp32 reductions (3e-4 at D = 4096 with sequential sums, which C10 "
                           "allows), and the softmax passes it on: the table assumes |z| of a few"),
}

#: Slack of the adaptive rule, in units of the dtype's unit roundoff: one rounding's worth.
FLASH_FLOOR_ULPS = 1.0
FLASH_FACTOR = 2.0


def tolerance(dtype: str, *, grad: bool, override: Optional[str] = None) -> float:
    """The rtol for an array of `dtype` (value or gradient column), times an override factor."""
    row = TOLERANCES[dtype]
    factor = OVERRIDES[override][0] if override else 1.0
    return factor * (row.grad if grad else row.value)


@dataclass(frozen=True)
class Comparison:
    """Outcome of one array comparison.  err: rel_err (inf when non-finite positions differ)."""

    name: str
    err: float
    rtol: float
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.err <= self.rtol


def rel_err(actual, reference, atol: float, extra_floor=None) -> tuple:
    """(rel_err, message) of `actual` against the float64 `reference` (same shape).

    Non-finite entries must agree exactly; the message counts mismatches and names the worst
    element.  floor: an elementwise condition floor (same shape) raising the RMS floor where a
    result is a sum of terms that cancel (`checks.condition_floor`)."""
    a = np.asarray(actual, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if a.shape != r.shape:
        return float("inf"), f"shape {a.shape}, expected {r.shape}"
    fin_r, fin_a = np.isfinite(r), np.isfinite(a)
    bad = (fin_r != fin_a) | (~fin_r & ~fin_a & ~((a == r) | (np.isnan(a) & np.isnan(r))))
    if bad.any():
        i = np.unravel_index(np.argmax(bad), bad.shape)
        return float("inf"), (f"{int(bad.sum())} non-finite mismatches, first at {tuple(map(int, i))}: "
                               f"got {a[i]!r}, expected {r[i]!r}")
    if a.size == 0 or not fin_r.any():
        return 0.0, ""
    floor = max(float(np.sqrt(np.mean(np.square(r[fin_r])))), atol)
    if extra_floor is not None:
        floor = np.maximum(floor, np.nan_to_num(np.asarray(extra_floor, np.float64), nan=0.0, posinf=0.0))
    with np.errstate(invalid="ignore"):  # inf - inf where both agree on a non-finite value
        e = np.where(fin_r, np.abs(a - r) / (np.abs(r) + floor), 0.0)
    i = np.unravel_index(np.argmax(e), e.shape)
    err = float(e[i])
    if err == 0.0:
        return 0.0, ""
    return err, (f"worst at {tuple(map(int, i))}: got {a[i]!r}, expected {r[i]!r}; "
                 f"{int((e > 0).sum())}/{e.size} elements differ")


def compare(name: str, actual, reference, dtype: str, *, grad: bool,
            override: Optional[str] = None, floor=None) -> Comparison:
    """Compare one array against the reference with the table's rtol for `dtype` (floor: an
    elementwise condition floor, see `rel_err`)."""
    err, msg = rel_err(actual, reference, TOLERANCES[dtype].atol, floor)
    return Comparison(name, err, tolerance(dtype, grad=grad, override=override), msg)


def flash_rule(name: str, backend_err: float, actual_naive, reference, dtype: str) -> Comparison:
    """FlashAttention's rule: `backend_err <= 2 * rel_err(naive) + floor` (fp16/bf16 only).

    Returns a Comparison whose `err` is the backend's error and `rtol` the adaptive bound."""
    naive_err, _ = rel_err(actual_naive, reference, TOLERANCES[dtype].atol)
    bound = FLASH_FACTOR * naive_err + FLASH_FLOOR_ULPS * ULP[dtype]
    msg = (f"error {backend_err:.3g} exceeds {FLASH_FACTOR:g} x the naive {dtype} composition's "
           f"{naive_err:.3g} + {FLASH_FLOOR_ULPS:g} ulp" if backend_err > bound else "")
    return Comparison(f"{name} (vs naive {dtype})", backend_err, bound, msg)


def attainable(c: Comparison, actual_naive, reference, dtype: str) -> Comparison:
    """A probe comparison in fp16/bf16 with its rtol raised to the adaptive bound
    `2 * rel_err(naive) + floor` where that is looser than the table."""
    naive_err, _ = rel_err(actual_naive, reference, TOLERANCES[dtype].atol)
    bound = FLASH_FACTOR * naive_err + FLASH_FLOOR_ULPS * ULP[dtype]
    return dataclasses.replace(c, rtol=max(c.rtol, bound))
