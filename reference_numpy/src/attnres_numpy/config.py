"""Deprecated alias of `attnres_core.config` (the same module object), kept for one release."""

import sys
import warnings

import attnres_core.config

warnings.warn("attnres_numpy.config is deprecated: import attnres_core.config (the same module)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = attnres_core.config
