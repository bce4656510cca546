"""Executable documentation: a Markdown file's Python blocks run unchanged and print what their
comments say.  Every `print(...)` line of a checked block ends in `  # <expected output>`; the
block runs in a fresh namespace and its printed lines must equal those comments, in order.

The backends' test suites (and a port's) call `make_tests` once per Markdown file and package,
and `make_page_tests` once for a documentation folder (every page's printing blocks).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Callable, Iterable, List, Tuple


def python_blocks(markdown: Path, package: str) -> List[str]:
    """The ```python blocks of `markdown` that import `package`."""
    text = Path(markdown).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    return [b for b in blocks if re.search(rf"^(from|import) {package}\b", b, flags=re.M)]


def expected_output(block: str) -> List[str]:
    """The expected printed lines: the trailing comment of every `print(` line."""
    out = []
    for line in block.splitlines():
        if line.startswith("print("):
            if "  # " not in line:
                raise AssertionError(f"print without its expected output comment: {line!r}")
            out.append(line.rsplit("  # ", 1)[1].strip())
    return out


def run_block(block: str, label: str) -> Tuple[List[str], List[str]]:
    """(printed lines, expected lines) of one block."""
    expected = expected_output(block)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(block, label, "exec"), {"__name__": "doc_block"})
    return stdout.getvalue().splitlines(), expected


def make_tests(markdown: Path, package: str, *, min_blocks: int = 1) -> Tuple[Callable, Callable]:
    """Two pytest test functions for a test module to bind: one parametrized over the blocks
    (each must print something, and exactly what its comments say) and one that the file holds
    at least `min_blocks` blocks for `package` (skipped, with the reason, when the file is not
    beside the tests, as in an installed wheel)."""
    import pytest

    markdown = Path(markdown)
    present = markdown.is_file()
    blocks = python_blocks(markdown, package) if present else []
    missing = pytest.mark.skipif(not present, reason=f"{markdown} is not beside this checkout")

    @missing
    @pytest.mark.parametrize("index", range(len(blocks)))
    def test_block_runs_and_prints_what_it_says(index):
        got, expected = run_block(blocks[index], f"{markdown.name} ({package} block {index})")
        assert expected, "a documentation block should print something the reader can compare with"
        assert got == expected

    @missing
    def test_file_has_blocks_for_this_package():
        assert len(blocks) >= min_blocks, (markdown, package, len(blocks))

    return test_block_runs_and_prints_what_it_says, test_file_has_blocks_for_this_package


def make_page_tests(docs: Path, package: str, *, extra: Iterable[Path] = (),
                    run_elsewhere: Iterable[str] = ()) -> Tuple[Callable, Callable]:
    """Two pytest test functions over every page `docs/**/*.md` (less the names in
    `run_elsewhere`) and the `extra` files that exist: one parametrized over the blocks that
    import `package` and print (a block without a print is a fragment of a larger program and is
    not run), each printing exactly what its comments say; one that `docs/usage.md` holds such a
    block.  Both skip, with the reason, when `docs` is not beside the tests (an installed wheel)."""
    import pytest

    docs = Path(docs)
    skip = set(run_elsewhere)
    pages = sorted(p for p in docs.glob("**/*.md") if p.name not in skip) if docs.is_dir() else []
    pages += [Path(e) for e in extra if Path(e).is_file()]
    blocks = [(page, i, block) for page in pages
              for i, block in enumerate(b for b in python_blocks(page, package) if "\nprint(" in "\n" + b)]
    missing = pytest.mark.skipif(not docs.is_dir(), reason=f"{docs} is not beside this checkout (an installed wheel)")

    @missing
    @pytest.mark.parametrize("page, index, block", blocks,
                             ids=[f"{p.relative_to(docs.parent)}:{i}" for p, i, _ in blocks])
    def test_doc_page_block_runs_and_prints_what_it_says(page, index, block):
        got, expected = run_block(block, f"{page.name} ({package} block {index})")
        assert got == expected

    @missing
    def test_usage_page_has_a_checked_block_for_this_backend():
        found = {page for page, _, _ in blocks}
        assert docs / "usage.md" in found, (package, sorted(map(str, found)))

    return test_doc_page_block_runs_and_prints_what_it_says, test_usage_page_has_a_checked_block_for_this_backend
