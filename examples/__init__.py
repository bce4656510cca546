"""Short, runnable examples (not part of any wheel), from the repository root:

    python examples/torch_decoder.py   # a PreNorm decoder converted to Block AttnRes, then trained
    python examples/hf_gpt.py          # a GPT-2-layout torch module converted in place by wrap_prenorm
    python examples/jax_decoder.py     # the decoder in Flax NNX (attnres-jax[flax])
    python examples/mlx_decoder.py     # the decoder in mlx.nn
"""
