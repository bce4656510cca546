"""The documentation site's pages (docs/**/*.md) and this distribution's README: each Python
block that imports attnres_torch and prints runs unchanged and prints what its comments say
(`attnres_conformance.doc_blocks`).
A block without a print is a fragment of a larger program (a process group, a real model) and
is not run; docs/hf-fsdp-autocast.md's blocks are run by test_hf.py."""

from pathlib import Path

import pytest
from attnres_conformance.doc_blocks import python_blocks, run_block

DOCS = Path(__file__).resolve().parents[2] / "docs"
OWN_README = Path(__file__).resolve().parents[1] / "README.md"
PACKAGE = "attnres_torch"
RUN_ELSEWHERE = {"hf-fsdp-autocast.md"}
PAGES = sorted(p for p in DOCS.glob("**/*.md") if p.name not in RUN_ELSEWHERE) if DOCS.is_dir() else []
PAGES += [OWN_README] if OWN_README.is_file() else []
BLOCKS = [(page, i, block) for page in PAGES
          for i, block in enumerate(b for b in python_blocks(page, PACKAGE) if "\nprint(" in "\n" + b)]
missing = pytest.mark.skipif(not DOCS.is_dir(), reason="docs/ is not beside this checkout (an installed wheel)")


@missing
@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p.relative_to(DOCS.parent)}:{i}" for p, i, _ in BLOCKS])
def test_doc_page_block_runs_and_prints_what_it_says(page, index, block):
    got, expected = run_block(block, f"{page.name} ({PACKAGE} block {index})")
    assert got == expected


@missing
def test_usage_page_has_a_checked_block_for_this_backend():
    pages = {page for page, _, _ in BLOCKS}
    assert DOCS / "usage.md" in pages, (PACKAGE, sorted(map(str, pages)))
