"""reference_numpy/README.md's attnres_numpy block (the page PyPI would show) runs unchanged and
prints what its comments say (`attnres_conformance.doc_blocks`); the tests-numpy session runs it."""

from pathlib import Path

from attnres_conformance.doc_blocks import make_tests

README = Path(__file__).resolve().parents[2] / "reference_numpy" / "README.md"

test_reference_readme_block_runs_and_prints_what_it_says, test_reference_readme_has_its_block = make_tests(
    README, "attnres_numpy", min_blocks=1)
