"""Attention Residuals (AttnRes) for JAX.

Pure functions (`depth_attention`, `depth_attention_multi`, `merge_partial`, `stack_apply`,
its layer-scanned form `scan_apply`, `probe_forward`) usable from any JAX library.  The three
ops run on Pallas kernels or XLA, chosen per call by the registry `attnres_jax.dispatch` (the
public backend contract: `IMPLEMENTATIONS`, `availability`, `use_impl`, `last_choice`,
`impl_counts`, `capabilities`) or forced by their `impl=` keyword.  Flax NNX modules live in
`attnres_jax.modules` (import it explicitly: Flax is an optional dependency).  The conformance
adapter lives in the suite: `attnres_conformance.ports.attnres_jax`.
"""

from attnres_core.config import ResidualConfig

from . import dispatch
from .ops import depth_attention, depth_attention_multi, merge_partial
from .residual_ops import rmsnorm
from .stack import probe_forward, probe_sublayers, scan_apply, stack_apply

__version__ = "0.1.0"

__all__ = [
    "ResidualConfig", "depth_attention", "dispatch", "depth_attention_multi", "merge_partial", "probe_forward",
    "probe_sublayers", "rmsnorm", "scan_apply", "stack_apply", "__version__",
]
