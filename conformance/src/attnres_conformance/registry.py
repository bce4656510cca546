"""Backend selection: a registered name or any `module:object`, imported lazily.

Nothing is selected by default: choosing no backend is an error (einops / array-api-tests
style), so a CI job can never silently test nothing.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

from .backend import Backend

#: Registered names -> "module:object".
#: The adapters live in the suite (`ports/`, on the framework bases of `adapters/`); each imports
#: its framework only when chosen.
BACKENDS = {
    "numpy": "attnres_conformance.adapters.numpy:backend",
    "torch": "attnres_conformance.ports.attnres_torch:backend",
    "jax": "attnres_conformance.ports.attnres_jax:backend",
    "mlx": "attnres_conformance.ports.attnres_mlx:backend",
}
#: The package a registered name needs (for the ImportError's hint).
PACKAGES = {"numpy": "attnres-numpy", "torch": "attnres-torch", "jax": "attnres-jax", "mlx": "attnres-mlx"}
ENV_VAR = "ATTNRES_BACKEND"


class BackendSelectionError(ValueError):
    """No backend, an unknown name, or an object that is not a Backend."""


def resolve(spec: str) -> str:
    """A registered name or a "module:object" string -> "module:object"."""
    if spec in BACKENDS:
        return BACKENDS[spec]
    module, sep, obj = spec.partition(":")
    if not sep or not module or not obj:
        raise BackendSelectionError(
            f"backend: unknown name {spec!r}; use one of {sorted(BACKENDS)} or 'module:object'")
    return spec


def load_backend(spec: Optional[str] = None) -> Backend:
    """The backend named by `spec` (or $ATTNRES_BACKEND when spec is None).

    Raises BackendSelectionError when none is selected or the object is not a Backend, and
    ImportError (with the package to install) when its module is missing."""
    spec = spec if spec is not None else os.environ.get(ENV_VAR)
    if not spec:
        raise BackendSelectionError(
            f"backend: none selected; pass --backend NAME (one of {sorted(BACKENDS)}) or "
            f"module:object, or set ${ENV_VAR}")
    module_name, _, attr = resolve(spec).partition(":")
    if spec not in BACKENDS and "" not in sys.path and os.getcwd() not in sys.path:
        # `attnres-conformance --backend my_adapter:backend` finds my_adapter.py in the current
        # directory, as `python -m` would (console scripts do not put it on sys.path).
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        package = PACKAGES.get(spec, f"attnres-{spec}")
        hint = f" (install the {spec} backend package: pip install {package})" if spec in BACKENDS else ""
        raise ImportError(f"backend {spec!r}: cannot import {module_name}{hint}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BackendSelectionError(f"backend {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, Backend):
        raise BackendSelectionError(
            f"backend {spec!r}: {type(obj).__name__} does not implement attnres_conformance.backend.Backend "
            "(name, is_available, capabilities, versions, call_op, call_probe)")
    return obj
