import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# Pinned numerics (docs/environment.md): no platform may lower fp32 matmul precision under test.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
