"""Attention Residuals for PyTorch: the spec's ops (autograd, `torch.library` custom ops, a chunked
CPU kernel, Triton kernels on CUDA) and `torch.nn` modules."""

from attnres_numpy.config import ResidualConfig

from . import (
    cpu,  # noqa: F401  (attnres_torch.cpu.keep_large_blocks(): opt-in, nothing at import)
    dtensor,  # noqa: F401  (registers the ops' DTensor sharding strategies)
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
