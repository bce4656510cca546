import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
# The checkout's top-level `examples/` and `experiments/` (no wheel ships them): their tests and
# the tests that borrow the example decoder import them as `examples.<name>`, `experiments.<name>`.
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))

# Pinned numerics (docs/environment.md): no platform may lower fp32 matmul precision under test.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
