"""mlx-lm's model file for an Attention Residuals checkpoint (config.json's "attnres" entry).

mlx_lm.load(path) refuses this checkpoint without trust_remote_code=True: a model built without
this file would drop the AttnRes rows and run as the PreNorm model.  Needs attnres-mlx installed;
attnres_mlx.mlx_lm.load_hf(path) loads it without running this file.
"""

from attnres_mlx.hf_checkpoint import Model, ModelArgs  # noqa: F401
