"""Test configuration: `metal`-marked tests are skipped where Metal is unavailable."""

import os
import sys
import tempfile

import mlx.core as mx
import pytest

# MLX's CPU backend compiles each fused kernel with g++ into $TMPDIR/mlx/ and loads any library it
# finds there, with no lock between processes: two processes compiling one kernel at once can load
# a half-written library.  Each pytest-xdist worker gets a directory of its own, kept between runs
# (as attnres_conformance.adapters.mlx does for the suite's parallel runs).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _kernels = os.path.join(tempfile.gettempdir(), "attnres-tests-mlx-" + os.environ["PYTEST_XDIST_WORKER"])
    os.makedirs(_kernels, exist_ok=True)
    os.environ["TMPDIR"] = _kernels

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
