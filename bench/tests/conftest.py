"""The tests of the bench/ scripts: `torch/` runs in the torch test environment, `jax/` in the JAX
one.  bench/ is no package: its scripts (`gpu_check`, `kernel_report`, `peers`, ...) are imported
by name from bench/, and the checkout's root is on sys.path for `experiments.<name>` and the torch
tests' comparison helpers (`backend_torch.tests._helpers`)."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]
