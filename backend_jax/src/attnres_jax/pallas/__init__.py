"""Pallas kernels (`kernels`), the Pallas implementation around them (`impl`), and the choice
between it and XLA (`dispatch`)."""
