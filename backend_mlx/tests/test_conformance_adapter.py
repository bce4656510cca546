"""The suite's MLX adapter (`attnres_conformance.adapters.mlx`) in a child of a parallel run."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx

SCRIPT = """
import os, sys
import attnres_conformance.adapters.mlx  # noqa: F401  (imported first, as a child imports its port)
import mlx.core as mx
print(os.environ["TMPDIR"])
f = mx.compile(lambda x: mx.exp(x * 3.0) + x)  # a fused element-wise kernel: g++ on the CPU
mx.eval(f(mx.arange(8, dtype=mx.float32)))
"""


def _run(tmp_path, **env):
    env = {k: v for k, v in dict(os.environ, TMPDIR=str(tmp_path), **env).items() if v is not None}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()[0]


def test_each_child_of_a_parallel_run_compiles_into_its_own_directory(tmp_path):
    """MLX's CPU compiler writes each kernel into $TMPDIR/mlx/<version>/cpu and loads whatever
    library it finds there, with no lock between processes: a child of `--jobs` (parallel.CHILD_ENV
    set) compiles into <tmp>/attnres-conformance-mlx-<run>; any other process keeps its TMPDIR."""
    run7 = _run(tmp_path, ATTNRES_CONFORMANCE_RUN="7")
    assert run7 == str(tmp_path / "attnres-conformance-mlx-7")
    kernels = list((tmp_path / "attnres-conformance-mlx-7" / "mlx").glob("*/cpu/*.so"))
    if mx.default_device() == mx.cpu:  # on Apple silicon the kernel is Metal's, compiled in memory
        assert kernels, sorted(p.name for p in tmp_path.rglob("*"))
    assert _run(tmp_path, ATTNRES_CONFORMANCE_RUN=None) == str(tmp_path)
