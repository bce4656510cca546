"""Attention Residuals for PyTorch: the spec's ops (autograd, `torch.library` custom ops, a fused C
kernel and a chunked torch kernel on the CPU, Triton kernels on CUDA) and `torch.nn` modules.
`attnres_torch.dispatch` is the backend contract: which implementation serves a call, forcing
one, capabilities."""

from attnres_core.config import ResidualConfig

from . import (
    cpu_alloc,  # noqa: F401  (attnres_torch.cpu_alloc.keep_large_blocks(): opt-in, nothing at import)
    dispatch,  # noqa: F401  (the public backend contract)
    dtensor,  # noqa: F401  (DTensor sharding strategies of the custom ops)
)
from .dispatch import impl_counts, last_impl, use_impl
from .modules import AttnResTransformer, DepthAttention, DepthRouter
from .ops import depth_attention, depth_attention_multi, merge_partial

__version__ = "0.1.0"

__all__ = [
    "AttnResTransformer",
    "DepthAttention",
    "DepthRouter",
    "ResidualConfig",
    "depth_attention",
    "depth_attention_multi",
    "impl_counts",
    "last_impl",
    "merge_partial",
    "use_impl",
    "__version__",
]
