"""Deprecated: the Pallas implementation (`Pallas`, `INTERPRETERS`) moved into
`attnres_jax.pallas.kernels`, beside the kernels it runs.  Kept for one release; each name warns
(DeprecationWarning) when used."""

from __future__ import annotations

import warnings

from . import kernels as _kernels


def __getattr__(name: str):
    if name in ("Pallas", "INTERPRETERS"):
        warnings.warn(f"attnres_jax.pallas.impl.{name} is deprecated (removed in the next release): use "
                      f"attnres_jax.pallas.kernels.{name}", DeprecationWarning, stacklevel=2)
        return getattr(_kernels, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
