"""A byte-level text corpus that needs no download: the Python standard library's own source files.

Selection is deterministic: the top-level `*.py` files of `sysconfig.get_paths()["stdlib"]`, sorted
by name, read as bytes until `max_bytes` (the last file is cut at the limit).  Every
`val_every`-th file (sorted index % val_every == val_every - 1) goes to validation, the rest to
training, so no file is in both.  The corpus differs between Python versions; `Corpus.describe()`
records the version, the file count and a SHA-256 of each split.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch


@dataclass
class Corpus:
    train: torch.Tensor  # [n_train] uint8
    val: torch.Tensor  # [n_val] uint8
    files: List[str]  # the selected file names, sorted
    root: str

    def describe(self) -> dict:
        return {"root": self.root, "python": platform.python_version(), "files": len(self.files),
                "train_bytes": int(self.train.numel()), "val_bytes": int(self.val.numel()),
                "train_sha256": _sha(self.train), "val_sha256": _sha(self.val)}


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def load_stdlib_corpus(max_bytes: int = 4_000_000, val_every: int = 10,
                       root: Optional[str] = None) -> Corpus:
    """Read the corpus (see the module docstring); `root` overrides the stdlib directory."""
    if max_bytes < 1 or val_every < 2:
        raise ValueError(f"max_bytes must be >= 1 and val_every >= 2, got {max_bytes}, {val_every}")
    root_dir = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root_dir.glob("*.py") if p.is_file())
    parts = {True: [], False: []}
    chosen, total = [], 0
    for i, path in enumerate(files):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        total += len(data)
        chosen.append(path.name)
        parts[i % val_every == val_every - 1].append(data)
    if not parts[True] or not parts[False]:
        raise ValueError(f"corpus: {root_dir} gave {len(chosen)} .py files within {max_bytes} bytes; "
                         f"need at least {val_every} for a train/validation split")
    return Corpus(train=_bytes(parts[False]), val=_bytes(parts[True]), files=chosen,
                  root=str(root_dir))


def _bytes(chunks: List[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def random_batch(data: torch.Tensor, batch: int, context: int, generator: torch.Generator) -> torch.Tensor:
    """`[batch, context + 1]` int64 windows at random offsets (inputs = [:, :-1], targets = [:, 1:])."""
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
    return torch.stack([data[s: s + context + 1] for s in starts.tolist()]).long()


def fixed_batches(data: torch.Tensor, count: int, batch: int, context: int) -> List[torch.Tensor]:
    """`count` batches `[batch, context + 1]` of evenly spaced windows (the same for every run)."""
    if data.numel() < context + 1:
        raise ValueError(f"data: {data.numel()} bytes is shorter than one window of {context + 1}")
    n = count * batch
    stride = max(1, (data.numel() - context - 1) // n)
    windows = [data[i * stride: i * stride + context + 1] for i in range(n)]
    return [torch.stack(windows[b * batch:(b + 1) * batch]).long() for b in range(count)]
