"""Backend selection: names, module:object, $ATTNRES_BACKEND, and the errors."""

import pytest
from attnres_conformance.backend import Backend
from attnres_conformance.registry import BACKENDS, BackendSelectionError, load_backend


def test_names():
    assert set(BACKENDS) == {"numpy", "torch", "jax", "mlx"}
    backend = load_backend("numpy")
    assert isinstance(backend, Backend) and backend.name == "numpy"
    assert load_backend("attnres_conformance.reference_backend:backend") is backend


def test_nothing_selected(monkeypatch):
    monkeypatch.delenv("ATTNRES_BACKEND", raising=False)
    with pytest.raises(BackendSelectionError, match="none selected"):
        load_backend()


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("ATTNRES_BACKEND", "numpy")
    assert load_backend().name == "numpy"


def test_bad_specs():
    with pytest.raises(BackendSelectionError, match="unknown name 'tensorflow'"):
        load_backend("tensorflow")
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        load_backend("no_such_module_xyz:backend")
    with pytest.raises(BackendSelectionError, match="has no attribute 'nope'"):
        load_backend("attnres_conformance.registry:nope")
    with pytest.raises(BackendSelectionError, match="does not implement"):
        load_backend("attnres_conformance.registry:BACKENDS")


def test_missing_framework_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(BACKENDS, "fakefw", "attnres_fakefw.conformance:backend")
    with pytest.raises(ImportError, match="pip install attnres-fakefw"):
        load_backend("fakefw")
