"""Deprecated: the registry moved to `attnres_jax.dispatch` (the public backend contract).

This module keeps `use`, `select`, `REGISTRY`, `MODES` and `Impl` for one release; each warns
(DeprecationWarning) when used.  `use(mode, tile=, poison=)` maps to `attnres_jax.dispatch.use_impl`:
"interpret" -> `use_impl("auto", interpret=True, tile=, poison=)` (single-head calls on the
interpreted kernels, the others on XLA, as before), "interpret_tpu" -> the same with
`interpret="tpu"`, "xla" -> `use_impl("xla")`, "auto" -> `use_impl("auto", tile=, poison=)`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional, Protocol

from .. import dispatch as _dispatch
from .._args import Request

_MODES = ("auto", "interpret", "interpret_tpu", "xla")


class _Impl(Protocol):
    """An implementation of the ops (see `attnres_jax.dispatch`)."""

    name: str

    def supports(self, request: Request) -> Optional[str]: ...

    def resolve(self, request: Request) -> "_Impl": ...


@contextlib.contextmanager
def _use(mode: str, *, tile: Optional[int] = None, poison: bool = False):
    """Force a dispatch mode (one of MODES) for the public ops called inside the block."""
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {_MODES}, got {mode!r}")
    if tile is not None and (not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile: expected an int >= 1 or None, got {tile!r}")
    if mode == "xla":
        block = _dispatch.use_impl("xla")
    else:
        interpret = {"interpret": True, "interpret_tpu": "tpu"}.get(mode, False)
        block = _dispatch.use_impl("auto", interpret=interpret, tile=tile, poison=bool(poison))
    with block:
        yield


_ALIASES = {"use": (_use, "attnres_jax.dispatch.use_impl"),
            "select": (_dispatch.select, "attnres_jax.dispatch.select"),
            "REGISTRY": (_dispatch.REGISTRY, "attnres_jax.dispatch.REGISTRY"),
            "MODES": (_MODES, "attnres_jax.dispatch.use_impl's names and options"),
            "Impl": (_Impl, "the implementations of attnres_jax.dispatch.REGISTRY")}


def __getattr__(name: str):
    if name in _ALIASES:
        value, new = _ALIASES[name]
        warnings.warn(f"attnres_jax.pallas.dispatch.{name} is deprecated (removed in the next release): "
                      f"use {new}", DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_ALIASES))
