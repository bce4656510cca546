"""attnres-numpy: the float64 NumPy reference of Attention Residuals (AttnRes).

`ops` holds the depth-attention operators and their hand-written VJPs (spec sections 2-3),
`model` the residual schemes over a stack of sublayers (sections 4-6), `config` the serializable
`ResidualConfig`, and `validation` the argument checks every backend shares.
"""

from . import validation
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
    "stack_forward",
    "validation",
]
