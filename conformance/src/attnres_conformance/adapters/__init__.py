"""The suite's adapters: `base.Adapter` writes `call_op` / `call_probe` once; one small module per
framework supplies its primitives (`numpy`, `torch`, `jax`, `mlx`).  Only `base` and `numpy` are
imported eagerly by nothing here: the registry imports a framework's module by name, when chosen,
so importing `attnres_conformance` imports no framework."""
