"""Deprecated alias of `attnres_core.validation` (the same module object), kept for one release."""

import sys
import warnings

import attnres_core.validation

warnings.warn("attnres_numpy.validation is deprecated: import attnres_core.validation (the same module)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = attnres_core.validation
