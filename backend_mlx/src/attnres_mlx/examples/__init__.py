"""Runnable examples: `python -m attnres_mlx.examples.decoder` (a PreNorm decoder in `mlx.nn`
converted to Block AttnRes)."""
