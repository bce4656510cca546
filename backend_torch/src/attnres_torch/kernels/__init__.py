"""Fused GPU kernels of the fast paths: `triton_depth` is the whole Triton implementation
("triton" of `attnres_torch.dispatch`: support check, `@triton.jit` kernels, host code, custom
ops); importing it imports Triton."""
