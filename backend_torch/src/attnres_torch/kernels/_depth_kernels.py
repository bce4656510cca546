"""Deprecated: the `@triton.jit` kernels now live in `triton_depth.py`, the one module of the
Triton implementation (support check, kernels, host code, custom ops).  This alias re-exports
them for one release."""

import warnings

from .triton_depth import (  # noqa: F401
    TABLE_SLOTS,
    _depth_bwd_kernel,
    _depth_fwd_kernel,
    _fill_table_kernel,
    _merge_kernel,
    _phase1_logits_kernel,
    _reduce_rows_kernel,
    _weighted_sum_kernel,
)

warnings.warn("attnres_torch.kernels._depth_kernels is deprecated and will be removed in the next "
              "release: the kernels are in attnres_torch.kernels.triton_depth",
              DeprecationWarning, stacklevel=2)
