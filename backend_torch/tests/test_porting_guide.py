"""docs/validating-a-port.md runs as written, from a temporary folder, as a porter would: its
torch adapter file (a fenced block whose first line names the file), the CLI lines that run a
quick subset, and the "From Python" block.  The adapter imports no attnres backend."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "validating-a-port.md"
pytestmark = pytest.mark.skipif(not DOC.is_file(), reason="docs/ is not part of this checkout")


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The guide's files, each written where its first line (`# name.py`) says."""
    tmp = tmp_path_factory.mktemp("porter")
    for block in _blocks("python"):
        first = block.splitlines()[0]
        if re.fullmatch(r"# [\w]+\.py", first):
            (tmp / first[2:]).write_text(block)
    assert (tmp / "my_port_adapter.py").is_file()
    return tmp


def _run(args, cwd):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_adapter_imports_no_attnres_backend(folder):
    code = "import sys, my_port_adapter; print(sorted(m for m in sys.modules if m.startswith('attnres_torch')))"
    proc = _run([sys.executable, "-c", code], folder)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_quick_cli_line_runs_as_written(folder):
    """The guide's `--quick --dtype float32` line, run from the adapter's folder."""
    line = next(line for block in _blocks("console") for line in block.splitlines()
                if "--quick" in line and "my_port_adapter" in line)
    args = shlex.split(line.split("$ ", 1)[1].split("#")[0])
    assert args[0] == "attnres-conformance"
    cli = Path(sys.executable).parent / "attnres-conformance"
    proc = _run([str(cli), *args[1:], "--no-progress"], folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "verdict: PASS" in proc.stdout and "coverage (cases run" in proc.stdout


def test_from_python_block_runs_as_written(folder):
    block = next(b for b in _blocks("python") if b.startswith("from attnres_conformance.runner import"))
    proc = _run([sys.executable, "-c", block], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "verdict: PASS"
