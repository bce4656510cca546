"""The golden vectors ship in the suite's wheel: a port installed from wheels checks them outside
any checkout (issue 17; before, `default_vectors_dir()` found only a checkout's `spec/vectors`
and the golden rows were reported as skipped there)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from attnres_numpy import vectors
from conftest import TESTS

CONFORMANCE = TESTS.parent  # the distribution's root: pyproject.toml, src/, README.md, LICENSE
GOLDEN = CONFORMANCE / "src" / "attnres_conformance" / "golden"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The conformance wheel, built (as `.ci/run` does, without build isolation: offline) from a
    copy of the distribution's folder alone, so nothing outside it (../spec) can be reached."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed here: cannot build a wheel without build isolation")
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "conformance"
    shutil.copytree(CONFORMANCE, source, ignore=shutil.ignore_patterns(
        "build", "dist", "*.egg-info", "__pycache__", "tests", ".pytest_cache"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-q", "-w", str(tmp / "dist"), str(source)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    (built,) = (tmp / "dist").glob("attnres_conformance-*.whl")
    return built


def test_spec_vectors_is_the_packaged_folder():
    """One copy: `spec/vectors` (what SPEC.md and VECTORS.md cite) is the package-data folder."""
    spec_vectors = CONFORMANCE.parent / "spec" / "vectors"
    assert spec_vectors.resolve() == GOLDEN.resolve()
    assert (GOLDEN / vectors.MANIFEST).is_file()


def test_the_wheel_holds_every_golden_vector(wheel):
    manifest = json.loads((GOLDEN / vectors.MANIFEST).read_text())
    expected = {f"attnres_conformance/golden/{e['file']}" for e in manifest["cases"]}
    assert len(expected) == len(list(GOLDEN.glob("*.npz"))) > 50
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert "attnres_conformance/golden/manifest.json" in names
        assert expected <= names, sorted(expected - names)[:5]
        assert zf.read("attnres_conformance/golden/manifest.json") == (GOLDEN / vectors.MANIFEST).read_bytes()


def test_golden_rows_run_outside_a_checkout(wheel, tmp_path):
    """The unpacked wheel first on sys.path, run from a folder with no `spec/vectors` above it and
    no $ATTNRES_VECTORS: the vectors are the wheel's own and every float64 golden row runs."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (vectors.ENV_VAR, "ATTNRES_BACKEND")}
    env["PYTHONPATH"] = str(site)
    where = subprocess.run([sys.executable, "-c", "from attnres_numpy.vectors import default_vectors_dir; "
                            "print(default_vectors_dir())"], cwd=elsewhere, env=env, capture_output=True,
                           text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == site / "attnres_conformance" / "golden"
    run = subprocess.run([sys.executable, "-m", "attnres_conformance", "--backend", "numpy", "--dtype", "float64",
                          "--select", "golden/", "--no-progress", "--json", "golden.json"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr
    (report,) = json.loads((elsewhere / "golden.json").read_text())["reports"]
    manifest = json.loads((GOLDEN / vectors.MANIFEST).read_text())
    f64 = [e["id"] for e in manifest["cases"] if e["dtype"] == "float64"]
    assert sorted(r["id"].split("/")[2] for r in report["results"]) == sorted(f64)
    assert {r["kind"] for r in report["results"]} == {"golden"}
    assert {r["forward"]["status"] for r in report["results"]} == {"pass"}
