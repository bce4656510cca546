"""A runnable demonstration of AttnRes: a small byte-level GPT-style language model with a switch
over every residual variant (`model.py`), a CPU training command that compares variants on the
Python standard library's own source files (`train.py`), and the report it writes (`report.py`).

    python -m attnres_torch.examples.train --help
"""
