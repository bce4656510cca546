"""Deprecated alias of `attnres_core.training` (the same module object), kept for one release."""

import sys
import warnings

import attnres_core.training

warnings.warn("attnres_numpy.training is deprecated: import attnres_core.training (the same module)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = attnres_core.training
