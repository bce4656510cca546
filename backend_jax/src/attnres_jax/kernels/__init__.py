"""The implementations the registry `attnres_jax.dispatch` chooses between, one module each:
`pallas` (`Pallas` and the Pallas kernels it runs) and `xla` (the XLA formulas and VJP rules,
every call).  This package imports neither; `dispatch` imports both."""
