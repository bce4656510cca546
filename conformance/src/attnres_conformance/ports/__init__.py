"""Adapters of specific implementations, each on a framework-only base of `adapters/`:
`attnres_torch`, `attnres_jax`, `attnres_mlx` (this project's backends, registry names "torch",
"jax", "mlx") and the public ports of other projects (the compliance table's rows).  Each module
imports its port only when chosen."""
