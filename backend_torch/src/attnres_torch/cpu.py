"""Deprecated alias of `attnres_torch.cpu_alloc` (the glibc allocator setting of CPU loops), kept
for one release: the name said less than it holds and sat beside `cpu_c.py`, the C kernel."""

import warnings

from .cpu_alloc import keep_large_blocks, large_blocks_kept  # noqa: F401

__all__ = ["keep_large_blocks", "large_blocks_kept"]

warnings.warn("attnres_torch.cpu is deprecated and will be removed in the next release: use "
              "attnres_torch.cpu_alloc", DeprecationWarning, stacklevel=2)
