"""Attention Residuals (AttnRes) for JAX.

Pure functions (`depth_attention`, `depth_attention_multi`, `merge_partial`, `stack_apply`,
`probe_forward`) usable from any JAX library; Flax NNX modules live in `attnres_jax.nnx`
(imported on demand: Flax is an optional dependency); the conformance adapter in
`attnres_jax.conformance`.
"""

from .ops import depth_attention, depth_attention_multi, merge_partial
from .stack import probe_forward, probe_sublayers, rmsnorm, stack_apply

__version__ = "0.1.0"

__all__ = [
    "depth_attention", "depth_attention_multi", "merge_partial", "probe_forward", "probe_sublayers",
    "rmsnorm", "stack_apply", "__version__",
]
