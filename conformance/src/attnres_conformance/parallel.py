"""`attnres-conformance --jobs N [--shards K]`: several backends (and K parts of each) at once,
each in its own process.

Each backend runs as `python -m attnres_conformance --backend NAME --json FILE <the other
options>`, with `--shard i/K` for its i-th part when it is split; its progress lines (stderr)
pass straight through, each prefixed with its backend's name, and its stdout is kept for when it
fails to produce a report; a line says each time a run ends ("3/8 runs done").  The CLI then
merges the JSON reports into one (`--merge`).  Processes, not threads: the frameworks keep global state (JAX's
compilation cache, torch's thread pool) and a crash in one must not take the others down.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

#: Options of the parent that a child must not get: it runs one backend and writes one JSON.
PARENT_ONLY = ("--backend", "--jobs", "--shards", "--json", "--markdown", "--report-dir", "--merge")


@dataclass
class ChildRun:
    spec: str
    shard: int  # 0-based part of the backend's cases (0 when not split)
    returncode: int
    json: Path
    stdout: str


def child_argv(argv: Sequence[str]) -> List[str]:
    """`argv` without the parent-only options (`--opt VALUE` and `--opt=VALUE` forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in PARENT_ONLY:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run_children(specs: Sequence[str], argv: Sequence[str], jobs: int, workdir: Path,
                 shards: int = 1) -> List[ChildRun]:
    """Run one child per backend spec and shard (`shards` parts each: `--shard i/shards`), at most
    `jobs` at a time; results in the order of `specs`, then shard."""
    rest = child_argv(argv)
    work = [(spec, i) for spec in specs for i in range(shards)]

    def one(item) -> ChildRun:
        index, (spec, part) = item
        report = workdir / f"{index}.json"
        split = ["--shard", f"{part}/{shards}"] if shards > 1 else []
        run = subprocess.run([sys.executable, "-m", "attnres_conformance", "--backend", spec, "--json", str(report),
                              *split, *rest], stdout=subprocess.PIPE, text=True)
        with lock:
            finished.append(spec)
            part_text = f" shard {part + 1}/{shards}" if shards > 1 else ""
            print(f"attnres-conformance: {len(finished)}/{len(work)} runs done ({spec}{part_text}, "
                  f"exit {run.returncode}) after {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        return ChildRun(spec, part, run.returncode, report, run.stdout)

    finished: List[str] = []
    lock, start = threading.Lock(), time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, enumerate(work)))
