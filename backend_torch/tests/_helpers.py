"""Shared test helpers: random inputs exact in a dtype, float64 upcasts, per-dtype tolerances."""

from __future__ import annotations

import numpy as np
import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}

#: max |got - ref| <= TOL * (1 + max |ref|), values and gradients (got rounds once to the dtype).
TOL = {"float64": 1e-10, "float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def rand(gen: torch.Generator, shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def f64(t) -> np.ndarray:
    """The exact values of a tensor (or list of tensors) as float64 NumPy."""
    if isinstance(t, (list, tuple)):
        return [f64(x) for x in t]
    return None if t is None else t.detach().to(torch.float64).numpy()


def assert_close(got, ref, dtype_name: str, what: str = "") -> None:
    if isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), what
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_close(g, r, dtype_name, f"{what}[{i}]")
        return
    got = f64(got) if isinstance(got, torch.Tensor) else np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    err = float(np.max(np.abs(got - ref))) if got.size else 0.0
    bound = TOL[dtype_name] * (1.0 + float(np.max(np.abs(ref))) if ref.size else 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g} ({dtype_name})"


def leaves(xs):
    """Fresh leaf copies requiring grad (a list, or one tensor)."""
    if isinstance(xs, (list, tuple)):
        return [leaves(x) for x in xs]
    return None if xs is None else xs.detach().clone().requires_grad_(True)
