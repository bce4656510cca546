"""Deprecated alias of `attnres_core.probe` (the same module object), kept for one release."""

import sys
import warnings

import attnres_core.probe

warnings.warn("attnres_numpy.probe is deprecated: import attnres_core.probe (the same module)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = attnres_core.probe
