"""Two short, runnable examples of `attnres_torch` (not part of any wheel):

    python examples/decoder.py   # a PreNorm decoder converted to Block AttnRes, then trained
    python examples/hf_gpt.py    # a GPT-2-layout module converted in place by wrap_prenorm
"""
