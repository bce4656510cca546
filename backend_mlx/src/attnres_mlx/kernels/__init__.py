"""The implementations of the ops, one module each (registered in `attnres_mlx.dispatch`):
`compiled` (the spec's ops composed from plain `mlx.core` under `mx.compile`: every device and
dtype) and `metal` (`mx.fast.metal_kernel` kernels: Apple GPUs, every dtype but float64)."""
