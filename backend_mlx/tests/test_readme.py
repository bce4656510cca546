"""The README's attnres_mlx code blocks run unchanged and print what their comments say
(`attnres_conformance.doc_blocks`)."""

from pathlib import Path

from attnres_conformance.doc_blocks import make_tests

README = Path(__file__).resolve().parents[2] / "README.md"

test_readme_block_runs_and_prints_what_it_says, test_readme_has_blocks_for_this_backend = make_tests(
    README, "attnres_mlx", min_blocks=2)
