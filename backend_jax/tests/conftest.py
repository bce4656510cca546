"""Fixtures of the attnres_jax tests."""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

# The checkout's top-level `examples/` (no wheel ships it): the example's test and the usage page's
# blocks import it as `examples.jax_decoder`.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(items):
    """The `heavy` tests first (a stable sort), so that under pytest-xdist (tests-jax runs one
    worker per core) they start at once instead of leaving one worker on a long tail."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


#: XLA:CPU's fast-compile options, as nox's tests-jax sets them in XLA_FLAGS (noxfile.py,
#: JAX_FAST_COMPILE) for every test not marked `xla_default_compile`.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def pytest_runtest_setup(item):
    """A test of the op's rounding as users compile it (`xla_default_compile`) fails rather than
    run under the fast-compile XLA_FLAGS, which would check another machine code."""
    if item.get_closest_marker("xla_default_compile") and FAST_COMPILE_FLAG in os.environ.get("XLA_FLAGS", ""):
        pytest.fail(f"{item.nodeid} checks the default compile, but XLA_FLAGS has {FAST_COMPILE_FLAG}: run it "
                    "without (nox's tests-jax runs `-m xla_default_compile` in a run of its own)", pytrace=False)
