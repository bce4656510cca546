"""Fused kernels of the fast paths.  `triton_depth` is the host side of the Triton kernels (it
imports without Triton and then reports `supports(...) == False`); `_depth_kernels` holds the
`@triton.jit` code itself and is imported only when Triton is."""
