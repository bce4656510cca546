"""The pytest plugin (`--attnres-backend`) and the numpy-only import rule."""

import os
import subprocess
import sys

from conftest import TESTS


def run(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=180)


def test_plugin_generates_one_test_per_case(tmp_path):
    result = run("--attnres-backend=numpy", "--attnres-quick", "-k", "identity or errors", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "skipped" in result.stdout  # bf16 etc.: undeclared dtypes
    ids = run("--attnres-backend=numpy", "--attnres-quick", "--collect-only", "-q", cwd=tmp_path).stdout
    assert "attnres::depth_attention/shapes/N33-T3-D123/float64" in ids


def test_plugin_failure_shows_the_reproducer(tmp_path):
    result = run("--attnres-backend=adapters:broken_logit_scale", "--attnres-dtype=float64",
                 "-k", "depth_attention/base/", cwd=tmp_path)
    assert result.returncode == 1
    assert "reproduce:" in result.stdout
    assert "attnres-conformance --backend adapters:broken_logit_scale --device cpu --case" in result.stdout


def test_imports_numpy_only():
    code = ("import sys, attnres_numpy, attnres_conformance.cli, attnres_conformance.pytest_plugin, "
            "attnres_conformance.runner, attnres_conformance.reference_backend\n"
            "attnres_conformance.runner.run_conformance(attnres_conformance.reference_backend.backend, "
            "case_ids=['depth_attention/base/N5-T3-D16/float64'])\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'mlx', 'jaxlib', 'triton'))\n"
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
