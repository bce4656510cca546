"""Shared test helpers: dtypes, rounding to a dtype, per-dtype tolerances (on `pythonpath`)."""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from attnres_conformance.tolerances import TOLERANCES, rel_err, tolerance

DTYPES = ("float64", "float32", "float16", "bfloat16")

#: Gradients in these dtypes are held to the table's value column, stricter than the suite's
#: gradient column, as tight as these tests held them before they took the suite's table
#: (1e-10 and 3e-5 of the reference's max magnitude): float64 runs the reference's math in its
#: precision; float32 sums over D with one vectorized reduce (`kernels.xla.channel_sum`), so its
#: gradients stay within 2e-5.
GRADS_AT_VALUE_COLUMN = ("float64", "float32")


def rtol_for(dtype: str, *, grad: bool) -> float:
    """The rtol these tests hold an array of `dtype` to: the suite's table
    (`attnres_conformance.tolerances.TOLERANCES`), value or gradient column."""
    return tolerance(dtype, grad=grad and dtype not in GRADS_AT_VALUE_COLUMN)


def precision(dtype: str):
    """Context enabling float64 for float64 tests (thread-local, never the global flag)."""
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def rounded(rng, shape, dtype: str, scale: float = 1.0):
    """(native array of `dtype`, float64 NumPy copy of exactly its values)."""
    native = jnp.asarray((rng.standard_normal(shape) * scale).astype(jnp.dtype(dtype)))
    return native, np.asarray(native.astype(jnp.float32) if dtype != "float64" else native, np.float64)


def assert_close(got, ref, dtype: str, what: str = "", *, grad: bool):
    """`got` against the float64 reference `ref` (computed on the same, upcast inputs), exactly as
    the conformance suite compares them (`attnres_conformance.tolerances`): `rel_err = max_i
    |g_i - r_i| / (|r_i| + max(rms(r), atol)) <= rtol_for(dtype, grad=grad)`; non-finite values
    must match.  `dtype`: the dtype the result is in (the compute dtype for lse and weights)."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32) if jnp.asarray(got).dtype != jnp.float64
                     else got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    err, message = rel_err(got, ref, TOLERANCES[dtype].atol)
    rtol = rtol_for(dtype, grad=grad)
    assert err <= rtol, f"{what}: rel_err {err:.3g} > rtol {rtol:.3g} ({dtype}); {message}"


def host_devices_env(count: int, **extra: str) -> dict:
    """The environment of a test's subprocess with `count` host CPU devices: this process's,
    with `--xla_force_host_platform_device_count` appended to its XLA_FLAGS (which keeps the
    compile options the session set, see noxfile.py's tests-jax), JAX on the CPU, and `extra`."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)
