"""A larger byte-level corpus that needs no download: the text files that installed Python ships.

Sources: the Python standard library tree (`sysconfig.get_paths()["stdlib"]`, without its
site-packages) and the package directories of a few installed distributions (by default torch,
accelerate and peft, the three whose versions the noxfile pins in the tests-torch environment).
From each source every file ending in `.py`, `.md`, `.rst` or `.txt` is read, in the order of its
path `<source>/<relative path>`.

* **De-duplicated** by content: a file whose bytes (SHA-256) were already taken from an earlier
  path is dropped, so no text is in both splits twice over.
* **Held out by path**: a file is in validation when the first 8 hex digits of the SHA-256 of its
  path `<source>/<relative path>`, read as an integer / 2^32, are below `val_fraction`.  The split
  of a file never depends on which other files exist.
* **Byte-level tokens**: each split is its files' bytes concatenated (token = byte, 256 values).

`Corpus.describe()` records per split the file count, bytes (= tokens) and the SHA-256 of the
bytes, and per source its version, so a run can say exactly which text it saw.  For a given
environment the corpus is identical from run to run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

#: The installed distributions read besides the standard library (pinned by the noxfile).
DEFAULT_PACKAGES = ("torch", "accelerate", "peft")
#: The text files read from every source.
EXTENSIONS = (".py", ".md", ".rst", ".txt")
#: Directories never entered.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass
class Corpus:
    """The two splits as `[n]` uint8 tensors, and where they came from."""

    train: torch.Tensor  # [n_train] uint8
    val: torch.Tensor  # [n_val] uint8
    sources: List[dict]  # [{"name", "version", "root", "files", "bytes"}] in reading order
    files: Dict[str, List[str]]  # {"train": paths, "val": paths}, as <source>/<relative path>
    duplicates: int  # files dropped because their bytes were already taken
    val_fraction: float
    python: str = field(default_factory=platform.python_version)

    def describe(self) -> dict:
        """A JSON-ready record: per split files, bytes (= tokens) and SHA-256; per source its
        version; the split rule."""
        return {"python": self.python, "extensions": list(EXTENSIONS),
                "val_fraction": self.val_fraction, "duplicates_dropped": self.duplicates,
                "sources": [dict(s) for s in self.sources],
                "train": _split(self.train, self.files["train"]),
                "val": _split(self.val, self.files["val"])}

    def sha256(self) -> Dict[str, str]:
        """{"train": hex, "val": hex}: the SHA-256 of each split's bytes."""
        return {"train": _sha(self.train), "val": _sha(self.val)}


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _split(data: torch.Tensor, files: List[str]) -> dict:
    return {"files": len(files), "bytes": int(data.numel()), "sha256": _sha(data)}


def is_validation(path: str, val_fraction: float) -> bool:
    """Whether the file at `path` (`<source>/<relative path>`) is held out: a stable hash of the
    path, independent of the file's contents and of every other file."""
    return int(hashlib.sha256(path.encode("utf-8")).hexdigest()[:8], 16) / 2 ** 32 < val_fraction


def package_root(name: str) -> Tuple[Path, str]:
    """(the import directory, the distribution version) of an installed package."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"packages: {name!r} is not installed in this Python ({platform.python_version()})")
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Path(spec.origin).parent, version


def default_sources(packages: Sequence[str] = DEFAULT_PACKAGES, *,
                    stdlib: bool = True) -> List[Tuple[str, Path, str]]:
    """[(source name, root directory, version)]: the standard library (when `stdlib`), then
    `packages` in the order given."""
    out = []
    if stdlib:
        out.append(("stdlib", Path(sysconfig.get_paths()["stdlib"]), platform.python_version()))
    for name in packages:
        root, version = package_root(name)
        out.append((name, root, version))
    return out


def _text_files(root: Path) -> List[str]:
    """Relative POSIX paths of the text files under `root`, sorted (symlinked directories are
    not followed)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(EXTENSIONS):
                path = Path(dirpath, name)
                if path.is_file():
                    found.append(path.relative_to(root).as_posix())
    return sorted(found)


def load_corpus(sources: Optional[Sequence[Tuple[str, Path, str]]] = None, *,
                val_fraction: float = 0.05) -> Corpus:
    """Read the corpus (see the module docstring).

    sources: [(name, root directory, version)] read in this order (default: `default_sources()`,
      the standard library, torch, accelerate, peft); names must be distinct.
    val_fraction: the expected share of files held out, in (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a value in (0, 1), got {val_fraction}")
    sources = default_sources() if sources is None else list(sources)
    names = [name for name, _, _ in sources]
    if not sources or len(set(names)) != len(names):
        raise ValueError(f"sources: expected distinct source names, got {names}")
    seen = set()
    parts: Dict[bool, bytearray] = {False: bytearray(), True: bytearray()}
    files: Dict[str, List[str]] = {"train": [], "val": []}
    described, duplicates = [], 0
    for name, root, version in sources:
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"sources: {name!r} root {root} is not a directory")
        count = size = 0
        for rel in _text_files(root):
            data = (root / rel).read_bytes()
            digest = hashlib.sha256(data).digest()
            if digest in seen:
                duplicates += 1
                continue
            seen.add(digest)
            path = f"{name}/{rel}"
            held_out = is_validation(path, val_fraction)
            parts[held_out] += data
            files["val" if held_out else "train"].append(path)
            count, size = count + 1, size + len(data)
        described.append({"name": name, "version": version, "root": str(root), "files": count,
                          "bytes": size})
    if not files["train"] or not files["val"]:
        raise ValueError(f"sources: {sum(s['files'] for s in described)} distinct text files give "
                         f"{len(files['train'])} training and {len(files['val'])} validation files; "
                         "need at least one of each (more files or another val_fraction)")
    return Corpus(train=_tensor(parts[False]), val=_tensor(parts[True]), sources=described,
                  files=files, duplicates=duplicates, val_fraction=val_fraction)


def _tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
