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
