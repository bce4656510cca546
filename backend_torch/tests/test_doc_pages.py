"""The documentation site's pages (docs/**/*.md) and this distribution's README: each Python
block that imports attnres_torch and prints runs unchanged and prints what its comments say
(`attnres_conformance.doc_blocks.make_page_tests`).  docs/hf-fsdp-autocast.md's blocks are run by
test_hf.py."""

from pathlib import Path

from attnres_conformance.doc_blocks import make_page_tests

ROOT = Path(__file__).resolve().parents[1]
(test_doc_page_block_runs_and_prints_what_it_says,
 test_usage_page_has_a_checked_block_for_this_backend) = make_page_tests(
    ROOT.parent / "docs", "attnres_torch", extra=[ROOT / "README.md"], run_elsewhere={"hf-fsdp-autocast.md"})
