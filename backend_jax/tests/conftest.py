"""Fixtures of the attnres_jax tests."""

from __future__ import annotations

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
