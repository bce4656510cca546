"""Shared test helpers: dtypes, rounding to a dtype, per-dtype tolerances (on `pythonpath`)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ("float64", "float32", "float16", "bfloat16")

#: Relative tolerance (of the reference's max magnitude) per input dtype: the final cast to a
#: low-precision dtype costs half an ulp; fp32 intermediates a few ulps of fp32.
TOL = {"float64": 1e-10, "float32": 3e-5, "float16": 4e-3, "bfloat16": 3e-2}


def precision(dtype: str):
    """Context enabling float64 for float64 tests (thread-local, never the global flag)."""
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def rounded(rng, shape, dtype: str, scale: float = 1.0):
    """(native array of `dtype`, float64 NumPy copy of exactly its values)."""
    native = jnp.asarray((rng.standard_normal(shape) * scale).astype(jnp.dtype(dtype)))
    return native, np.asarray(native.astype(jnp.float32) if dtype != "float64" else native, np.float64)


def assert_close(got, ref, dtype: str, what: str = ""):
    """|got - ref| <= TOL[dtype] * max(1, max|ref|), elementwise; got is upcast to float64."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32) if jnp.asarray(got).dtype != jnp.float64
                     else got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    bound = TOL[dtype] * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    np.testing.assert_allclose(got, ref, rtol=0, atol=bound, err_msg=what)
