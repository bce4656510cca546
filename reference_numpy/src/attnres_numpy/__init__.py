"""attnres-numpy: the spec core every backend imports, and the float64 reference of AttnRes.

The spec core (numpy only, shared by every backend):
  `config`      the serializable `ResidualConfig` (spec section 5, M1-M9).
  `validation`  the argument checks (same messages everywhere; spec "Errors").
  `numerics`    the compute-dtype rule (C10) and exact rounding to fp32/fp16/bf16.
  `schedule`    the residual schedule of every scheme, written once, over a backend's ops object.
  `probe`       the spec's probe network (section 6), written once over an ops object.
  `training`    the training tools' framework-neutral part: M10 curves, collapse statistics and
                policy decisions, the FLA/K3 checkpoint key mappings.

The float64 oracle beside it:
  `ops`      the depth-attention operators and their hand-written VJPs (spec sections 2-3).
  `tape`     the float64 reverse-mode tape: the reference's ops object for the schedule.
  `model`    the residual schemes over user sublayers and the spec's probe network (sections 4-6).
  `vectors`  the golden-vector generator and reader.
"""

from . import numerics, schedule, validation
from .config import VARIANT_KINDS, ResidualConfig
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
