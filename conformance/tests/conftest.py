"""Meta-tests of the conformance suite: `adapters.py` (importable as `adapters`) holds the
honest and deliberately broken backends."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The mutation score (test_mutation_score.py) in the summary, pass or fail, so CI logs it."""
    module = sys.modules.get("attnres_conformance.mutants")
    score = getattr(module, "last_score", None)
    if score is not None:
        terminalreporter.write_sep("=", "mutation score (attnres_conformance.mutants)")
        terminalreporter.write_line(score.text())
