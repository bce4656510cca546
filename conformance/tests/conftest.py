"""Meta-tests of the conformance suite: `adapters.py` (importable as `adapters`) holds the
honest and deliberately broken backends."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
