"""Deprecated alias of `attnres_torch.training` (the same module object), kept for one release."""

import sys
import warnings

from . import training

warnings.warn("attnres_torch.schedules is deprecated: import attnres_torch.training (the same module)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = training
