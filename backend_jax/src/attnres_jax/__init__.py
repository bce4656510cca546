"""Attention Residuals (AttnRes) for JAX.

Pure functions (`depth_attention`, `depth_attention_multi`, `merge_partial`, `stack_apply`,
its layer-scanned form `scan_apply`, `probe_forward`) usable from any JAX library (the three
ops choose Pallas kernels or XLA by their `impl=` keyword: `attnres_jax.pallas.dispatch`); Flax NNX modules live in `attnres_jax.modules` (import it
explicitly: Flax is an optional dependency).  The conformance adapter lives in the suite:
`attnres_conformance.adapters.jax`.
"""

from attnres_numpy.config import ResidualConfig

from .ops import depth_attention, depth_attention_multi, merge_partial
from .router import probe_forward, probe_sublayers, rmsnorm, scan_apply, stack_apply

__version__ = "0.1.0"

__all__ = [
    "ResidualConfig", "depth_attention", "depth_attention_multi", "merge_partial", "probe_forward",
    "probe_sublayers", "rmsnorm", "scan_apply", "stack_apply", "__version__",
]
