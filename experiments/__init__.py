"""The experiments behind the documentation's measured results, run from a checkout (this folder
is not part of any wheel; it needs `attnres_torch` installed):

* a small byte-level GPT-style language model with a switch over every residual variant
  (`model.py`), a CPU training command that compares variants on the Python standard library's
  own source files (`train.py`) and the report it writes (`report.py`);
* the depth study (`study.py`, `study_report.py`, `probes.py`), the compute-scaling sweep
  (`scaling.py`, `scaling_report.py`, `corpus.py`) and the multi-hop recall probe (`recall.py`);
* `distributed_smoke.py`: every distributed path on one device (NCCL on a GPU, gloo on the CPU).

From the repository root:

    python -m experiments.train --help
"""
