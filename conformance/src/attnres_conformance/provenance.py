"""Where a report comes from: the date and the git commit of the code that ran.

`git_commit(path)` is "unknown" (never an error) outside a checkout, without git, or when the
file is not tracked by the repository around it (a virtualenv inside some other project).
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path
from typing import Optional

UNKNOWN = "unknown"


def utc_now() -> str:
    """The current time, ISO 8601 in UTC to the second, e.g. "2026-12-01T00:30:00Z"."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _git(folder: Path, *args: str) -> Optional[subprocess.CompletedProcess]:
    try:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):  # no git, a timeout
        return None


def git_commit(path: Path) -> str:
    """The commit checked out around the file `path` ("<sha> (uncommitted changes)" when the
    tracked files differ from it), or "unknown" when `path` is not a tracked file of a checkout."""
    path = Path(path).resolve()
    tracked = _git(path.parent, "ls-files", "--error-unmatch", path.name)
    if tracked is None or tracked.returncode != 0:
        return UNKNOWN
    head = _git(path.parent, "rev-parse", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return UNKNOWN
    dirty = _git(path.parent, "diff", "--quiet", "HEAD", "--")
    return head.stdout.strip() + (" (uncommitted changes)" if dirty is not None and dirty.returncode == 1 else "")


def source_file(obj) -> Path:
    """The file defining `obj`'s class (a backend adapter), else this package's `__init__`."""
    module = sys.modules.get(type(obj).__module__)
    file = getattr(module, "__file__", None)
    return Path(file) if file else Path(__file__).with_name("__init__.py")
