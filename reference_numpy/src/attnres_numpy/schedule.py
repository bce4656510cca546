"""Deprecated alias of `attnres_core.schedule` (the same module object), kept for one release."""

import sys
import warnings

import attnres_core.schedule

warnings.warn("attnres_numpy.schedule is deprecated: import attnres_core.schedule (the same module)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = attnres_core.schedule
