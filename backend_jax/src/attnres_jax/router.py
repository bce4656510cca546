"""Deprecated alias of `attnres_jax.stack` (the module held the stack functions and the ops
object, never a router, so it was renamed); it forwards every name and goes in the next release."""

from __future__ import annotations

import warnings

from . import stack as _stack

warnings.warn("attnres_jax.router is deprecated: import attnres_jax.stack (same names)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_stack, name)
