"""The README's jax code blocks run unchanged and print what their comments say.

Every `print(...)` line of a block ends in a comment with the expected output; the block runs in
a fresh namespace and its printed lines must equal those comments, in order."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BACKEND = "attnres_jax"


def _blocks():
    text = README.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    return [b for b in blocks if re.search(rf"^(from|import) {BACKEND}\b", b, flags=re.M)]


def _expected(block: str):
    out = []
    for line in block.splitlines():
        if line.startswith("print("):
            assert "  # " in line, f"README print without its expected output: {line!r}"
            out.append(line.rsplit("  # ", 1)[1].strip())
    return out


@pytest.mark.skipif(not README.is_file(), reason="README.md is not beside this checkout")
@pytest.mark.parametrize("index", range(len(_blocks()) if README.is_file() else 0))
def test_readme_block_runs_and_prints_what_it_says(index):
    block = _blocks()[index]
    expected = _expected(block)
    assert expected, "a README block should print something the reader can compare with"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(block, f"README.md ({BACKEND} block {index})", "exec"), {"__name__": "readme"})
    assert stdout.getvalue().splitlines() == expected


def test_readme_has_blocks_for_this_backend():
    if README.is_file():
        assert len(_blocks()) >= 2
