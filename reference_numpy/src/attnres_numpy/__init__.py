"""attnres-numpy: the float64 reference (oracle) of AttnRes, beside the spec core `attnres_core`.

The float64 oracle:
  `ops`      the depth-attention operators and their hand-written VJPs (spec sections 2-3).
  `tape`     the float64 reverse-mode tape: the reference's ops object for the schedule.
  `model`    the residual schemes over user sublayers and the spec's probe network (sections 4-6).
  `vectors`  the golden-vector generator and reader.

The spec core every backend imports (`config`, `validation`, `numerics`, `schedule`, `probe`,
`training`, `dispatch`) is the package `attnres_core`, in its own distribution `attnres-core`.  `ResidualConfig`,
`VARIANT_KINDS`, `numerics`, `schedule` and `validation` are re-exported here (the same objects).
"""

from attnres_core import numerics, schedule, validation
from attnres_core.config import VARIANT_KINDS, ResidualConfig

from .model import (
    probe_forward,
    probe_sublayers,
    probe_vjp,
    rmsnorm,
    rmsnorm_vjp,
    stack_forward,
)
from .ops import (
    depth_attention,
    depth_attention_multi,
    depth_attention_multi_vjp,
    depth_attention_vjp,
    merge_partial,
    merge_partial_vjp,
)

__version__ = "0.1.0"

__all__ = [
    "ResidualConfig",
    "VARIANT_KINDS",
    "depth_attention",
    "depth_attention_multi",
    "depth_attention_multi_vjp",
    "depth_attention_vjp",
    "merge_partial",
    "merge_partial_vjp",
    "probe_forward",
    "probe_sublayers",
    "probe_vjp",
    "rmsnorm",
    "rmsnorm_vjp",
    "numerics",
    "schedule",
    "stack_forward",
    "validation",
]
