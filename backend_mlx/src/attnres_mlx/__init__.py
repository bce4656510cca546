"""Attention Residuals for MLX: custom-VJP ops, `mlx.nn` modules, two-phase schedule."""

from attnres_core.config import ResidualConfig

from .modules import DepthAttention, DepthRouter, Transformer
from .ops import depth_attention, depth_attention_multi, inverse_rms, merge_partial

__all__ = ["DepthAttention", "DepthRouter", "ResidualConfig", "Transformer", "depth_attention",
           "depth_attention_multi", "inverse_rms", "merge_partial"]
__version__ = "0.1.0"
