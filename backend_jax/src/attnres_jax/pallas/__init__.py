"""The Pallas implementation (`kernels`: `Pallas` and the kernels it runs).  The registry that
chooses between it and XLA is `attnres_jax.dispatch`."""
