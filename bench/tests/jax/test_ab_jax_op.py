"""`bench/ab_jax_op.py`: a tree against itself gives the same output digest, and a tree that
computes another function a different one (the digest is what "bitwise the same" claims rest on);
a folder without the JAX backend is refused before any worker starts."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "ab_jax_op.py"


def _run(*trees, rounds="2", case="fwd"):
    return subprocess.run([sys.executable, str(SCRIPT), "--trees", *map(str, trees), "--case", case,
                           "--tokens", "8", "--dim", "16",
                           "--sources", "3", "--rounds", rounds, "--gap", "0"],
                          capture_output=True, text=True, timeout=300)


def _digests(out: str) -> list:
    return re.findall(r": ready, outputs ([0-9a-f]{16})", out)


def test_same_tree_same_digest_and_a_changed_tree_another(tmp_path):
    changed = tmp_path / "changed"
    for part in ("backend_jax/src", "core/src"):
        shutil.copytree(ROOT / part, changed / part, ignore=shutil.ignore_patterns("__pycache__"))
    xla = changed / "backend_jax/src/attnres_jax/kernels/xla.py"
    text = xla.read_text()
    # another function: the forward's output scaled by 2 (the forward's digest must change)
    marker = "    return out, lse, p, r, s\n"
    assert text.count(marker) == 1
    xla.write_text(text.replace(marker, "    return 2 * out, lse, p, r, s\n"))
    done = _run(ROOT, ROOT, changed)
    assert done.returncode == 0, done.stderr
    first, again, other = _digests(done.stdout)
    assert first == again
    assert other != first
    ratios = re.findall(r"/ first (\d+\.\d+)", done.stdout)
    assert len(ratios) == 3 and ratios[0] == "1.000"


def test_a_folder_without_the_backend_is_refused(tmp_path):
    done = _run(tmp_path, rounds="1")
    assert done.returncode != 0
    assert "no backend_jax/src/attnres_jax in" in done.stderr
