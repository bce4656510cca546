"""Runnable examples: `python -m attnres_jax.examples.decoder` (a PreNorm decoder in Flax NNX
converted to Block AttnRes; needs the `flax` extra)."""
