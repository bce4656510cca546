"""Runs `test_triton_depth.py` in a subprocess with TRITON_INTERPRET=1.

Triton decides at import time whether kernels (its own library functions included) are
interpreted, so the interpreted CPU tests get a fresh interpreter; the environment of this test
process (and any compiled CUDA kernels in it) stays untouched.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton

MODULE = Path(__file__).with_name("test_triton_depth.py")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed (pip install triton)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1 already: test_triton_depth.py runs in this process")
def test_triton_kernels_in_interpreter_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(MODULE), "-q", "-p", "no:cacheprovider"],
                          cwd=MODULE.parents[1], env=env, capture_output=True, text=True, timeout=600)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert proc.returncode == 0 and summary, f"interpreted Triton tests failed:\n{tail}"
    assert not re.search(r"\d+ (failed|skipped|error)", proc.stdout), tail
    print(summary.group(0), "in the TRITON_INTERPRET=1 subprocess")
