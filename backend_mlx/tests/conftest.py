"""Test configuration: `metal`-marked tests are skipped where Metal is unavailable."""

import os
import sys

import mlx.core as mx
import pytest
from attnres_conformance.adapters.mlx import kernel_directory

# MLX's kernel directory is not safe for two processes at once: each pytest-xdist worker compiles
# into one of its own, kept between runs (as the suite's parallel runs do).
if os.environ.get("PYTEST_XDIST_WORKER"):
    kernel_directory("attnres-tests-mlx-" + os.environ["PYTEST_XDIST_WORKER"])

sys.path.insert(0, os.path.dirname(__file__))
# The checkout's top-level `examples/` (no wheel ships it): the example's test and the usage page's
# blocks import it as `examples.mlx_decoder`.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def pytest_collection_modifyitems(config, items):
    if mx.metal.is_available():
        return
    skip = pytest.mark.skip(reason="needs Apple-silicon Metal (mx.metal.is_available() is False)")
    for item in items:
        # The marker, not `"metal" in item.keywords`: keywords also hold parameter ids, and a case
        # id "metal" (an emulated-Metal parameter) was silently skipped off Apple silicon.
        if item.get_closest_marker("metal") is not None:
            item.add_marker(skip)
