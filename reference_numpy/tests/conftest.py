"""Shared test helpers: a seeded generator and the central finite-difference check."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

FD_STEP = 1e-6
FD_RTOL = 1e-6


def _directional_check(name, f, x, grad, rng):
    """Compare `<grad, d>` with the central difference `(f(x + h d) - f(x - h d)) / 2h` along a
    random direction d (float64, h = 1e-6).  The relative error is taken against
    max(|<grad, d>|, 0.1 |grad| |d| / sqrt(size)) so that an accidentally tiny projection cannot
    make a loose comparison look tight or a correct one look wrong."""
    x = np.asarray(x, dtype=np.float64)
    assert grad is not None, f"{name}: no gradient returned"
    grad = np.asarray(grad)
    assert grad.shape == x.shape, f"{name}: gradient shape {grad.shape} != input shape {x.shape}"
    assert np.all(np.isfinite(grad)), f"{name}: non-finite gradient"
    d = rng.standard_normal(x.shape)
    numeric = (f(x + FD_STEP * d) - f(x - FD_STEP * d)) / (2 * FD_STEP)
    analytic = float(np.sum(grad * d))
    floor = 0.1 * np.linalg.norm(grad) * np.linalg.norm(d) / np.sqrt(max(x.size, 1))
    assert floor > 0, f"{name}: gradient is identically zero"
    rel = abs(numeric - analytic) / max(abs(analytic), floor)
    assert rel < FD_RTOL, f"{name}: finite difference {numeric!r} vs VJP {analytic!r} (rel {rel:.2e})"


@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id (stable across runs and orderings)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def check_gradients(rng):
    """check_gradients(loss, inputs: dict name -> array, grads: dict name -> array).

    loss(**inputs) -> float.  Every named input is perturbed on its own along a random direction.
    """

    def check(loss, inputs, grads):
        for name, x in inputs.items():
            def f(value, name=name):
                return loss(**{**inputs, name: value})
            _directional_check(name, f, x, grads[name], rng)

    return check
