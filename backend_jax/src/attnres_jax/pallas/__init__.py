"""Pallas kernels (`kernels`) and their platform dispatch (`dispatch`)."""
