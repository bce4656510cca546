"""Fixtures of the attnres_jax tests."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
