"""Every Pallas kernel lowers for TPU and GPU at the benchmark shapes, or the dispatch plan
(`Pallas().supports`) routes the shape to XLA: tested both ways (`bench/kernel_report.py`,
issue 13).  Lowered on the CPU for abstract bf16 inputs with
`jax.jit(f).trace(...).lower(lowering_platforms=(platform,))`, no device needed.

* The plan accepts the shape -> the kernel must lower, with the tile and settings the resolved
  `Pallas` passes to it, with the lowering `pallas_call` uses for the kernels as they are called (on cuda: JAX's default, which
  is Mosaic GPU unless `jax_pallas_use_mosaic_gpu` is False).
* The plan refuses the shape -> the lowering the plan's reason is about must refuse it too
  (TPU: Mosaic; GPU: the Triton lowering, whose power-of-two rule the plan states).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_report():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import kernel_report
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return kernel_report


report = _load_report()
CASES = report.PALLAS_CASES


def _check(case, plan_platform, platform, refusal_lowering):
    reason, impl = report.pallas_plan(case, plan_platform)
    if reason is None:
        err = report.pallas_lower(case, platform, impl)
        assert err is None, (f"plan runs {case.name} on {plan_platform} with the Pallas kernel "
                             f"(TB = {impl.tile}), but the {platform} lowering refuses it: {err}")
    else:
        err = report.pallas_lower(case, platform, impl, refusal_lowering)
        assert err is not None, (f"plan routes {case.name} on {plan_platform} to XLA ({reason}), "
                                 f"but the kernel lowers for {platform} (TB = {impl.tile})")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tpu_lowering_matches_plan(case):
    _check(case, "tpu", "tpu", None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_lowering_matches_plan(case):
    _check(case, "gpu", "cuda", False)


def test_plan_refusal_is_exercised():
    # The "refused" branch above must run for at least one benchmark shape (D = 7168 on GPU).
    assert any(report.pallas_plan(c, "gpu")[0] is not None for c in CASES)
    assert any(report.pallas_plan(c, "gpu")[0] is None for c in CASES)
