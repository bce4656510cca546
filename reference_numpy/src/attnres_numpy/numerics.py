"""Deprecated alias of `attnres_core.numerics` (the same module object), kept for one release."""

import sys
import warnings

import attnres_core.numerics

warnings.warn("attnres_numpy.numerics is deprecated: import attnres_core.numerics (the same module)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = attnres_core.numerics
